"""Mixed precision: gates stay float32 in a bf16 / fp16 model (so a small optimizer step
is not rounded away and ranks can still adapt), and under torch.autocast a tensorized layer
returns the dtype nn.Linear returns, for every batch size and every plan."""

import pytest
import torch
from torch import nn

from comera_compile.nn import TTEmbedding, TTLinear, TTMLinear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gates_stay_float32_and_adapt_under_a_small_step(dtype):
    torch.manual_seed(0)
    layer = TTLinear(64, 64, ranks=8).to(dtype)
    assert all(c.dtype == dtype for c in layer.cores)
    assert all(g.dtype == torch.float32 for g in layer.gates)
    x = torch.randn(4, 64, dtype=dtype)
    assert layer(x).dtype == dtype
    optimizer = torch.optim.AdamW(layer.gates.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(5):
        layer(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    change = max((g - 1).abs().max().item() for g in layer.gates)
    assert 1e-3 <= change <= 1e-2  # in bf16, 1 - 1e-3 rounds back to exactly 1.0
    assert torch.tensor(1.0 - 1e-3, dtype=torch.bfloat16).item() == 1.0
    assert all(g.dtype == torch.float64 for g in layer.double().gates)


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear])
@pytest.mark.parametrize("bias", [True, False])
def test_autocast_output_dtype_matches_linear_for_every_batch_size(cls, bias):
    torch.manual_seed(0)
    layer, dense = cls(96, 64, ranks=4, bias=bias), nn.Linear(96, 64, bias=bias)
    for rows in (1, 32, 4096):
        x = torch.randn(rows, 96)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = layer(x), dense(x)
        assert got.dtype == want.dtype == torch.bfloat16, rows
        assert layer(x).dtype == torch.float32


def test_autocast_embedding_dtype_matches_nn_embedding():
    torch.manual_seed(0)
    layer, dense = TTEmbedding(1000, 64, ranks=8), nn.Embedding(1000, 64)
    ids = torch.randint(0, 1000, (4, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(ids).dtype == dense(ids).dtype == torch.float32
