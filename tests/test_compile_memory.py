"""``memory="low"``: the compiled forward keeps a fraction of the activations for backward
(the rest is recomputed there) and the gradients stay exact."""

import pytest
import torch
import torch.nn.functional as F

import comera_compile.compile as cc
from comera_compile.models.six_encoder import SixEncoderClassifier, SixEncoderConfig
from comera_compile.nn import TTEmbedding, TTLinear


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def encoder() -> SixEncoderClassifier:
    torch.manual_seed(0)
    config = SixEncoderConfig(
        vocab_size=500, hidden=64, ffn=256, heads=4, layers=1, max_position=32, dropout=0.0
    )
    model = SixEncoderClassifier(config)
    layer = model.layers[0]
    for name in ("query", "key", "value", "out"):
        setattr(layer.attention, name, TTLinear(64, 64, ranks=4))
    layer.ffn.fc_in, layer.ffn.fc_out = TTLinear(64, 256, ranks=4), TTLinear(256, 64, ranks=4)
    model.word_embeddings = TTEmbedding(500, 64, ranks=4)
    return model


def saved_mib_and_grads(memory: str):
    """MiB the forward saves for backward, and the gradients, for one compiled step."""
    model = encoder()
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend="comera", options={"inductor": False, "memory": memory}
    )
    ids = torch.randint(0, 500, (4, 32), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 0])
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(compiled(ids), labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(ids), labels).backward()
    eager = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return sum(saved) / 2**20, grads, eager


def test_low_memory_saves_under_half_the_activations_with_exact_gradients():
    default, _, _ = saved_mib_and_grads("default")
    low, grads, eager = saved_mib_and_grads("low")
    assert low < 0.5 * default
    assert grads.keys() == eager.keys()
    for name, grad in eager.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_memory_option_is_checked_at_the_door():
    assert cc.parse_options({"memory": "low"}).memory == pytest.approx(0.3)
    assert cc.parse_options({"memory": 0.5}).memory == 0.5
    with pytest.raises(ValueError, match="'memory' must be one of"):
        cc.parse_options({"memory": "tiny"})
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        cc.parse_options({"memory": 0.0})
