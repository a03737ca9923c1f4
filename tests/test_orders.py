"""TT orders 1 (low-rank) to 4: outputs and gradients equal to the dense reconstruction,
and layer_config forcing an order or the low-rank format."""

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.nn import LowRankLinear, TTLinear


def _layer(order: int) -> TTLinear:
    torch.manual_seed(order)
    if order == 1:
        layer = LowRankLinear(48, 40, ranks=5)
    else:
        layer = TTLinear(48, 40, ranks=5, order=order)
    layer = layer.double()
    with torch.no_grad():
        for gate in layer.gates:
            gate.uniform_(0.5, 1.5)
    return layer


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_order_output_and_gradients_match_dense(order):
    layer = _layer(order)
    assert len(layer.in_modes) == len(layer.out_modes) == order
    x = torch.randn(7, 48, dtype=torch.float64, requires_grad=True)
    target = torch.randn(7, 40, dtype=torch.float64)

    y = layer(x)
    torch.testing.assert_close(y, x @ layer.to_dense().T + layer.bias, rtol=1e-10, atol=1e-10)
    ((y - target) ** 2).sum().backward()
    planned = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    x.grad = None
    layer.zero_grad(set_to_none=True)
    dense = x @ layer.to_dense().T + layer.bias  # autograd through the reconstruction
    ((dense - target) ** 2).sum().backward()
    reference = [x.grad] + [p.grad for p in layer.parameters()]
    assert len(planned) == len(reference) == 1 + 2 * order + (2 * order - 1) + 1
    for got, want in zip(planned, reference):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_lowrank_is_u_times_v():
    layer = _layer(1)
    u, v = layer.cores[0][0], layer.cores[1][..., 0]  # (in, r), (r, out)
    gate = layer.gates[0]
    torch.testing.assert_close(layer.to_dense(), ((u * gate) @ v).T)
    assert layer.rank == 5
    assert sum(p.numel() for p in layer.parameters()) == 5 * (48 + 40) + 5 + 40


def test_lowrank_from_dense_is_truncated_svd():
    torch.manual_seed(0)
    dense = nn.Linear(20, 16).double()
    layer = LowRankLinear.from_dense(dense, ranks=6)
    s = torch.linalg.svdvals(dense.weight.detach())
    err = torch.linalg.matrix_norm(layer.to_dense() - dense.weight.detach())
    torch.testing.assert_close(err, s[6:].norm())  # Eckart-Young: the best rank-6 error


def test_lowrank_refuses_several_modes():
    with pytest.raises(ValueError, match="one mode per side"):
        LowRankLinear(48, 40, ranks=4, order=2)
    with pytest.raises(ValueError, match="one mode per side"):
        LowRankLinear(48, 40, ranks=4, in_modes=[6, 8])


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64))


@pytest.mark.parametrize(
    ("config", "cls", "modes"),
    [
        ({"format": "lowrank"}, LowRankLinear, ((64,), (96,))),
        ({"order": 2}, TTLinear, ((8, 8), (8, 12))),
        ({"order": 3}, TTLinear, ((4, 4, 4), (4, 4, 6))),
    ],
)
def test_layer_config_forces_order_or_lowrank(config, cls, modes):
    model = cc.optimize(_mlp(), layer_config={"0": {**config, "ranks": 4}}, compile=False)
    layer = model.get_submodule("0")
    assert type(layer) is cls
    assert (layer.in_modes, layer.out_modes) == modes
    x = torch.randn(5, 64)
    hidden = torch.relu(x @ layer.to_dense().T + layer.bias)
    torch.testing.assert_close(model(x), model.get_submodule("2")(hidden))


def test_optimize_lowrank_format_dense_init_is_exact_at_full_rank():
    dense = _mlp().double()
    model = cc.optimize(dense, format="lowrank", init="dense", max_rank=64, compile=False)
    assert all(isinstance(m, LowRankLinear) for m in cc.nn.tensorized_layers(model).values())
    x = torch.randn(3, 64, dtype=torch.float64)
    torch.testing.assert_close(model(x), dense(x), rtol=1e-9, atol=1e-9)
