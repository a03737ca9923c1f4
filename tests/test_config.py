"""CompressionConfig and CompileOptions: checked when built, JSON round trips, kept in the
checkpoint, and optimize's keywords as a front that builds the same config."""

import dataclasses
import json

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.compile import compile_model


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"format": "tucker"}, ValueError, "format must be one of"),
    ({"init": "svd"}, ValueError, "init must be one of"),
    ({"max_rank": 0}, ValueError, "max_rank must be a positive int"),
    ({"objective": "fastest"}, ValueError, "objective"),
    ({"budget": 2.0}, ValueError, "fraction of parameters to keep"),
    ({"budget": 40}, ValueError, r"'40x' or Budget\(ratio=40\)"),
    ({"autotune": 1}, TypeError, "'autotune' must be a bool"),
    ({"compile": False, "compile_options": {"memory": "low"}}, ValueError,
     "acts while compiling"),
    ({"compile_options": {"memroy": "low"}}, ValueError, r"unknown CompileOptions fields"),
    ({"layer_config": {"0": {"rank": 4}}}, ValueError, r"unknown settings \['rank'\]"),
])
def test_compression_config_checks_every_field_when_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        cc.CompressionConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"memory": "tiny"}, "'memory' must be one of"),
    ({"memory": 1.5}, r"must lie in \(0, 1\]"),
    ({"host_memory": "keep"}, "'host_memory' must be one of"),
    ({"cudagraphs": "yes"}, "'cudagraphs' must be a bool"),
    ({"inductor_config": ["max_autotune"]}, "must be a dict"),
])
def test_compile_options_check_every_field_when_built(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cc.CompileOptions(**kwargs)


@pytest.mark.parametrize("budget", [0.25, 5000, "20KB", "5%", "40x",
                                    cc.Budget(ratio=8, params=4000), None])
def test_configs_round_trip_through_json(budget):
    config = cc.CompressionConfig(
        budget=budget, format="ttm", max_rank=8, include=["0"], objective="flops",
        compile_options=cc.CompileOptions(memory=0.5, host_memory="release", autotune=True,
                                          inductor_config={"max_autotune": False}))
    text = json.dumps(config.to_dict())
    # host_memory is process-wide, a runtime setting: the saved config leaves it out
    saved = dataclasses.replace(config, compile_options=dataclasses.replace(
        config.compile_options, host_memory="auto"))
    assert "host_memory" not in config.to_dict()["compile_options"]
    assert cc.CompressionConfig.from_dict(json.loads(text)) == saved
    options = saved.compile_options
    assert cc.CompileOptions.from_dict(json.loads(json.dumps(options.to_dict()))) == options
    old = {**options.to_dict(), "host_memory": "release"}  # as checkpoints wrote it before
    assert cc.CompileOptions.from_dict(old).host_memory == "release"


def test_numpy_values_and_tuples_are_saved_as_json():
    import numpy as np

    config = cc.CompressionConfig(max_rank=np.int64(8), include=("0", "2"),
                                  layer_config={"0": {"ranks": (np.int64(4),)}})
    data = json.loads(json.dumps(config.to_dict()))
    assert data["max_rank"] == 8 and data["include"] == ["0", "2"]
    assert data["layer_config"] == {"0": {"ranks": [4]}}


def test_compile_options_become_the_backend_options_dict():
    options = cc.CompileOptions(memory="low", host_memory="auto", absorb_attention=False,
                                inductor_config={"max_autotune": False})
    assert options.to_backend_options() == {"memory": "low", "absorb_attention": False,
                                            "max_autotune": False}
    parsed = cc.CompileOptions.from_backend_options(options.to_backend_options())
    assert parsed == options
    assert parsed.activation_budget == 0.999 and not parsed.absorb_attention
    assert parsed.inductor_config["max_autotune"] is False
    with pytest.raises(ValueError, match="unknown comera backend options"):
        cc.CompileOptions.from_backend_options(
            cc.CompileOptions(inductor_config={"no_such_entry": 1}))


def test_optimize_takes_a_config_and_its_shortcuts_build_the_same_one():
    config = cc.CompressionConfig(budget=0.5, max_rank=4, compile=False)
    by_config = cc.optimize(mlp(), config)
    by_shortcuts = cc.optimize(mlp(), cc.CompressionConfig(max_rank=4), budget=0.5,
                               compile=False)
    assert cc.config_of(by_config) == cc.config_of(by_shortcuts) == config
    assert cc.optimize(mlp(), config=config).state_dict().keys() == by_config.state_dict().keys()
    for a, b in zip(by_config.parameters(), by_shortcuts.parameters()):
        assert a.shape == b.shape
    # a shortcut beside a config replaces that field; one left at None keeps the config's
    halved = cc.optimize(mlp(), config, budget=0.25)
    assert cc.config_of(halved) == dataclasses.replace(config, budget=0.25)
    assert cc.config_of(cc.optimize(mlp(), config, format=None)) == config
    # a budget where the config goes is the budget
    assert cc.config_of(cc.optimize(mlp(), 0.5, compile=False)).budget == 0.5
    ratio = cc.config_of(cc.optimize(mlp(), cc.Budget(ratio=2), compile=False))
    assert ratio.budget == cc.Budget(ratio=2)
    with pytest.raises(TypeError, match="max_rank"):
        cc.optimize(mlp(), config, max_rank=8)  # not a shortcut: set it on the config
    with pytest.raises(TypeError, match="CompressionConfig"):
        cc.optimize(mlp(), 0.5, budget=0.25)
    with pytest.raises(TypeError, match="CompressionConfig"):
        cc.optimize(mlp(), config={"budget": 0.5})
    with pytest.raises(ValueError, match="acts while compiling"):
        cc.optimize(mlp(), cc.CompressionConfig(
            compile_options=cc.CompileOptions(memory="low")), compile=False)


def test_the_config_is_saved_with_the_checkpoint(tmp_path):
    config = cc.CompressionConfig(budget=cc.Budget(ratio=2), max_rank=4, compile=False)
    model = cc.optimize(mlp(), config)
    cc.save(model, tmp_path / "ckpt")
    loaded = cc.load(tmp_path / "ckpt", mlp())
    assert cc.config_of(loaded) == config
    assert cc.config_of(mlp()) is None


def test_small_int_budgets_are_refused_with_the_spellings_meant():
    with pytest.raises(ValueError, match=r"budget=1 is an int.*budget=1\.0 keeps everything"):
        cc.optimize(mlp(), 1, compile=False)
    with pytest.raises(ValueError, match=r"budget=0\.4 or '40%'.*'40x'.*Budget\(params=40\)"):
        cc.optimize(mlp(), 40, compile=False)
    everything = cc.optimize(mlp(), 1.0, compile=False)
    assert cc.summary(everything) is not None
    assert cc.Budget(params=40).params == 40  # a small count said on purpose is accepted


def test_compile_model_takes_options_or_keywords():
    model = mlp()
    assert compile_model(model, inplace=True, inductor=False) is model
    assert compile_model(mlp(), cc.CompileOptions(inductor=False), inplace=True) is not None
    with pytest.raises(ValueError, match="not both"):
        compile_model(mlp(), cc.CompileOptions(), memory="low")
    torch._dynamo.reset()


def test_optimize_shortcuts_are_config_fields():
    import inspect

    parameters = inspect.signature(cc.optimize).parameters
    assert len(parameters) <= 8
    fields = {f.name for f in dataclasses.fields(cc.CompressionConfig)}
    shortcuts = set(parameters) - {"model", "config", "example_inputs", "inplace"}
    assert shortcuts == {"budget", "format", "init", "compile"} and shortcuts <= fields
    # each default is written once, on the config: every shortcut's is None
    assert all(parameters[name].default is None for name in shortcuts)
