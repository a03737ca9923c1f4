"""What ``load`` checks of a checkpoint's contents against the model it loads into: layouts,
keys, dtypes, aliases of tied tensors and the saved report. Nothing is trusted: a
damaged or crafted checkpoint raises ``CheckpointError`` naming the problem."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from comera_compile.formats import TT_EMBEDDING
from comera_compile.io.format import (
    COMPILED_PREFIX,
    MANIFEST,
    CheckpointError,
    CheckpointLayoutError,
)
from comera_compile.nn import (
    LayoutMismatchError,
    SplitMultiheadAttention,
    TensorizedLayer,
    TiedEmbeddingHead,
    TTEmbedding,
)
from comera_compile.nn.attention import SPLIT_ATTENTION
from comera_compile.nn.base import LAYOUT_KEY, decode_layout, gate_dtype
from comera_compile.nn.tied_head import TIED_HEAD
from comera_compile.passes.report import OptimizeReport, attach_report, report_of, summary
from comera_compile.passes.rewrite import LINEAR_CLASSES, apply_layouts

OUR_LAYERS = (TensorizedLayer, SplitMultiheadAttention, TiedEmbeddingHead)
TENSORIZED_FORMATS = {*LINEAR_CLASSES, TT_EMBEDDING}
KNOWN_FORMATS = {*TENSORIZED_FORMATS, SPLIT_ATTENTION, TIED_HEAD}
LIST_FIELDS = ("ranks", "in_modes", "out_modes", "row_modes", "col_modes")
INT_FIELDS = ("in_features", "out_features", "num_embeddings", "embedding_dim")


def _saved_layouts(tensors: dict[str, torch.Tensor], model: nn.Module) -> dict[str, dict]:
    """``{layer name: layout}`` of the layers whose layouts ride in ``tensors``, as
    ``_layouts`` reads them back: the manifest keeps them so a layout altered in the
    weights file is caught even where the file is not hashed."""
    found = {}
    for key, value in tensors.items():
        if key == LAYOUT_KEY or key.endswith("." + LAYOUT_KEY):
            name = key.removesuffix(LAYOUT_KEY).removesuffix(".").removeprefix(COMPILED_PREFIX)
            if _is_ours(model, name):
                found[name] = decode_layout(value)
    return found


def _is_ours(model: nn.Module, name: str) -> bool:
    """Whether ``name``'s extra state is a layout: a module of the model's own that keeps
    extra state of its own is not one of our layers."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return True  # no such module: the layout names it, apply_layouts refuses it
    if isinstance(module, OUR_LAYERS):
        return True
    return type(module).get_extra_state is nn.Module.get_extra_state


def _layouts(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, dict]:
    """``{layer name: layout}`` from our layers' extra state in ``state``, each checked
    against the saved tensors (so a crafted rank cannot make a layer allocate more)."""
    found = {}
    for key, value in state.items():
        if not (key == LAYOUT_KEY or key.endswith("." + LAYOUT_KEY)):
            continue
        name = key.removesuffix(LAYOUT_KEY).removesuffix(".")
        if not _is_ours(model, name):
            continue
        try:
            layout = decode_layout(value)
        except (ValueError, RecursionError, TypeError, OverflowError):
            layout = None  # not UTF-8, not JSON, nested too deep
        if not isinstance(layout, dict) or not isinstance(layout.get("format"), str):
            raise CheckpointError(
                f"the layout of layer '{name}' in the checkpoint is not readable (a JSON object "
                "with a 'format'); save the model again"
            )
        found[name] = layout
    for name, layout in found.items():
        _check_layout(_holder(name, layout, found, state), layout, state)
    return found


def _holder(name: str, layout: dict[str, Any], layouts: dict[str, dict], state) -> str:
    """The name the layer's tensors were saved under: its own, or that of the layer it
    shares (``save_pretrained`` writes a tied table once)."""
    if f"{name}.cores.0" in state:
        return name
    shared = (o for o, same in layouts.items() if same == layout and f"{o}.cores.0" in state)
    return next(shared, name)


def _check_layout(name: str, layout: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """Sizes and ranks are positive ints, the ranks those of the saved gates."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(
            f"the layout of layer '{name}' in the checkpoint {what}; save the model again"
        )

    for field, value in layout.items():
        if field in LIST_FIELDS:
            if not isinstance(value, list) or not value:
                raise bad(f"has '{field}' = {str(value)[:80]}, not a list of positive integers")
            values = value
        elif field in INT_FIELDS:
            values = [value]
        else:
            continue
        if not all(type(v) is int and v > 0 for v in values):
            raise bad(f"has '{field}' = {str(value)[:80]}, not positive integers")
    if layout["format"] not in KNOWN_FORMATS:
        raise bad(f"has an unknown format {layout['format'][:40]!r}")
    threshold = layout.get("threshold", 0.0)
    if type(threshold) not in (int, float):
        raise bad(f"has a threshold {str(threshold)[:80]}, not a number")
    ranks = layout.get("ranks")
    if ranks is None:
        if layout["format"] in TENSORIZED_FORMATS:
            raise bad("lacks 'ranks'")
        return
    gates = [state.get(f"{name}.gates.{k}") for k in range(len(ranks) - 2)]
    saved = [None if g is None else g.numel() for g in gates]
    if len(ranks) < 2 or ranks[0] != 1 or ranks[-1] != 1 or saved != ranks[1:-1]:
        raise bad(f"has ranks {str(ranks)[:80]} where its saved gates have sizes {saved}")
    try:
        with torch.device("meta"):  # the cores the layout implies, allocating nothing
            cores = [tuple(c.shape) for c in _layer_of(layout).cores]
        if layout["format"] == TT_EMBEDDING and "cores" not in layout:  # chain order, as
            cores = [(c[1], c[0], *c[2:]) for c in cores]  # saved before slices first
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(f"does not describe a layer ({type(exc).__name__}: {str(exc)[:120]})") from None
    saved_cores = [tuple(state[f"{name}.cores.{k}"].shape) if f"{name}.cores.{k}" in state
                   else None for k in range(len(cores))]
    if cores != saved_cores:
        raise bad(f"implies cores {cores} where the weights hold {saved_cores}")


def _layer_of(layout: dict[str, Any]) -> TensorizedLayer:
    """The layer a layout describes, as ``layer_from_layout`` builds it (sizes only)."""
    ranks = layout["ranks"][1:-1]
    if layout["format"] == TT_EMBEDDING:
        return TTEmbedding(layout["num_embeddings"], layout["embedding_dim"], ranks=ranks,
                           row_modes=layout["row_modes"], col_modes=layout["col_modes"],
                           cache_rows=layout.get("cache_rows", 0))
    cls = LINEAR_CLASSES[layout["format"]]
    return cls(layout["in_features"], layout["out_features"], ranks=ranks,
               in_modes=layout["in_modes"], out_modes=layout["out_modes"], bias=False)


def _fill_ties(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Add the keys of tensors the model ties to a saved one (``save_pretrained`` writes a
    tied tensor under one name only)."""
    groups: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), []).append(key)
    for keys in groups.values():
        saved = next((k for k in keys if k in state), None)
        if saved is not None:
            for key in keys:
                state.setdefault(key, state[saved])


def _check_keys(model: nn.Module, state: dict[str, torch.Tensor], manifest: dict) -> None:
    expected = set(model.state_dict().keys())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if not (missing or unexpected):
        return
    saved = manifest.get("model_class", "another model")

    def few(keys: list[str]) -> str:
        return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's tensors are not in it ({few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} of its tensors have no place here ({few(unexpected)})")
    raise CheckpointError(
        f"the checkpoint (of {saved}) does not fit {type(model).__name__}: "
        f"{'; '.join(parts)}; pass a model built with the configuration that was saved"
    )


def _take_saved_dtypes(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Floating parameters and buffers take the dtype they were saved in: a model rebuilt
    from its config is float32, and copying bfloat16 weights into it would keep their values
    but compute in float32, so its outputs would not be the saved model's."""
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        saved = state.get(name)
        if (isinstance(saved, torch.Tensor) and saved.is_floating_point()
                and tensor.is_floating_point() and saved.dtype != tensor.dtype):
            tensor.data = tensor.data.to(saved.dtype)


def _apply_layouts(model: nn.Module, layouts: dict[str, dict]) -> None:
    """``apply_layouts``, its refusals raised as ``CheckpointError``."""
    try:
        apply_layouts(model, layouts)
    except LayoutMismatchError as exc:
        raise CheckpointLayoutError(str(exc)) from None
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    except (KeyError, TypeError, IndexError, ZeroDivisionError) as exc:  # a field missing
        raise CheckpointError(f"a layer layout in the checkpoint is damaged ({type(exc).__name__}: "
                              f"{str(exc)[:120]}); save the model again") from None


def _check_saved_layouts(found: dict[str, dict], manifest: dict) -> None:
    """The layouts in the weights file are those the manifest recorded at save: a layer's
    format, modes or threshold changed in the file would load other outputs silently
    (CoLA, low rank and a TT of one mode per side have cores of the same shapes)."""
    recorded = manifest.get("layouts")
    if recorded is None:
        return  # save_pretrained output: the weights file is all there is
    for name in sorted(set(found) | set(recorded)):
        if found.get(name) != recorded.get(name):
            raise CheckpointError(
                f"the layout of layer '{name}' in the weights file ({str(found.get(name))[:120]}) "
                f"is not the one {MANIFEST} recorded at save ({str(recorded.get(name))[:120]}); "
                "the files are of different saves or altered: save the model again"
            )


def _check_aliases(model: nn.Module, manifest: dict) -> None:
    """An alias may only join two names the model itself ties (one tensor under both)."""
    tensors = model.state_dict(keep_vars=True)
    for alias, key in manifest["aliases"].items():
        if alias in tensors and key in tensors and tensors[alias] is not tensors[key]:
            raise CheckpointError(
                f"{MANIFEST} ties '{alias}' to '{key}', which {type(model).__name__} does not "
                "tie: loading would give one tensor's values to both; save the model again"
            )


def _check_dtypes(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Each saved tensor has a dtype its module can compute with: the kind the model holds
    there (floating or not, an integer exactly), one floating dtype for all of a module's
    own tensors, rank gates in the dtype ``gate_dtype`` gives their cores, and a floating
    dtype other than the model's own only where the whole checkpoint is of that dtype (a
    model cast as a whole, ``model.to(torch.bfloat16)``)."""

    def refuse(key: str, saved: torch.dtype, why: str) -> CheckpointError:
        return CheckpointError(
            f"'{key}' is saved as {saved}, but {why}; the weights file is altered: save the "
            "model again"
        )

    lists = (nn.ParameterList, nn.ParameterDict)
    cast: dict[str, tuple[torch.dtype, torch.dtype]] = {}  # key -> (saved, the model's)
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, lists):
            continue  # its parent's tensors (a layer's cores and gates)
        dot = f"{prefix}." if prefix else ""
        own = {**dict(module.named_parameters(recurse=False)),
               **dict(module.named_buffers(recurse=False))}
        for child_name, child in module.named_children():
            if isinstance(child, lists):
                own.update({f"{child_name}.{n}": p
                            for n, p in child.named_parameters(recurse=False)})
        floating: dict[torch.dtype, str] = {}
        gates = []
        for name, tensor in own.items():
            key = dot + name
            saved = state.get(key)
            if not isinstance(saved, torch.Tensor) or tensor is None:
                continue  # not saved (non-persistent): _check_keys names a missing one
            if saved.is_floating_point() != tensor.is_floating_point() or (
                    not saved.is_floating_point() and saved.dtype != tensor.dtype):
                raise refuse(key, saved.dtype, f"the model holds {tensor.dtype} there")
            if saved.dtype.itemsize == 1 and saved.dtype != tensor.dtype:  # float8
                raise refuse(key, saved.dtype, f"the model holds {tensor.dtype} there")
            if saved.is_floating_point() and isinstance(module, TensorizedLayer) and (
                    name.startswith("gates.")):
                gates.append((key, saved.dtype))
            elif saved.is_floating_point():
                floating.setdefault(saved.dtype, key)
                cast[key] = (saved.dtype, tensor.dtype)
        if len(floating) > 1:
            (a, key_a), (b, key_b) = list(floating.items())[:2]
            raise refuse(key_b, b, f"'{key_a}' of the same module is saved as {a}")
        for key, dtype in gates:
            want = gate_dtype(next(iter(floating), dtype))
            if dtype != want:
                raise refuse(key, dtype, f"a rank gate of this layer's cores is {want}")
    dtypes = {saved for saved, _ in cast.values()}
    if len(dtypes) > 1:
        for key, (saved, own) in cast.items():
            if saved != own:
                raise refuse(key, saved, f"the model holds {own} there and the checkpoint "
                             f"mixes {', '.join(sorted(str(d) for d in dtypes))}")


REPORT_TYPES = {"capture_path": str, "capture_reason": str, "budget": (str, type(None)),
                "rank": (int, type(None)), "init": str, "before": dict, "originals": dict,
                "skipped": dict, "returned": str, "config": (dict, type(None))}


def _check_report(data: dict[str, Any], model: nn.Module) -> OptimizeReport:
    """The saved report as ``summary`` and ``config_of`` read it, or ValueError/TypeError
    (any exception) naming what does not fit."""
    for field, kind in REPORT_TYPES.items():
        if field in data and not isinstance(data[field], kind):
            raise TypeError(f"'{field}' is a {type(data[field]).__name__}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["skipped"].items()):
        raise TypeError("'skipped' is not an object of reasons")
    if not all(isinstance(v, dict) for v in data.get("originals", {}).values()):
        raise TypeError("'originals' is not an object of layer records")
    report = OptimizeReport(**data)  # a missing capture_path / capture_reason: TypeError
    if report.config is not None:
        from comera_compile.config import CompressionConfig

        CompressionConfig.from_dict(report.config)
    before = report_of(model)
    attach_report(model, report)
    try:
        str(summary(model))  # every field summary reads, of the types it formats
    finally:
        attach_report(model, before)
    return report


def _loaded_report(manifest: dict, model: nn.Module) -> OptimizeReport | None:
    data = manifest.get("report")
    if not data:
        return None
    try:
        return _check_report({"skipped": {}, **data}, model)
    except Exception as exc:  # noqa: BLE001 - a report is a record: any fault drops it
        warnings.warn(f"the report in {MANIFEST} does not describe the loaded model "
                      f"({type(exc).__name__}: {str(exc)[:120]}); it was dropped, so summary shows "
                      "the live layers only", stacklevel=3)
        return None
