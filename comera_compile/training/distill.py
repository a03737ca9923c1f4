"""Distillation: recover a compressed model by training it to match its dense original.

    student = cc.optimize(copy.deepcopy(teacher), 0.75, init="dense", compile=False)
    losses = cc.training.distill(student, teacher, batches, steps=500)
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from comera_compile.formats import is_lowrank_table
from comera_compile.formats.whiten import gram_factor
from comera_compile.nn import LowRankLinear, TensorizedLayer, TTEmbedding
from comera_compile.nn.tt_embedding import weighted_lowrank_cores
from comera_compile.passes.inputs import (
    as_call,
    model_output,
    quiet_eval,
    real_rows,
    token_mask,
)
from comera_compile.training.batching import length_grouped


def distill_loss(student: Tensor, teacher: Tensor) -> Tensor:
    """Relative squared error ``||s - t||^2 / ||t||^2``: 0 when equal, scale-free."""
    teacher = teacher.detach()
    return (student - teacher).square().sum() / teacher.square().sum().clamp_min(1e-12)


class _Recorder:
    """Forward hooks that keep the outputs of named submodules for one call."""

    def __init__(self, model: nn.Module, names: Sequence[str], role: str,
                 lenient: bool = False) -> None:
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"{role} has no submodule {missing[0]!r} to match; a captured "
                             "graph inlines submodules: optimize a copy with inplace=True")
        self.outputs: dict[str, Tensor] = {}
        self.lenient = lenient
        self.handles = [modules[n].register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name: str) -> Callable:
        def hook(module, inputs, output):
            try:
                self.outputs[name] = model_output(output)
            except TypeError:
                if not self.lenient:
                    raise
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def distill(student: nn.Module, teacher: nn.Module, batches: Iterable[Any], *,
            steps: int | None = None, lr: float = 3e-4,
            optimizer: torch.optim.Optimizer | None = None,
            output_fn: Callable[[Any, Any], Tensor] | None = None,
            layers: Sequence[str] | None = None, layer_weight: float = 1.0,
            time_limit: float | None = None, dropout: bool = False, group_by_length: bool = True,
            progress: bool = True) -> list[float]:
    """Train ``student`` to reproduce ``teacher`` on ``batches``; returns the loss per step.

    ``batches`` are passed over until ``steps`` or ``time_limit`` (one pass by default);
    ``output_fn(output, batch)`` picks the tensor to match and ``layers`` adds submodule
    outputs, weighted by ``layer_weight``. The teacher is never updated.
    """
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be a positive int or None, got {steps!r}")
    pick = output_fn or (lambda output, batch: model_output(output))
    params = [p for p in student.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the student has no trainable parameters")
    optimizer = optimizer or torch.optim.Adam(params, lr=lr)
    endless = steps is not None or time_limit is not None
    grouped = (length_grouped(batches, passes=None if endless else 1)
               if group_by_length and isinstance(batches, (list, tuple)) else None)
    if grouped is not None:
        data = grouped
    else:
        data = _repeated(batches) if endless else iter(batches)
    stream = itertools.islice(data, steps) if steps is not None else data
    lenient = layers is None  # blocks found by rule: one without a tensor output is skipped
    if layers is None:
        layers = repeated_blocks(student, teacher)
    recorders = [_Recorder(teacher, layers, "the teacher", lenient),
                 _Recorder(student, layers, "the student", lenient)]
    modes = [(m, m.training) for m in (*student.modules(), *teacher.modules())]
    student.train(dropout)
    teacher.eval()
    losses: list[float] = []
    bar = _progress(steps, progress)
    start = time.perf_counter()
    try:
        for batch in stream:
            args, kwargs = as_call(batch)
            mask = token_mask(batch)
            with torch.no_grad():
                target = pick(teacher(*args, **kwargs), batch)
            got = pick(student(*args, **kwargs), batch)
            loss = distill_loss(real_rows(got, mask), real_rows(target, mask))
            theirs, mine = recorders[0].outputs, recorders[1].outputs
            for name in layers:  # in a fixed order: the same sum on every run
                if name in theirs and name in mine:
                    loss = loss + layer_weight * distill_loss(real_rows(mine[name], mask),
                                                              real_rows(theirs[name], mask))
            for recorder in recorders:
                recorder.outputs.clear()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if time_limit is not None and time.perf_counter() - start > time_limit:
                break
    finally:
        for recorder in recorders:
            recorder.remove()
        for module, mode in modes:
            module.training = mode
        if bar is not None:
            bar.close()
    return losses


def repeated_blocks(student: nn.Module, teacher: nn.Module) -> list[str]:
    """The items of the teacher's outermost ``nn.ModuleList``s of two or more modules of one
    class (a transformer's layers) that the student has under the same name and class: the
    hidden states worth matching. A captured student (no submodules) has none."""
    found: list[str] = []
    mine = dict(student.named_modules())
    for name, module in teacher.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if any(name.startswith(block + ".") for block in found):
            continue  # a list inside a block already matched
        if len({type(item) for item in module}) != 1:
            continue
        items = [f"{name}.{i}" if name else str(i) for i in range(len(module))]
        if all(type(mine.get(item)) is type(module[i]) for i, item in enumerate(items)):
            found += items
    return found


def _repeated(batches: Iterable[Any]) -> Iterator[Any]:
    """Pass after pass over ``batches`` (a one-shot iterator: what it gave, replayed)."""
    if iter(batches) is batches:
        yield from itertools.cycle(batches)
        return
    while True:
        empty = True
        for batch in batches:
            empty = False
            yield batch
        if empty:
            return


class _Enough(Exception):
    """Stops a capture forward once every layer of interest has seen its input."""


class _Inputs:
    """What one layer saw: integer ids with their counts, or the Gram of float features."""

    def __init__(self) -> None:
        self.ids: list[Tensor] = []
        self.gram: Tensor | None = None
        self.rows = 0

    def add(self, x: Tensor) -> None:
        if not x.is_floating_point():
            self.ids.append(x.detach().reshape(-1).cpu())
            return
        x2 = x.detach().reshape(-1, x.shape[-1]).double()
        gram = x2.T @ x2
        self.gram = gram if self.gram is None else self.gram + gram
        self.rows += x2.shape[0]

    def mean_gram(self) -> Tensor | None:
        """``X^T X / rows`` of the recorded float inputs (None for ids)."""
        return None if self.gram is None else self.gram / max(self.rows, 1)

    def row_frequencies(self, uniform: float, num_rows: int) -> Tensor | None:
        """The distribution ``sampler`` draws ids from (float64), None for float inputs."""
        if not self.ids:
            return None
        counts = torch.bincount(torch.cat(self.ids).long(), minlength=num_rows).double()
        return (1 - uniform) * counts / counts.sum() + uniform / num_rows

    def sampler(self, sample: int, uniform: float, num_rows: int) -> Callable[[], Tensor]:
        """Inputs for one step: ids drawn by frequency (plus ``uniform`` share drawn evenly
        over the table, so unseen rows are not forgotten), or the Gram's square root, whose
        rows reproduce ``sum x^T x`` exactly (the loss on them is the loss on all rows)."""
        if self.gram is not None:  # a Cholesky factor L (G = L L^T): the rows of L^T
            rows = gram_factor(self.gram / max(self.rows, 1), damping=1e-6).T.float()
            return lambda: rows
        ids, counts = torch.unique(torch.cat(self.ids), return_counts=True)
        probs = counts.double() / counts.sum()
        spread = int(round(sample * uniform))

        def draw() -> Tensor:
            picked = ids[torch.multinomial(probs, sample - spread, replacement=True)
                         ] if sample > spread else ids[:0]
            return torch.cat([picked, torch.randint(num_rows, (spread,))])
        return draw


def compressed_layers(student: nn.Module, teacher: nn.Module) -> list[str]:
    """Names of the student's tensorized layers that replace a same-named teacher layer."""
    dense = dict(teacher.named_modules())
    return [name for name, module in student.named_modules()
            if isinstance(module, TensorizedLayer) and name in dense
            and not isinstance(dense[name], TensorizedLayer)]


def fit_layers(student: nn.Module, teacher: nn.Module, batches: Iterable[Any], *,
               layers: Sequence[str] | None = None, time_limit: float = 60.0,
               steps: int | None = None, lr: float = 1e-3, sample: int = 2048, uniform: float = 0.1,
               progress: bool = True) -> dict[str, tuple[float, float]]:
    """Fit each compressed layer to its dense original on the inputs it sees; in place.

    Each layer takes ``steps`` Adam steps (or its share of ``time_limit``) and keeps the best
    state seen. Returns ``{name: (loss before, loss after)}``.
    """
    if not 0.0 <= uniform <= 1.0:
        raise ValueError(f"uniform is a share of the sampled ids, in [0, 1]; got {uniform!r}")
    names = list(compressed_layers(student, teacher) if layers is None else layers)
    dense, small = dict(teacher.named_modules()), dict(student.named_modules())
    missing = [n for n in names if n not in dense or n not in small]
    if missing:
        raise ValueError(f"no layer {missing[0]!r} in both models; a captured graph inlines "
                         "submodules: optimize a copy with inplace=True")
    if not names:
        return {}
    start = time.perf_counter()
    seen = {name: _Inputs() for name in names}
    _capture(teacher, batches, seen, dense, None if steps else time_limit / 3)
    unseen = [n for n in names if seen[n].gram is None and not seen[n].ids]
    if unseen:
        warnings.warn(f"fit_layers: the teacher never called {unseen} on these batches; "
                      "left as they are", stacklevel=2)
        names = [n for n in names if n not in unseen]
    frequencies = {n: seen[n].row_frequencies(uniform, _num_rows(dense[n])) for n in names}
    # a low-rank layer's closed form is the optimum of its fit: no Adam time for it
    budget = {n: 0 if _closed_form_is_optimal(small[n], frequencies[n], seen[n].gram,
                                                 dense[n])
              else sum(p.numel() for p in small[n].parameters()) for n in names}
    total = sum(budget.values())
    result = {}
    for name in names:  # the time left, shared by the layers still to fit (setup included)
        time_left = time_limit - (time.perf_counter() - start)
        limit = max(0.0, time_left) * budget[name] / total if total else 0.0
        total -= budget[name]
        setup = time.perf_counter()
        draw = seen[name].sampler(sample, uniform, _num_rows(dense[name]))
        limit -= time.perf_counter() - setup
        result[name] = _fit_one(small[name], dense[name], draw, limit, steps, lr, name,
                                progress, seen[name].mean_gram(), frequencies[name])
    return result


def _closed_form_is_optimal(layer: nn.Module, frequencies: Tensor | None,
                            gram: Tensor | None = None, dense: nn.Module | None = None) -> bool:
    """Whether the closed form minimises the layer's fit loss, which Adam steps then cannot
    beat: a low-rank table with recorded ids (its frequency-weighted SVD), or a plain
    low-rank linear layer with a recorded input Gram (its whitened SVD; not CoLA, whose
    bond nonlinearity the SVD does not model)."""
    if not isinstance(layer, TensorizedLayer) or layer.effective_ranks() != layer.ranks:
        return False
    if isinstance(layer, TTEmbedding):
        return frequencies is not None and is_lowrank_table(layer.row_modes, layer.col_modes)
    return (gram is not None and type(layer) is LowRankLinear
            and dense is not None and _dense_linear_weight(layer, dense) is not None)


def _num_rows(module: nn.Module) -> int:
    return module.num_embeddings if isinstance(module, nn.Embedding) else 0


def _capture(teacher: nn.Module, batches: Iterable[Any], seen: dict, modules: dict,
             time_limit: float | None) -> None:
    pending: set[str] = set()
    start = time.perf_counter()
    mask: Tensor | None = None  # the current batch's real tokens (read by the hooks)

    def hook_for(name: str) -> Callable:
        def hook(module, inputs):
            if name in pending:
                seen[name].add(real_rows(inputs[0], mask))
                pending.discard(name)
                if not pending:
                    raise _Enough
        return hook

    handles = [alias.register_forward_pre_hook(hook_for(n))
               for n in seen for alias in _aliases(teacher, modules[n])]
    try:
        with quiet_eval(teacher):
            for batch in batches:
                pending.update(seen)
                mask = token_mask(batch)
                args, kwargs = as_call(batch)
                try:
                    teacher(*args, **kwargs)
                except _Enough:
                    pass
                if time_limit is not None and time.perf_counter() - start > time_limit:
                    break
    finally:
        for handle in handles:
            handle.remove()


def _aliases(model: nn.Module, module: nn.Module) -> list[nn.Module]:
    """``module`` and the modules of its class holding the very same weight: a tied table is
    often looked up through another module than the one named (T5's ``shared`` through
    ``encoder.embed_tokens``), so its inputs arrive there."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        return [module]
    return [module] + [m for m in model.modules() if m is not module and type(m) is type(module)
                       and getattr(m, "weight", None) is weight]


def _dense_linear_weight(layer: nn.Module, dense: nn.Module) -> Tensor | None:
    """The dense layer's weight as ``(out, in)`` if it is a Linear-like layer ``layer``
    replaces (a Hugging Face Conv1D stores it transposed), else None."""
    weight = getattr(dense, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.is_meta:
        return None
    shape = (getattr(layer, "out_features", -1), getattr(layer, "in_features", -1))
    if tuple(weight.shape) == shape:
        return weight.detach()
    if tuple(weight.shape) == shape[::-1]:
        return weight.detach().T
    return None


@torch.no_grad()
def _closed_form(layer: nn.Module, dense: nn.Module, gram: Tensor | None,
                 frequencies: Tensor | None = None) -> list[Tensor] | None:
    """Cores re-decomposed from the dense weight where the recorded inputs feel the error
    least (``formats.whiten``), at the layer's ranks; None where that does not apply (a
    table in a TT layout, a layer without a dense weight, or rank gates switched off)."""
    if _closed_form_is_optimal(layer, frequencies):  # the fit's own distribution, undamped
        return weighted_lowrank_cores(layer, dense.weight.detach().float(), frequencies,
                                      layer.ranks[1], damping=1e-6)
    decompose = getattr(layer, "decompose_whitened", None)
    if gram is None or decompose is None:
        return None
    if layer.effective_ranks() != layer.ranks:
        return None
    weight = _dense_linear_weight(layer, dense)
    if weight is None:
        return None
    try:
        return decompose(weight.float(), layer.ranks[1:-1], gram)
    except NotImplementedError:
        return None


def _fit_one(layer: nn.Module, dense: nn.Module, draw: Callable[[], Tensor], limit: float,
             steps: int | None, lr: float, name: str, progress: bool, gram: Tensor | None = None,
             frequencies: Tensor | None = None) -> tuple[float, float]:
    """Closed-form start (linear layers: the output-aware decomposition on the recorded
    Gram, kept if it scores better), then Adam on the cores; the best state seen wins, so
    the layer's error never rises."""
    start = time.perf_counter()  # the closed form counts against ``limit`` too
    fitted = [p for n, p in layer.named_parameters()
              if n != "bias" and not n.startswith("gates") and p.is_floating_point()]
    flags = [(p, p.requires_grad) for p in layer.parameters()]
    check = draw()  # one fixed draw scores before and after
    with torch.no_grad():
        target = dense(check)

    def score() -> float:
        with torch.no_grad():
            return float(distill_loss(layer(check), target))

    def snapshot() -> list[Tensor]:
        return [p.detach().clone() for p in layer.parameters()]

    def restore(state: list[Tensor]) -> None:
        with torch.no_grad():
            for p, saved in zip(layer.parameters(), state):
                p.data = saved
        if hasattr(layer, "invalidate_plans"):
            layer.invalidate_plans()

    before = score()
    best, best_state = before, snapshot()
    cores = _closed_form(layer, dense, gram, frequencies)
    if cores is not None:
        layer._set_cores(cores)
        closed = score()
        if closed < best:
            best, best_state = closed, snapshot()
        else:
            restore(best_state)
    for p, _ in flags:
        p.requires_grad_(False)
    for p in fitted:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(fitted, lr=lr)
    bar = _progress(steps, progress, f"fit {name}")
    done = 0
    try:
        while (steps is None or done < steps) and (
                steps is not None or time.perf_counter() - start < limit):
            x = draw()
            with torch.no_grad():
                want = dense(x)
            loss = distill_loss(layer(x), want)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            done += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss.detach()):.4f}")
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        if bar is not None:
            bar.close()
    after = score()
    if after > best:
        restore(best_state)
        after = best
    return before, after


def _progress(total: int | None, enabled: bool, desc: str = "distill"):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, leave=False)
