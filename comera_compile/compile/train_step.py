"""Whole training step capture: forward, backward and optimizer step as one CUDA Graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

LossFn = Callable[[nn.Module, Any], Tensor]


def _make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Switch an optimizer to on-device step counters and a tensor ``lr`` (no host sync)."""
    for group in optimizer.param_groups:
        if "capturable" not in group:
            raise ValueError(
                f"{type(optimizer).__name__} cannot run inside a CUDA Graph; use an optimizer "
                "with a 'capturable' option (Adam, AdamW, ...)"
            )
        group["capturable"] = True
        device = group["params"][0].device
        lr = group["lr"]
        if not isinstance(lr, Tensor):
            group["lr"] = torch.tensor(float(lr), device=device)
        elif lr.device != device:
            group["lr"] = lr.to(device)
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            step = state.get("step")
            if isinstance(step, Tensor) and step.device != p.device:
                state["step"] = step.to(p.device)


class _FirstValues(dict):
    """An optimizer's per-parameter state that remembers the value each entry was born
    with, so state created during warm-up can be put back to exactly that."""

    def __init__(self) -> None:
        super().__init__()
        self.born: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.born:
            self.born[key] = value.clone() if isinstance(value, Tensor) else value
        super().__setitem__(key, value)


class _Snapshot:
    """Parameters and optimizer state before warm-up, so warm-up steps leave no trace."""

    def __init__(self, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        self.params = [p.detach().clone() for p in params]
        self.state = {p: {k: v.clone() if isinstance(v, Tensor) else v for k, v in s.items()}
                      for p, s in optimizer.state.items()}
        for p in params:
            if not optimizer.state.get(p):
                optimizer.state[p] = _FirstValues()

    @torch.no_grad()
    def restore(self, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        for p, saved in zip(params, self.params):
            p.copy_(saved)
        for p in list(optimizer.state):
            state = optimizer.state[p]
            original = self.state.get(p)
            if isinstance(state, _FirstValues):
                original = {**state.born, **(original or {})}
                state = optimizer.state[p] = dict(state)
            if original is None:
                continue
            for k, v in state.items():
                if k not in original:
                    continue
                if isinstance(v, Tensor):  # in place: the recorded graph holds the address
                    v.copy_(original[k])
                else:
                    state[k] = original[k]


def _hyperparameters(optimizer: torch.optim.Optimizer) -> tuple:
    """The non-tensor settings of every group (betas, eps, weight decay, ...): the recorded
    kernels bake them in, so changing one must record again."""
    return tuple(
        tuple(sorted((k, repr(v)) for k, v in g.items() if k != "params" and not
                     isinstance(v, Tensor)))
        for g in optimizer.param_groups
    )


def _state_identity(optimizer: torch.optim.Optimizer) -> tuple:
    """Which tensors hold the optimizer state (a loaded or sliced state is new memory)."""
    return tuple(
        (id(p), tuple((k, v.data_ptr()) for k, v in s.items() if isinstance(v, Tensor)))
        for p, s in optimizer.state.items()
    ) + tuple(
        g["lr"].data_ptr() if isinstance(g["lr"], Tensor) else -1 for g in optimizer.param_groups
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``torch.compile`` wrapper (CUDA Graph trees of a compiled model
    must not nest inside the captured step's graph)."""
    return getattr(model, "_orig_mod", model)


class TrainStep:
    """``step(batch) -> loss``: one training step, replayed from a CUDA Graph on CUDA.

    ``loss_fn(model, batch)`` returns the scalar loss. The step is recorded after ``warmup``
    steps, and again when the batch layout or a parameter shape changes; ``compile``
    (default: CPU only) compiles the forward and loss with the ``comera`` backend.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                 example_batch: Any, warmup: int = 3, compile: bool | None = None) -> None:
        model = unwrap(model)
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.device = self.params[0].device
        self.cuda = self.params[0].is_cuda
        self.warmup = max(1, int(warmup))
        compile = (not self.cuda) if compile is None else compile
        self._forward = self._compiled_forward() if compile else self._eager_forward
        self.records = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: list[Any] = []
        self._spec = None
        self._loss: Tensor | None = None
        self._signature: tuple = ()
        if self.cuda:
            _make_capturable(optimizer)
            self._record(example_batch)

    def _eager_forward(self, batch: Any) -> Tensor:
        return self.loss_fn(self.model, batch)

    def _compiled_forward(self) -> Callable[[Any], Tensor]:
        options = {"cudagraphs": False} if self.cuda else None  # the step graph records it all
        return torch.compile(self._eager_forward, backend="comera", options=options)

    # ----- the step ---------------------------------------------------------------------
    def __call__(self, batch: Any) -> Tensor:
        if not self.cuda:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self._forward(batch)
            loss.backward()
            self.optimizer.step()
            return loss.detach()
        flat, spec = tree_flatten(batch)
        if self._graph is None or self._signature != self._current_signature(flat, spec):
            self._record(batch)
        for buffer, value in zip(self._static, flat):
            if isinstance(buffer, Tensor):
                buffer.copy_(value, non_blocking=True)
        self._graph.replay()
        return self._loss

    def rerecord(self) -> None:
        """Drop the recorded graph; the next call records a new one (after pruning, say)."""
        self._graph = None
        self._loss = None

    # ----- recording --------------------------------------------------------------------
    def _current_signature(self, flat: list[Any], spec) -> tuple:
        """Everything the recording depends on; a difference records again. Reads no tensor
        data (no host sync): shapes, dtypes, addresses and Python values only."""
        batch = tuple((tuple(t.shape), t.dtype) if isinstance(t, Tensor) else t for t in flat)
        params = tuple((tuple(p.shape), p.dtype, p.data_ptr(), p.requires_grad)
                       for p in self.model.parameters())
        optimizer = (_hyperparameters(self.optimizer), _state_identity(self.optimizer))
        return spec, batch, params, optimizer

    def _record(self, batch: Any) -> None:
        self._graph = self._loss = None
        _make_capturable(self.optimizer)  # again: someone may have set a float lr since
        flat, spec = tree_flatten(batch)
        # static inputs live where the parameters are, whatever device the batch came from
        self._static = [
            t.detach().to(self.device, copy=True) if isinstance(t, Tensor) else t for t in flat
        ]
        self._spec = spec
        static_batch = tree_unflatten(self._static, spec)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        snapshot = _Snapshot(self.params, self.optimizer)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):  # plans, lazy optimizer state, compiled kernels
                self.optimizer.zero_grad(set_to_none=True)
                self._forward(static_batch).backward()
                self.optimizer.step()
        torch.cuda.current_stream().wait_stream(side)
        snapshot.restore(self.params, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = self._forward(static_batch)
            loss.backward()
            self.optimizer.step()
        self._graph, self._loss = graph, loss.detach()
        self._signature = self._current_signature(flat, spec)
        self.records += 1


capture_train_step = TrainStep
"""``capture_train_step(model, optimizer, loss_fn, example_batch, warmup=3, compile=None)``:
a callable ``step(batch) -> loss`` (a :class:`TrainStep`) that runs forward, backward and
``optimizer.step()``; see :class:`TrainStep`."""
