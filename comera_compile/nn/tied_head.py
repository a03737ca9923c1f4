"""TiedEmbeddingHead: an output projection that shares its tensorized embedding's cores."""

from __future__ import annotations

from torch import Tensor, nn

from comera_compile.nn.base import encode_layout
from comera_compile.nn.linear_common import PlannedLinearMixin
from comera_compile.nn.tt_embedding import TTEmbedding
from comera_compile.planner import ttm_linear_network

TIED_HEAD = "tied_head"


class TiedEmbeddingHead(PlannedLinearMixin, nn.Module):
    """``nn.Linear(embedding_dim, num_embeddings)`` whose weight is ``embedding``'s table."""

    format = "ttm"  # the contraction it runs (for the compiled path and plan records)

    def __init__(self, embedding: TTEmbedding, tied_to: str, bias: nn.Parameter | None = None):
        super().__init__()
        self.__dict__["embedding"] = embedding  # not a submodule: its cores are saved once
        self.tied_to = tied_to
        self.in_features, self.out_features = embedding.embedding_dim, embedding.num_embeddings
        self.in_modes, self.out_modes = embedding.col_modes, embedding.row_modes
        self.bias = bias
        self.objective = "combo"
        self._plans_by_ranks: dict[tuple[int, ...], dict] = {}

    @property
    def _plans(self) -> dict:
        """Plans for the embedding's current ranks (they shrink when it is pruned)."""
        return self._plans_by_ranks.setdefault(tuple(self.embedding.ranks), {})

    @property
    def dense_parameters(self) -> int:
        return 0  # the weight is the embedding's

    def _plan_reference(self) -> Tensor:
        return self.embedding.cores[0]

    def layout(self) -> dict:
        return {"format": TIED_HEAD, "embedding": self.tied_to, "bias": self.bias is not None}

    def get_extra_state(self) -> Tensor:
        return encode_layout(self.layout())

    def set_extra_state(self, state) -> None:
        pass

    def gated_cores(self) -> list[Tensor]:
        return self.embedding.chain_cores()

    def _network(self, rows: int):
        return ttm_linear_network(self.in_modes, self.out_modes, self.embedding.ranks, rows)

    def extra_repr(self) -> str:
        return (f"{self.in_features} -> {self.out_features}, cores of '{self.tied_to}', "
                f"bias={self.bias is not None}")
