"""Report: what optimize did, as a table a person reads and records a program checks."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from comera_compile.compile.state import compiled_state
from comera_compile.nn import TensorizedLayer, TiedEmbeddingHead, TTEmbedding
from comera_compile.passes.advice import narrow_dense_advice
from comera_compile.passes.candidates import Candidate
from comera_compile.passes.specs import LayerSpec
from comera_compile.passes.spectra import relative_error
from comera_compile.tables import text_table

REPORT_ATTR = "_comera_report"  # read and written only through the two functions below


@dataclass
class OptimizeReport:
    """Static facts from ``optimize``: how the model was read, what stayed dense and why."""

    capture_path: str
    capture_reason: str
    budget: str | None = None
    rank: int | None = None
    init: str = "random"
    before: dict[str, int | None] = field(default_factory=dict)  # params, bytes, macs
    originals: dict[str, dict[str, Any]] = field(default_factory=dict)  # per swapped layer
    skipped: dict[str, str] = field(default_factory=dict)
    returned: str = ""  # which form optimize returned, and why
    config: dict[str, Any] | None = None  # the CompressionConfig, as its to_dict wrote it
    caches: dict[str, str] = field(default_factory=dict)  # per table: its hot-row cache, why
    recompute: str | None = None  # what the step recomputes (as recompute="auto" decided)


def attach_report(model: nn.Module, report: OptimizeReport) -> None:
    """Leave ``report`` on ``model`` for ``summary`` (and ``save``) to find."""
    setattr(model, REPORT_ATTR, report)


def report_of(model: nn.Module) -> OptimizeReport | None:
    """The report ``optimize`` (or ``load``) left on ``model``, if any."""
    return getattr(getattr(model, "_orig_mod", model), REPORT_ATTR, None)


def live_spec(layer: TensorizedLayer) -> LayerSpec:
    """The spec a built layer has now (after any pruning)."""
    if isinstance(layer, TTEmbedding):
        return LayerSpec(layer.format, layer.num_embeddings, layer.embedding_dim,
                         layer.row_modes, layer.col_modes, tuple(layer.ranks), False)
    return LayerSpec(layer.format, layer.in_features, layer.out_features, layer.in_modes,
                     layer.out_modes, tuple(layer.ranks), layer.bias is not None)


def _layer_record(name: str, layer: TensorizedLayer, original: dict[str, Any] | None):
    spec = live_spec(layer)
    embedding = isinstance(layer, TTEmbedding)
    if original is None:
        kind = "Embedding" if embedding else "Linear"
        bias = 0 if embedding else spec.out_features * spec.bias
        original = {"original": f"{kind}({spec.in_features}, {spec.out_features})",
                    "params": layer.dense_parameters + bias,
                    "macs_per_row": 0 if embedding else layer.dense_parameters}
    after = sum(p.numel() for p in layer.parameters())
    return {
        "name": name,
        "original": original["original"],
        "format": layer.format,
        "in_modes": list(spec.in_modes),
        "out_modes": list(spec.out_modes),
        "ranks": layer.ranks,
        "effective_ranks": layer.effective_ranks(),
        "params_before": original["params"],
        "params_after": after,
        "compression": original["params"] / after,
        "macs_per_row_before": original["macs_per_row"],
        "macs_per_row_after": spec.macs_per_row(),
        "error": original.get("error"),  # relative, measured when built from dense weights
        "budget_share": original.get("budget_share"),
        "sensitivity": original.get("sensitivity"),  # how much the output feels the layer
        "order": None if embedding else len(spec.in_modes),
        "order_reason": original.get("order_reason", ""),
    }


@dataclass
class Summary:
    """Per-layer records plus model totals; ``str()`` is an aligned table."""

    records: list[dict[str, Any]]
    params_before: int
    params_after: int
    capture_path: str | None = None
    capture_reason: str | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    returned: str = ""
    tied: dict[str, str] = field(default_factory=dict)  # head name -> embedding it reads
    notes: dict[str, str] = field(default_factory=dict)  # per layer: what changed in use
    compiled: str = ""  # whether the model runs compiled, and why
    advice: str = ""  # a better choice for what the model is set up to do, if one is known
    recompute: str | None = None  # what backward recomputes (CompressionConfig.recompute)

    @property
    def compression(self) -> float:
        return self.params_before / self.params_after

    def __str__(self) -> str:
        header = ("layer", "original", "format", "modes", "ranks (effective)",
                  "params", "MACs/row", "budget", "error", "felt")
        rows = []
        for r in self.records:
            sep = " x " if r["format"] == "tt_embedding" else " -> "
            ranks = str(r["ranks"])
            if r["effective_ranks"] != r["ranks"]:
                ranks += f" ({r['effective_ranks']})"
            rows.append((
                r["name"], r["original"], r["format"],
                f"{r['in_modes']}{sep}{r['out_modes']}", ranks,
                f"{r['params_before']:,} -> {r['params_after']:,} ({r['compression']:.1f}x)",
                f"{r['macs_per_row_before']:,} -> {r['macs_per_row_after']:,}",
                "" if r.get("budget_share") is None else f"{r['budget_share']:.1%}",
                "" if r.get("error") is None else f"{r['error']:.3f}",
                "" if r.get("sensitivity") is None else f"{r['sensitivity']:.2f}",
            ))
        lines = []
        if self.capture_path:
            lines.append(f"capture: {self.capture_path} ({self.capture_reason})")
        if self.returned:
            lines.append(f"returned: {self.returned}")
        if self.compiled:
            lines.append(f"compiled: {self.compiled}")
        if self.recompute == "bonds":
            lines.append("recompute: bonds (each block keeps its input and its layers' bonds, "
                         "and recomputes the rest in backward)")
        if self.advice:
            lines.append(f"advice: {self.advice}")
        lines.append(text_table(header, rows))
        lines.append(f"total parameters: {self.params_before:,} -> {self.params_after:,} "
                     f"({self.compression:.1f}x smaller), {len(self.records)} layers tensorized")
        if any(r.get("sensitivity") is not None for r in self.records):
            lines.append("felt: how much the model's output feels an error in the layer's "
                         "output, against an average layer; it weighs the layer's error in "
                         "the allocation")
        for head, embedding in self.tied.items():
            lines.append(f"tied: {head} computes its logits from the cores of {embedding} "
                         "(no weight of its own)")
        if self.notes:
            lines.append(f"notes ({len(self.notes)}):")
            lines += [f"  {name}: {note}" for name, note in self.notes.items()]
        reasons = [r for r in self.records if r["order_reason"]]
        if reasons:
            lines.append("order (modes per side) chosen:")
            lines += [f"  {r['name']}: {r['order_reason']}" for r in reasons]
        if self.skipped:
            lines.append(f"left dense ({len(self.skipped)}):")
            lines += [f"  {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)


def _swapped(model: nn.Module, name: str) -> bool:
    """True when a layer the report left dense was swapped anyway (a tied head or table)."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return False
    return isinstance(module, (TensorizedLayer, TiedEmbeddingHead))


def summary(model: nn.Module) -> Summary:
    """Summarise the tensorized layers of ``model`` (after ``optimize`` or built by hand)."""
    compiled = _compiled(model)
    model = getattr(model, "_orig_mod", model)  # under torch.compile
    report = report_of(model)
    originals = report.originals if report else {}
    records = [_layer_record(name, module, originals.get(name))
               for name, module in model.named_modules()
               if isinstance(module, TensorizedLayer)]
    after = sum(p.numel() for p in model.parameters())
    skipped = {k: v for k, v in (report.skipped if report else {}).items()
               if not _swapped(model, k)}
    if report and report.before.get("params"):
        before = report.before["params"]
    else:
        before = after + sum(r["params_before"] - r["params_after"] for r in records)
    return Summary(
        records, before, after,
        report.capture_path if report else None,
        report.capture_reason if report else None,
        skipped,
        report.returned if report else "",
        {n: m.tied_to for n, m in model.named_modules() if isinstance(m, TiedEmbeddingHead)},
        _notes(model, report),
        compiled,
        "; ".join(a for a in (_advice(report, records), _narrow_dense(model, report, before,
                                                                      after)) if a),
        getattr(report, "recompute", None),
    )


def _narrow_dense(model: nn.Module, report: OptimizeReport | None, before: int,
                  after: int) -> str:
    """The frontier's advice, for models whose compressed layers include Linear ones: the
    race compares stacks of Linear layers, and says nothing of a recommender whose only
    compressed layers are its embedding tables."""
    linear = {m.format for m in model.modules()
              if isinstance(m, TensorizedLayer) and not isinstance(m, TTEmbedding)}
    if not linear:
        return ""
    return narrow_dense_advice(report.init if report else None, before, after, linear)


FROM_SCRATCH_ADVICE = (
    "training from scratch (init='random'): the default format, 'cola' (low rank with SiLU "
    "on the bond), is the one that matches a dense model of equal parameters in the "
    "pretraining race (benchmarks/pretrain.py); TT and low rank trail it there"
)


def _advice(report: OptimizeReport | None, records: list[dict[str, Any]]) -> str:
    """Point a from-scratch run with plain linear formats at the format that pays there."""
    if report is None or report.init != "random":
        return ""
    linear = {r["format"] for r in records if r["format"] != "tt_embedding"}
    full_rank = {"cola", "btt", "monarch"}  # formats made for training from scratch
    return FROM_SCRATCH_ADVICE if linear and not linear & full_rank else ""


def _compiled(model: nn.Module) -> str:
    """How the model runs: the measured compile's account, or plain facts."""
    return compiled_state(model).description


ERROR_WARNING = 0.5  # relative reconstruction error above which optimize warns


def layer_records(model: nn.Module, selection: Any, init: str) -> dict[str, dict[str, Any]]:
    """Per swapped layer: the original, the share of the budget it holds and, for
    ``init="dense"``, the measured relative reconstruction error; warns above 0.5."""
    records = {}
    for name, (cand, _) in selection.chosen.items():
        record = record_original(cand, selection.order_reasons.get(name, ""))
        if name in selection.shares:
            record["budget_share"] = selection.shares[name]
        if name in getattr(selection, "sensitivities", {}):
            record["sensitivity"] = selection.sensitivities[name]
        if init == "dense":
            record["error"] = relative_error(cand, model.get_submodule(name))
            if record["error"] > ERROR_WARNING:
                warnings.warn(
                    f"layer '{name}' keeps only a rough copy of its pretrained weights "
                    f"(relative error {record['error']:.2f}); raise the budget, exclude the "
                    "layer, or recover with comera_compile.training.distill",
                    stacklevel=3,
                )
        records[name] = record
    return records


def _notes(model: nn.Module, report: OptimizeReport | None = None) -> dict[str, str]:
    """Per layer, what a user of the original layer must know (sparse tables, caches)."""
    notes = {}
    reasons = getattr(report, "caches", None) or {}
    for name, module in model.named_modules():
        if not isinstance(module, TTEmbedding):
            continue
        said = []
        if module.declared_sparse:
            small = [str(k) for k, sparse in enumerate(module.sparse_cores()) if not sparse
                     ] if module.sparse_gradients else []
            said.append("declared sparse=True; gradients stay sparse: its TT cores get the "
                        "slices a step reads (dense where a process group is initialized"
                        + (f"; core {', '.join(small)} dense, cheaper to update whole"
                           if small else "")
                        + "), which SGD, Adagrad and SparseAdam take (Adam does not)"
                        + (", its hot-row cache its rows" if module.cache_rows else ""))
        if module.cache_rows:
            said.append(_cache_state(module))
        if reasons.get(name) and not module.cache_rows:
            said.append(reasons[name])
        elif reasons.get(name):
            said.append(f"chosen as it {reasons[name]}")
        if said:
            notes[name] = "; ".join(said)
    return notes


def _cache_state(layer: TTEmbedding) -> str:
    """``hot-row cache: 40,000 rows (640,000 params), 39,112 filled`` or its warm-up."""
    size = f"hot-row cache: {layer.cache_rows:,} rows ({layer.cache.weight.numel():,} params)"
    if layer.cache_filled:
        held = int((layer.cache.ids >= 0).sum())
        return f"{size}, {held:,} filled (fixed)"
    if layer.cache_warmup:
        return (f"{size}, empty: counting ids for {layer.cache_warmup} training batches "
                f"({layer._tally.calls} so far)")
    return f"{size}, empty: fill it with fill_cache(ids)"


def record_original(cand: Candidate, order_reason: str = "") -> dict[str, Any]:
    """What the summary prints for the layer before it was swapped, and why its order."""
    return {"order_reason": order_reason, "original": cand.describe(), "params": cand.dense_params,
            "macs_per_row": 0 if cand.is_embedding else cand.in_features * cand.out_features}

