"""Bond padding: run a contraction at ranks the CPU's matmul kernels like."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

MULTIPLE = 16  # sgemm's fast widths on CPU
MAX_WASTE = 1 / 8  # pad only when it adds at most this share of the rank
MIN_ROWS = 512  # a plan-bucket boundary: one compiled graph never mixes the two cases
WIDE = 64  # from here sgemm runs near its peak at any width: left alone


def aligned_rank(rank: int, device_type: str = "cpu") -> int:
    """The bond size a contraction on ``device_type`` runs ``rank`` at (CPU only; on other
    devices, not measured, the rank itself)."""
    if device_type != "cpu" or rank % MULTIPLE == 0 or rank >= WIDE:
        return rank
    padded = -(-rank // MULTIPLE) * MULTIPLE
    return padded if padded - rank <= rank * MAX_WASTE else rank


def bond_padding(cores: Sequence[Tensor], rows: int | torch.SymInt) -> list[int]:
    """How many zero slices each internal bond of the chain ``cores`` gets (0: none): up to
    its :func:`aligned_rank` when the contraction runs over more than ``MIN_ROWS`` rows."""
    # a symbolic bond (``compile.policy.rank_dims``) is left as it is: its padding would guard it
    extras = [aligned_rank(c.shape[0], c.device.type) - c.shape[0] if is_static(c.shape[0])
              else 0 for c in cores[1:]]
    # compare the rows only where a bond would be padded: on a symbolic count the
    # comparison is a shape guard, and a graph with nothing to pad needs none
    if not any(extras) or rows <= MIN_ROWS:
        return [0] * len(extras)
    return extras


def pad_bonds(cores: Sequence[Tensor], rows: int | torch.SymInt) -> list[Tensor]:
    """Chain cores ``(r_{k-1}, ..., r_k)`` with each internal bond zero-padded as
    :func:`bond_padding` says (the boundary bonds of size 1 stay)."""
    cores = list(cores)
    for k, extra in enumerate(bond_padding(cores, rows), start=1):
        if extra:
            cores[k - 1], cores[k] = pad_bond(cores[k - 1], cores[k], extra)
    return cores


def pad_bond(left: Tensor, right: Tensor, extra: int) -> tuple[Tensor, Tensor]:
    """``left``'s last dim and ``right``'s first (the bond between them) grown by ``extra``
    zero slices."""
    return F.pad(left, (0, extra)), F.pad(right, (0, 0) * (right.dim() - 1) + (0, extra))


def is_static(size: int | torch.SymInt) -> bool:
    """Whether ``size`` is a plain number, without a guard. While dynamo traces, a symbolic
    size passes ``isinstance(size, int)`` and fails ``isinstance(size, torch.SymInt)``;
    what tells it apart is that neither ``size % 16 == 0`` nor its negation is known
    without one."""
    return statically_known_true(size % MULTIPLE == 0) or statically_known_true(
        size % MULTIPLE != 0)
