"""A tensor network as the planner sees it: index strings per operand, output, sizes."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

BATCH = "b"
"""The index every network uses for the rows of its input (the planner buckets its size)."""


@dataclass(frozen=True)
class Network:
    """A contraction ``inputs -> output`` over single-letter indices."""

    kind: str
    inputs: tuple[str, ...]
    output: str
    sizes: tuple[tuple[str, int], ...]
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.inputs) != len(self.names):
            raise ValueError(f"{len(self.inputs)} operands but {len(self.names)} names")
        known = dict(self.sizes)
        for term in (*self.inputs, self.output):
            if len(set(term)) != len(term):
                raise ValueError(f"repeated index in term {term!r} (diagonals unsupported)")
            missing = set(term) - set(known)
            if missing:
                raise ValueError(f"indices {sorted(missing)} of {term!r} have no size")
        if tuple(sorted(self.sizes)) != self.sizes:
            raise ValueError("Network.sizes must be sorted by index")
        counts: dict[str, int] = {}
        for term in self.inputs:
            for ix in term:
                counts[ix] = counts.get(ix, 0) + 1
        if set(self.output) - set(counts):
            raise ValueError("output has indices no operand carries")

    @cached_property
    def _hash(self) -> int:
        return hash((self.kind, self.inputs, self.output, self.sizes, self.names))

    def __hash__(self) -> int:  # cached: get_plan hashes the network on every forward
        return self._hash

    @property
    def equation(self) -> str:
        """The index-notation equation ``"bij,ia,ajk->bk"`` (a description, never run)."""
        return ",".join(self.inputs) + "->" + self.output

    @property
    def size_dict(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def rows(self) -> int | None:
        """Size of the batch index ``b`` (None when the network has no batch index)."""
        return self.size_dict.get(BATCH)

    def with_sizes(self, **sizes: int) -> Network:
        """The same network with some index sizes replaced (e.g. ``b=bucket``)."""
        merged = self.size_dict
        merged.update(sizes)
        return Network(
            self.kind, self.inputs, self.output, tuple(sorted(merged.items())), self.names
        )

    def shapes(self) -> list[tuple[int, ...]]:
        """The operand shapes this network expects."""
        sd = self.size_dict
        return [tuple(sd[ix] for ix in term) for term in self.inputs]


def next_power_of_two(n: int) -> int:
    """The bucket a row count plans under: the smallest power of two >= n (1 for n <= 1)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
