"""The optimized model is a drop-in for the user's: same class, methods, attributes and
train() / eval() behaviour; a GraphModule only where it is exact."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.nn import TTLinear


class FunctionalDropout(nn.Module):
    """Reads ``self.training`` in its forward: a traced graph would freeze the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(128, 256)
        self.fc2 = nn.Linear(256, 128)
        self.scale = 2.0

    def forward(self, x):
        h = F.dropout(torch.relu(self.fc1(x)), 0.5, self.training)
        return self.fc2(h)

    def predict(self, x):
        return self(x).argmax(-1) * self.scale


def test_result_keeps_class_methods_attributes_and_eval_is_deterministic():
    torch.manual_seed(0)
    model = FunctionalDropout()
    result = cc.optimize(model, 0.3, example_inputs=torch.randn(4, 128), compile=False)
    assert type(result) is FunctionalDropout and isinstance(result.fc1, TTLinear)
    assert result.scale == 2.0 and result is not model
    x = torch.randn(8, 128)
    result.eval()
    with torch.no_grad():
        first, second = result(x), result(x)
        assert torch.equal(first, second)
        assert result.predict(x).shape == (8,)
    result.train()
    with torch.no_grad():
        assert not torch.equal(result(x), result(x))  # dropout is live again in train()
    table = str(cc.summary(result))
    assert "returned: FunctionalDropout, the model's own class" in table
    assert "reads self.training" in table
    with pytest.raises(ValueError, match="reads self.training"):
        cc.to_graph_module(result)
    compiled = cc.optimize(model, 0.3)  # compiled in place: still the user's class
    assert type(compiled) is FunctionalDropout and compiled._compiled_call_impl is not None


def test_graph_module_where_exact_shares_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Dropout(0.5), nn.Linear(256, 128))
    result = cc.optimize(model, 0.3, compile=False)
    assert "GraphModule is exact" in cc.summary(result).returned
    graph = cc.to_graph_module(result)
    assert isinstance(graph, torch.fx.GraphModule)
    assert any(p is q for p in graph.parameters() for q in result.parameters())
    x = torch.randn(4, 128)
    graph.eval()
    result.eval()
    with torch.no_grad():
        assert torch.equal(graph(x), result(x))
        assert torch.equal(graph(x), graph(x))


def test_meta_model_materializes_only_cores():
    """A model built on the meta device: optimize(init="random") allocates the cores and the
    small remaining tensors, never a dense weight of a swapped layer."""
    import transformers
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LargestTensor(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    self.most = max(self.most, t.numel())
            return out

    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with LargestTensor() as watch:
        result = cc.optimize(model, 0.1, compile=False)
    assert watch.most < 4096 * 64 / 8  # the embedding and head tables are 4096 x 64
    assert not any(t.is_meta for t in (*result.parameters(), *result.buffers()))
    reference = transformers.LlamaForCausalLM(config)
    torch.testing.assert_close(result.model.rotary_emb.inv_freq,
                               reference.model.rotary_emb.inv_freq)
    with torch.no_grad():
        logits = result(torch.randint(0, 4096, (2, 7))).logits
    assert logits.shape == (2, 7, 4096) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="meta device.*init='random'"):
        cc.optimize(model, 0.1, init="dense", compile=False)
