"""Run an SSA contraction path as plain torch ops: permute, reshape, matmul."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PairStep:
    """One pairwise contraction ``left . right`` on SSA ids, precomputed as dim positions."""

    left: int
    right: int
    left_sum: tuple[int, ...]
    right_sum: tuple[int, ...]
    left_perm: tuple[int, ...]
    right_perm: tuple[int, ...]
    n_batch: int
    n_left_free: int
    n_contract: int
    n_right_free: int


@dataclass(frozen=True)
class Program:
    """The whole contraction: pairwise steps, then a final sum/permute to the output order."""

    num_inputs: int
    steps: tuple[PairStep, ...]
    final_sum: tuple[int, ...]
    final_perm: tuple[int, ...]

    @property
    def bias_dims(self) -> int:
        """How many trailing output dims a bias can be fused over (into the last matmul as
        an ``addmm``); 0 when the last step is batched or followed by a sum or permute."""
        last = self.steps[-1] if self.steps else None
        identity = self.final_perm == tuple(range(len(self.final_perm)))
        if last is None or last.n_batch or self.final_sum or not identity:
            return 0
        return last.n_right_free


def _prod(sizes) -> int:
    out = 1
    for s in sizes:
        out = out * s
    return out


def compile_program(inputs: Sequence[str], output: str, path: Sequence[Sequence[int]]) -> Program:
    """Turn an SSA path over ``inputs -> output`` into a :class:`Program`."""
    terms: dict[int, str] = dict(enumerate(inputs))
    count: dict[str, int] = {}
    for term in (*inputs, output):
        for ix in term:
            count[ix] = count.get(ix, 0) + 1
    steps = []
    nxt = len(inputs)
    for i, j in path:
        a, b = terms.pop(i), terms.pop(j)
        for ix in a + b:
            count[ix] -= 1
        # after the decrement, count > 0 means another live operand or the output needs ix
        a_sum = tuple(p for p, ix in enumerate(a) if ix not in b and count[ix] == 0)
        b_sum = tuple(p for p, ix in enumerate(b) if ix not in a and count[ix] == 0)
        a2 = "".join(ix for p, ix in enumerate(a) if p not in a_sum)
        b2 = "".join(ix for p, ix in enumerate(b) if p not in b_sum)
        batch = [ix for ix in a2 if ix in b2 and count[ix] > 0]
        contract = [ix for ix in a2 if ix in b2 and count[ix] == 0]
        a_free = [ix for ix in a2 if ix not in b2]
        b_free = [ix for ix in b2 if ix not in a2]
        steps.append(
            PairStep(
                left=i,
                right=j,
                left_sum=a_sum,
                right_sum=b_sum,
                left_perm=tuple(a2.index(ix) for ix in batch + a_free + contract),
                right_perm=tuple(b2.index(ix) for ix in batch + contract + b_free),
                n_batch=len(batch),
                n_left_free=len(a_free),
                n_contract=len(contract),
                n_right_free=len(b_free),
            )
        )
        result = "".join(batch + a_free + b_free)
        for ix in result:
            count[ix] += 1
        terms[nxt] = result
        nxt += 1
    (last,) = terms.values()
    final_sum = tuple(p for p, ix in enumerate(last) if ix not in output)
    kept = "".join(ix for ix in last if ix in output)
    return Program(len(inputs), tuple(steps), final_sum, tuple(kept.index(ix) for ix in output))


def _permute(t: Tensor, perm: tuple[int, ...]) -> Tensor:
    return t if perm == tuple(range(len(perm))) else t.permute(perm)


def _pair(step: PairStep, a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    if step.left_sum:
        a = a.sum(dim=step.left_sum)
    if step.right_sum:
        b = b.sum(dim=step.right_sum)
    a = _permute(a, step.left_perm)
    b = _permute(b, step.right_perm)
    nb, nf, nc = step.n_batch, step.n_left_free, step.n_contract
    batch = a.shape[:nb]
    a_free = a.shape[nb : nb + nf]
    b_free = b.shape[nb + nc :]
    k = _prod(a.shape[nb + nf :])
    if nb:
        bs = _prod(batch)
        c = torch.matmul(a.reshape(bs, _prod(a_free), k), b.reshape(bs, k, _prod(b_free)))
    elif bias is not None:
        c = torch.addmm(bias.reshape(-1), a.reshape(_prod(a_free), k), b.reshape(k, -1))
    else:
        c = torch.matmul(a.reshape(_prod(a_free), k), b.reshape(k, _prod(b_free)))
    return c.reshape(*batch, *a_free, *b_free)


def run_program(program: Program, operands: Sequence[Tensor], bias: Tensor | None = None) -> Tensor:
    """Execute ``program`` on ``operands`` (in network order)."""
    if len(operands) != program.num_inputs:
        raise ValueError(f"plan expects {program.num_inputs} operands, got {len(operands)}")
    fuse = bias is not None and program.bias_dims == bias.dim()
    values: list[Tensor | None] = list(operands)
    last = len(program.steps) - 1
    for n, step in enumerate(program.steps):
        a, b = values[step.left], values[step.right]
        values[step.left] = values[step.right] = None  # drop references early
        values.append(_pair(step, a, b, bias if fuse and n == last else None))
    out = values[-1]
    if program.final_sum:
        out = out.sum(dim=program.final_sum)
    out = _permute(out, program.final_perm)
    return out if bias is None or fuse else out + bias
