"""Every bad input to optimize gets an error that says what is wrong and how to fix it."""

import pytest
import torch
from models import MLP
from torch import nn

import comera_compile.api as cc
from comera_compile.passes import parse_budget


def test_unreachable_budget_gives_smallest_reachable_size():
    with pytest.raises(
        ValueError,
        match=r"smallest reachable: [\d,]+ parameters \(\d+\.\d% of "
        r"the model\).*rank 1; raise the budget",
    ):
        cc.optimize(MLP(), 0.001)


def test_unreachable_bytes_budget_names_bytes():
    with pytest.raises(ValueError, match=r"smallest reachable: .* bytes"):
        cc.optimize(MLP(), "10KB")


def test_model_without_linear_or_embedding():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    with pytest.raises(ValueError, match=r"no nn.Linear, nn.Embedding or nn.EmbeddingBag.*Conv2d"):
        cc.optimize(model, 0.5)


@pytest.mark.parametrize("budget", ["20 parsecs", "MB", "1.2.3GB", "abc%", [0.5], 1.5, -3])
def test_budget_that_does_not_parse(budget):
    with pytest.raises(ValueError, match=r"accepted forms|fraction of parameters|positive"):
        cc.optimize(MLP(), budget)


def test_budget_string_error_lists_forms():
    with pytest.raises(ValueError, match=r"budget '20 parsecs'; accepted forms: .*'20MB'"):
        parse_budget("20 parsecs")


def test_example_inputs_of_wrong_shape():
    with pytest.raises(
        ValueError,
        match=r"example_inputs do not fit the model \(input 0: \(4, 7\) "
        r"float32\).*module 'net.0' \(Linear\)",
    ):
        cc.optimize(MLP(), 0.3, example_inputs=torch.randn(4, 7))


def test_ranks_larger_than_modes_allow():
    config = {"net.0": {"in_modes": [16, 16], "out_modes": [16, 32], "ranks": [40, 50, 20]}}
    with pytest.raises(
        ValueError,
        match=r"layer_config for 'net.0': ranks \[40, 50, 20\] are "
        r"larger than the modes .* allow",
    ):
        cc.optimize(MLP(), cc.CompressionConfig(layer_config=config))


def test_unknown_layer_config_setting():
    with pytest.raises(ValueError, match=r"unknown settings \['rank'\]; accepted"):
        cc.optimize(MLP(), cc.CompressionConfig(layer_config={"net.0": {"rank": 4}}))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"init": "svd"}, "init must be one of"),
        ({"format": "cp"}, "format must be one of"),
        ({"max_rank": 0}, "max_rank must be a positive int"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cc.optimize(MLP(), cc.CompressionConfig(**kwargs))


def test_flops_budget_needs_example_inputs():
    with pytest.raises(ValueError, match="flops budget needs example_inputs"):
        cc.optimize(MLP(), cc.Budget(flops=1000))


def test_not_a_module():
    with pytest.raises(TypeError, match="optimize takes an nn.Module"):
        cc.optimize(lambda x: x)


def test_host_memory_needs_compiling_and_a_known_setting():
    with pytest.raises(ValueError, match=r"host_memory='reuse' acts while compiling"):
        cc.optimize(MLP(), cc.CompressionConfig(budget=0.5,
                                                compile_options=cc.CompileOptions(host_memory="reuse")),
                    compile=False)
    modes = r"\['auto', 'off', 'cache', 'reuse', 'release'\]"
    with pytest.raises(ValueError, match=r"'host_memory' must be one of " + modes):
        cc.optimize(MLP(), cc.CompressionConfig(budget=0.5,
                                                compile_options=cc.CompileOptions(host_memory="keep")))
