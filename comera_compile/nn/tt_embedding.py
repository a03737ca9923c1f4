"""TTEmbedding: an embedding table (or bag) stored as a TTM chain, looked up without the table:
distinct ids' rows are built from two pre-merged halves of the chain, so nothing in forward or
backward is table-sized."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint

from comera_compile.formats import (
    chain_layout,
    internal_ranks,
    is_lowrank_table,
    lookup_fan_ins,
    ttm_random_cores,
    ttm_svd,
    ttm_to_dense,
    zero_pad,
)
from comera_compile.formats.whiten import TABLE_DAMPING, weighted_lowrank_table
from comera_compile.nn.base import LAYOUT_KEY, TensorizedLayer, decode_layout, encode_layout
from comera_compile.nn.gates import DEFAULT_THRESHOLD, hard_threshold
from comera_compile.nn.row_cache import (
    DEFAULT_WARMUP,
    EMPTY,
    IdTally,
    Interleave,
    RowCache,
    split_by_cache,
    top_rows,
)
from comera_compile.planner import EmbeddingPlan, embedding_plan, host_reads_allowed, native_lookup
from comera_compile.planner.embedding import chain_costs
from comera_compile.planner.gathered import CachedChain
from comera_compile.planner.lookup import mode_digits
from comera_compile.planner.ops import planned_lookup

_BAG_MODES = (None, "sum", "mean", "max")
SPARSE_CORE_MIN = 1 << 16
"""Entries a core of a ``sparse=True`` table must hold for a sparse gradient. A smaller core
(a rank-5 table's first core: 3k slices of 5) is zeroed, added into and updated whole for
less than a sparse gradient's update costs, an ``axpy`` call per slice read."""
DEDUP_MIN_MACS = 256
"""Multiply-adds a row must cost to build before a lookup builds each distinct id's row once
(``TTEmbedding.dedups``): below it, sorting the ids and gathering and scattering their rows
cost more than building a repeated row again (a recommender table at rank 5 of dim 16)."""
RECOMPUTED_IDS = 512
"""Ids whose lookup a recomputing backward rebuilds at once (``TTEmbedding.recompute_lookup``)."""
FILL_CHUNK = 4096
"""Ids whose rows a cache fill builds from the cores at once (the fill is a one-off; built
whole, its partial products would set the training run's peak memory)."""


class TTEmbedding(TensorizedLayer):
    """``nn.Embedding`` (or, with ``mode=``, ``nn.EmbeddingBag``) replacement in TTM format.

    The name says TT (tensor train); the layout is TTM (tensor-train *matrix*): the
    ``(num_embeddings, embedding_dim)`` table is one chain of cores, one per (vocabulary
    mode, dim mode) pair, as in TT-Rec and CoMERA. It is not the TT-linear layout of
    ``TTLinear``. Each core is stored slices first, ``(row_modes[k], r_{k-1}, col_modes[k],
    r_k)``, as TT-Rec stores it: a lookup reads one contiguous slice per id and core
    (``chain_cores()`` gives the chain order, ``(r_{k-1}, m_k, n_k, r_k)``).

    ``sparse=True`` gives sparse gradients, as it does a dense table: each core's gradient
    holds only the slices the step's ids read (``planner.gathered``), so a step's
    backward and update cost its ids, not the whole cores (a core under ``SPARSE_CORE_MIN``
    entries gets a dense one, cheaper to update whole). Where a process group is
    initialized (DDP and FSDP2 reduce dense gradients but for ``nn.Embedding``'s own) and in
    compiled lookups they are dense (``sparse_gradients``).
    """

    format = "tt_embedding"
    left_bond_dim = 1
    recompute_lookup = False
    """Set by ``compile.bond_recompute``: the lookup keeps only the ids for backward and builds
    its rows again there, a block of ids at a time (``RECOMPUTED_IDS``). A lookup's partial
    products are many times wider than its rows (each id carries a rank-wide slice of every
    core), so under a memory-lean step they would be the largest thing it keeps; a
    recommender's step, whose lookups are its work, keeps them."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ranks: int | Sequence[int] = 32,
                 padding_idx: int | None = None, mode: str | None = None,
                 row_modes: Sequence[int] | None = None, col_modes: Sequence[int] | None = None,
                 order: int | None = None, dedup: bool | None = None,
                 include_last_offset: bool = False,
                 sparse: bool = False, threshold: float = DEFAULT_THRESHOLD,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 cache_rows: int = 0, cache_warmup: int = DEFAULT_WARMUP) -> None:
        chain = chain_layout(
            self.format, num_embeddings, embedding_dim, ranks, row_modes, col_modes, order
        )
        num_embeddings, embedding_dim = int(num_embeddings), int(embedding_dim)  # checked
        if mode not in _BAG_MODES:
            raise ValueError(f"mode must be one of {_BAG_MODES}, got {mode!r}")
        if include_last_offset and mode is None:
            raise ValueError("include_last_offset needs a bag layer (mode='sum'|'mean'|'max')")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} is outside [0, {num_embeddings})")
            padding_idx %= num_embeddings
        # nn.Embedding draws N(0, 1): unit variance per entry.
        cores = ttm_random_cores(chain.first, chain.second, chain.ranks, 1.0, dtype, device)
        super().__init__(slices_first(cores), threshold)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.row_modes, self.col_modes = chain.first, chain.second
        self.padding_idx, self.mode, self.dedup = padding_idx, mode, dedup
        self.include_last_offset, self.declared_sparse = bool(include_last_offset), bool(sparse)
        self.cache: RowCache | None = None
        self.cache_rows, self._tally, self._cache_filled = 0, IdTally(), False
        self.set_cache(cache_rows, cache_warmup)
        _watch_sparse_adam()

    @property
    def sparse_gradients(self) -> bool:
        """Whether this step's lookups give the cores sparse gradients (class docstring)."""
        return self.declared_sparse and not (
            torch.distributed.is_available() and torch.distributed.is_initialized())

    def sparse_cores(self, cores: Sequence[Tensor] | None = None) -> tuple[bool, ...]:
        """Whether each core's gradient is sparse: where ``sparse_gradients``, the cores of at
        least ``SPARSE_CORE_MIN`` entries (``cores``: the table's, listed already)."""
        sparse = self.sparse_gradients
        return tuple(sparse and core.numel() >= SPARSE_CORE_MIN
                     for core in (self.cores if cores is None else cores))

    def sparse_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients are sparse (for an optimizer that splits sparse
        from dense): the cores of ``sparse_cores``, and a sparse cache's rows."""
        cores = [c for c, sparse in zip(self.cores, self.sparse_cores()) if sparse]
        cache = [self.cache.weight] if self.cache is not None and self.cache.sparse else []
        return cores + cache

    @property
    def row_macs(self) -> int:
        """Multiply-adds one row costs to build from the cores (at the ranks of now)."""
        return self._chain().macs

    def _chain(self) -> Chain:
        """The cores and gates, listed, and the multiply-adds a row costs to build from them
        (a lookup reads all three; a ``ParameterList`` is slow to walk)."""
        cores, gates = _listed(self.cores), _listed(self.gates)
        ranks = (1, *(int(c.shape[-1]) for c in cores[:-1]), 1)
        macs = _row_macs(tuple(self.row_modes), tuple(self.col_modes), ranks)
        return Chain(cores, gates, macs)

    def _native(self, ids: Tensor, chain: Chain) -> bool:
        """Whether a lookup of ``ids`` runs in C (``planner.native_lookup``)."""
        weight = None if self.cache is None else self.cache.weight
        return native_lookup.usable(ids, chain.cores, chain.macs, weight, chain.gates)

    @property
    def dedups(self) -> bool:
        """Whether a lookup builds each distinct id's row once: ``dedup`` where set, else
        where a row costs more than ``DEDUP_MIN_MACS`` multiply-adds to build."""
        return self._dedups(self.row_macs)

    def _dedups(self, row_macs: int) -> bool:
        return self.dedup if self.dedup is not None else row_macs > DEDUP_MIN_MACS

    @property
    def lookup_outgrows_rows(self) -> bool:
        """Whether a lookup's partial products (each id's running product, rank-wide at every
        inner bond) hold more per id than its row: only then does a memory-lean step
        recompute them (``recompute_lookup``). A low-rank table's hold ``r <= dim``."""
        inner, width = 0, 1
        for n, r in zip(self.col_modes[:-1], self.ranks[1:-1]):
            width *= n
            inner += width * r
        return inner > self.embedding_dim

    @property
    def dense_parameters(self) -> int:
        return self.num_embeddings * self.embedding_dim

    @property
    def dense_fan_in(self) -> int:
        """A lookup sums nothing: a dense table's row is read as it is."""
        return 1

    def core_fan_ins(self) -> list[int]:
        """A gathered core sums only its left bond (``formats.scaling``)."""
        return lookup_fan_ins(self.ranks)

    def layout(self) -> dict:
        extra = {"cache_rows": self.cache_rows} if self.cache_rows else {}
        return {**super().layout(), "cores": SLICES_FIRST, "num_embeddings": self.num_embeddings,
                "embedding_dim": self.embedding_dim, "row_modes": list(self.row_modes),
                "col_modes": list(self.col_modes), **extra}

    # ----- hot-row cache ------------------------------------------------------------------
    def set_cache(self, rows: int, warmup: int = DEFAULT_WARMUP) -> None:
        """Give the table an empty hot-row cache of ``rows`` rows (0: none), filled after
        ``warmup`` training batches (0: only by ``fill_cache``). Refused once filled."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"cache_rows must be a non-negative int, got {rows!r}")
        if rows > self.num_embeddings:
            raise ValueError(f"cache_rows ({rows}) exceeds the table's {self.num_embeddings} "
                             "rows; pass at most num_embeddings")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"cache_warmup must be a non-negative int, got {warmup!r}")
        if self.cache_rows and self.cache_filled:
            raise ValueError("the cache is filled and its set is fixed; build a new layer")
        self.cache_rows, self.cache_warmup = rows, warmup
        self._tally.clear()
        self._cache_filled = None if rows else False
        core = self.cores[0]
        self.cache = RowCache(rows, self.embedding_dim, self.declared_sparse, core.dtype,
                              core.device) if rows else None

    @property
    def cache_filled(self) -> bool:
        """Whether the cached set is chosen (it is then fixed)."""
        if self._cache_filled is None:
            self._cache_filled = bool((self.cache.ids != EMPTY).any())
        return self._cache_filled

    @torch.no_grad()
    def fill_cache(self, ids: Tensor, counts: Tensor | None = None) -> Tensor:
        """Cache the ``cache_rows`` most frequent of ``ids`` (each counted once per
        occurrence, or by ``counts``), each starting as the cores' row; returns the cached
        ids. The set is fixed from then on: a cached row is a free parameter the cores
        cannot take back, so a second fill is refused rather than lose trained rows."""
        if not self.cache_rows:
            raise ValueError("this table has no cache; build it with cache_rows > 0")
        if self.cache_filled:
            raise ValueError("the cache is already filled and its set is fixed (a cached row's "
                             "trained value would be lost); build a new layer to choose again")
        ids = ids.to(self.cache.ids.device)
        if ids.numel():
            self._check_ids(ids.reshape(-1).long(), True)
        chosen = top_rows(ids, None if counts is None else counts.to(ids.device),
                          self.cache_rows)
        self._set_cached(chosen)
        return chosen

    @torch.no_grad()
    def _set_cached(self, chosen: Tensor) -> None:
        first = self.cache_rows - chosen.numel()  # empty slots first: the ids stay sorted
        self.cache.ids.fill_(EMPTY)
        self.cache.ids[first:] = chosen
        self.cache.weight.zero_()
        for start in range(0, chosen.numel(), FILL_CHUNK):  # a lookup's partial products
            part = chosen[start:start + FILL_CHUNK]  # are many times wider than its rows
            self.cache.weight[first + start:first + start + part.numel()] = self._core_rows(
                part).to(self.cache.weight.dtype)
        self._cache_filled = bool(chosen.numel())
        self._tally.clear()

    def _count_warmup(self, ids: Tensor) -> None:
        """Count a training batch's ids; after ``cache_warmup`` batches fix the cached set
        (under DDP every rank takes rank 0's set, so a slot means one row everywhere)."""
        self._tally.add(ids)
        if self._tally.calls < self.cache_warmup:
            return
        chosen = top_rows(self._tally.ids, self._tally.counts, self.cache_rows)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            padded = torch.full_like(self.cache.ids, EMPTY)
            padded[self.cache_rows - chosen.numel():] = chosen
            torch.distributed.broadcast(padded, src=0)
            chosen = padded[padded != EMPTY]
        self._set_cached(chosen)

    def _new_plan(self, bucket: int, dtype: torch.dtype, device_type: str) -> EmbeddingPlan:
        """Which bond to split the chain at for ``bucket`` ids (dtype-independent)."""
        return embedding_plan(self.row_modes, self.col_modes, self.ranks, bucket)

    def dense_macs(self, rows: int) -> int:
        return rows * self.embedding_dim  # the dense baseline copies one row per id

    def _core_rows(self, ids: Tensor) -> Tensor:
        """Rows ``(len(ids), embedding_dim)`` built from the cores (the cache not read)."""
        return self.lookup(ids, cores_only=True)

    def lookup(self, ids: Tensor, cores_only: bool = False) -> Tensor:
        """Rows ``(len(ids), embedding_dim)`` for a 1-d id tensor, without the table
        (cached rows from the cache unless ``cores_only``)."""
        if self.cache is not None and not cores_only:
            return self._rows(ids)
        if torch.compiler.is_compiling():  # one op: planning stays out of the graph
            rows = planned_lookup(ids, self.gated_cores(), self.row_modes, self.col_modes)
            return rows[:, : self.embedding_dim]
        chain = self._chain()
        cores = chain.cores
        if native_lookup.usable(ids, cores, chain.macs, None, chain.gates):  # a C call each way
            return self._in_c(ids, chain, cached=False)
        sparse = self.sparse_cores(cores) if torch.is_grad_enabled() else False
        gates = [hard_threshold(g, self.threshold) for g in chain.gates]
        if self.recompute_lookup and torch.is_grad_enabled():
            # one checkpoint per block of ids: backward rebuilds one block's products at once
            rows = torch.cat([checkpoint(self.plan_for(part.numel()).lookup, part,
                                         list(self.cores), gates, sparse, use_reentrant=False)
                              for part in ids.split(RECOMPUTED_IDS)])
        else:
            rows = self.plan_for(ids.numel()).lookup(ids, list(self.cores), gates, sparse)
        return rows[:, : self.embedding_dim]

    def _rows(self, ids: Tensor, chain: Chain | None = None, native: bool | None = None
              ) -> Tensor:
        """The rows of ``ids``: a cached table's hits read from the cache, its misses built
        from the cores; no id reads both (``chain``: ``_chain()``, and ``native``:
        ``_native``, where the caller has them)."""
        if self.cache is None:
            return self._core_rows(ids).to(self.cores[0].dtype)
        chain = self._chain() if chain is None else chain
        cores, dtype, cache = chain.cores, chain.cores[0].dtype, self.cache
        if self._native(ids, chain) if native is None else native:  # one C call each way
            return self._in_c(ids, chain)
        sparse = self.sparse_cores(cores) if torch.is_grad_enabled() else False
        slots, hits, misses = split_by_cache(cache.ids, ids)
        if self.recompute_lookup and torch.is_grad_enabled():  # the misses' rows rebuilt
            built = self._core_rows(ids.index_select(0, misses)).to(dtype)
            return Interleave.apply(cache(slots), hits, built, misses)
        # one autograd node for the cache, the chain and the interleaving (planner.gathered)
        digits = mode_digits(ids.index_select(0, misses), self.row_modes)
        gates = [hard_threshold(g, self.threshold).to(dtype) for g in self.gates]
        return CachedChain.apply(sparse, cache.sparse, len(cores), self.embedding_dim,
                                 cache.weight, slots, hits, misses, *digits, *cores, *gates)

    def forward(self, input: Tensor, offsets: Tensor | None = None,
                per_sample_weights: Tensor | None = None) -> Tensor:
        """Rows like ``nn.Embedding``, or pooled bags like ``nn.EmbeddingBag`` (2-d ``input``
        of fixed-size bags, or 1-d ``input`` with ``offsets``)."""
        if self.cache is not None and torch.compiler.is_compiling():
            return _eager_forward(self, input, offsets, per_sample_weights)  # hits are data
        return self._forward(input, offsets, per_sample_weights)

    def _forward(self, input: Tensor, offsets: Tensor | None,
                 per_sample_weights: Tensor | None) -> Tensor:
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"TTEmbedding expects integer ids, got {input.dtype}")
        if self.mode is None and (offsets is not None or per_sample_weights is not None):
            raise ValueError("offsets / per_sample_weights need a bag layer (mode='sum'|'mean')")
        flat = input.reshape(-1)
        flat = flat if flat.dtype == torch.int64 else flat.long()
        eager = host_reads_allowed()
        chain = self._chain()  # listed once per call: a ParameterList is slow to walk
        counting = self.cache is not None and self.training and self.cache_warmup and (
            not self.cache_filled)
        native = eager and self._native(flat, chain)
        if counting or not native:
            self._check_ids(flat, eager)  # the C lookup checks the ids it reads
        if counting:
            self._count_warmup(flat)
        dedup = self._dedups(chain.macs)
        if dedup and eager:
            ids, index = torch.unique(flat, return_inverse=True)
        elif dedup and isinstance(flat.numel(), int) and self.num_embeddings <= flat.numel():
            # compiled (no host read for unique): fewer rows than ids, so each row once
            # costs less than each id's row, and backward adds into the table's rows rather
            # than scattering every id's gradient into the few rows of the first core
            ids, index = torch.arange(self.num_embeddings, device=flat.device), flat
        else:
            ids, index = flat, None  # each id's own row, in order
        if native and index is None and self._plain_bags(input, offsets, per_sample_weights,
                                                         self.padding_idx):
            return self._in_c(ids, chain, bag=input.shape[1])
        table = self._rows(ids, chain, native)  # in the cores' dtype, as nn.Embedding does
        if index is None:
            if self.mode is None:
                # the rows are the output: no gather, and no index of the ids' count, whose
                # size a compiled backward with a dynamic batch could not bind (HF T5)
                if self.padding_idx is not None:  # padding reads zeros, passes no gradient
                    table = table.masked_fill((flat == self.padding_idx).unsqueeze(-1), 0)
                return table.reshape(*input.shape, self.embedding_dim)
            if self._plain_bags(input, offsets, per_sample_weights, self.padding_idx):
                return self._pool_rows(table.view(*input.shape, self.embedding_dim))
            lengths = self._offset_lengths(input, offsets, per_sample_weights, self.padding_idx)
            if lengths is not None:
                return self._pool_offset_bags(table, lengths)
            index = torch.arange(flat.numel(), device=flat.device)  # bags gather in order
        padding = None
        if self.padding_idx is not None:  # point padding positions at an extra zero row
            padding = table.shape[0]
            table = torch.cat([table, table.new_zeros(1, self.embedding_dim)])
            index = torch.where(flat == self.padding_idx, padding, index)
        if self.mode is None:
            return F.embedding(index, table).reshape(*input.shape, self.embedding_dim)
        if self._plain_bags(input, offsets, per_sample_weights, padding):
            return self._pool_fixed_bags(index, table, input.shape)
        lengths = self._offset_lengths(input, offsets, per_sample_weights, padding)
        if lengths is not None:
            return self._pool_offset_bags(table.index_select(0, index), lengths)
        return F.embedding_bag(index.reshape(input.shape), table, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights,
                               include_last_offset=self.include_last_offset, padding_idx=padding)

    def _in_c(self, ids: Tensor, chain: Chain, bag: int = 1, cached: bool = True) -> Tensor:
        """The rows of ``ids`` looked up in C (``planner.native_lookup``), from the cache too
        where ``cached``; ``bag > 1``: runs of ``bag`` ids pooled by the bag mode there (the
        rows themselves are never made, in forward or backward)."""
        cache = self.cache if cached else None
        sparse = self.sparse_cores(chain.cores) if torch.is_grad_enabled() else False
        return native_lookup.lookup(
            sparse, cache is not None and cache.sparse, len(chain.cores), self.embedding_dim,
            self.num_embeddings, self.threshold, ids, None if cache is None else cache.ids,
            None if cache is None else cache.weight, *chain.cores, *chain.gates, bag=bag,
            mean=self.mode == "mean")

    def _plain_bags(self, input: Tensor, offsets: Tensor | None, weights: Tensor | None,
                    padding: int | None) -> bool:
        """Fixed-size bags summed or averaged, nothing masked or weighted."""
        return (input.dim() == 2 and offsets is None and weights is None and padding is None
                and self.mode in ("sum", "mean"))

    def _offset_lengths(self, input: Tensor, offsets: Tensor | None, weights: Tensor | None,
                        padding: int | None) -> Tensor | None:
        """Each bag's id count, for 1-d ids in bags by well-formed ``offsets`` (from 0, never
        falling, within the ids), summed or averaged, nothing masked or weighted, run
        eagerly; ``None`` otherwise: ``F.embedding_bag`` then pools, or names what is wrong."""
        if not (input.dim() == 1 and offsets is not None and offsets.dim() == 1
                and weights is None and padding is None and self.mode in ("sum", "mean")
                and offsets.numel() > int(self.include_last_offset) and host_reads_allowed()):
            return None
        offsets, count = offsets.long(), input.numel()
        end = offsets.new_full((1,), count)
        lengths = torch.diff(offsets) if self.include_last_offset else torch.diff(offsets,
                                                                                   append=end)
        first, last, shortest = (int(v) for v in torch.stack(
            [offsets[0], offsets[-1], lengths.min() if lengths.numel() else end[0]]))
        closed = last == count if self.include_last_offset else last <= count
        return lengths if first == 0 and closed and shortest >= 0 else None

    def _pool_offset_bags(self, rows: Tensor, lengths: Tensor) -> Tensor:
        """Rows in ids order pooled into bags of ``lengths`` ids by an ``index_add``: its
        backward is a gather, where ``embedding_bag``'s sorts the ids (DLRM's reference calls
        its tables so)."""
        count = rows.shape[0]
        if lengths.numel() == count and bool((lengths == 1).all()):
            return rows  # one id per bag (a click log's usual feature): the rows are the bags
        bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=rows.device),
                                       lengths, output_size=count)
        pooled = rows.new_zeros(lengths.numel(), rows.shape[1]).index_add(0, bags, rows)
        if self.mode == "mean":
            pooled = pooled / lengths.clamp(min=1).unsqueeze(1).to(pooled.dtype)
        return pooled

    def _pool_fixed_bags(self, index: Tensor, table: Tensor, shape: torch.Size) -> Tensor:
        """``(bags, ids per bag)`` pooled by a gather and a sum: the gather's backward is an
        ``index_add``, several times cheaper on CPU than ``embedding_bag``'s sorting backward
        (most recommender bags hold one id)."""
        return self._pool_rows(table.index_select(0, index).view(*shape, self.embedding_dim))

    def _pool_rows(self, rows: Tensor) -> Tensor:
        """``(bags, ids per bag, dim)`` rows summed or averaged per bag."""
        if rows.shape[1] == 1:
            return rows.squeeze(1)  # a view both ways (a select's backward fills zeros)
        return rows.sum(1) if self.mode == "sum" else rows.mean(1)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        saved = state_dict.get(prefix + LAYOUT_KEY)
        if saved is not None and "cores" not in decode_layout(saved):
            # saved before cores were stored slices first: chain order, (r, m, n, r')
            layout = {**decode_layout(saved), "cores": SLICES_FIRST}
            state_dict[prefix + LAYOUT_KEY] = encode_layout(layout)
            for k in range(len(self.cores)):
                key = f"{prefix}cores.{k}"
                if key in state_dict:
                    state_dict[key] = state_dict[key].transpose(0, 1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._cache_filled = None if self.cache_rows else False  # read from the loaded ids

    def _set_cores(self, cores: list[Tensor]) -> None:
        """Adopt chain-order cores ``(r_{k-1}, m_k, n_k, r_k)`` (an SVD's), stored slices
        first."""
        super()._set_cores(slices_first(cores))

    def _check_ids(self, flat: Tensor, eager: bool) -> None:
        """Out-of-range ids would silently read padding rows of the TTM chain: refuse them."""
        if not flat.numel():
            return
        if not eager:
            inside = torch.logical_and(flat >= 0, flat < self.num_embeddings).all()
            torch._assert_async(inside, f"TTEmbedding ids must lie in [0, {self.num_embeddings})")
            return
        low, high = (int(v) for v in torch.aminmax(flat))
        if low < 0 or high >= self.num_embeddings:
            raise IndexError(f"ids must lie in [0, {self.num_embeddings}), got [{low}, {high}]")

    def to_dense(self) -> Tensor:
        """The ``(num_embeddings, embedding_dim)`` table (for export and tests only)."""
        full = ttm_to_dense(self.chain_cores(), self.row_modes, self.col_modes)
        table = full[: self.num_embeddings, : self.embedding_dim]
        if self.cache is not None:  # cached rows are the cache's
            held = self.cache.ids != EMPTY
            table = table.index_put((self.cache.ids[held],), self.cache.weight[held])
        if self.padding_idx is not None:
            table = table.clone()
            table[self.padding_idx] = 0
        return table

    @classmethod
    def from_dense(cls, module: nn.Embedding | nn.EmbeddingBag,
                   ranks: int | Sequence[int] | None = None, tolerance: float | None = None,
                   row_frequencies: Tensor | None = None, **kwargs) -> TTEmbedding:
        """TTM-SVD of an embedding table (full rank when neither ``ranks`` nor ``tolerance``);
        ``row_frequencies`` keeps what lookups at those frequencies see (``formats.whiten``)."""
        layer = cls(module.num_embeddings, module.embedding_dim, ranks=1,
                    device=module.weight.device, dtype=module.weight.dtype,
                    **{**dense_options(module), **kwargs})
        rows, cols = layer.padded_shape
        table = zero_pad(module.weight.detach(), rows, cols)
        if row_frequencies is None:
            cores = ttm_svd(
                table, layer.row_modes, layer.col_modes, max_rank=ranks, tolerance=tolerance
            )
        else:
            if tolerance is not None:
                raise ValueError("row_frequencies take ranks=, not tolerance=")
            cores = weighted_lowrank_cores(layer, table, row_frequencies, ranks)
        layer._set_cores(cores)
        return layer

    @property
    def padded_shape(self) -> tuple[int, int]:
        return math.prod(self.row_modes), math.prod(self.col_modes)

    def extra_repr(self) -> str:
        bag = f", mode={self.mode!r}" if self.mode else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{bag}, {super().extra_repr()}"


class Chain(NamedTuple):
    """A table's cores and gates, listed, and what a row costs to build from them."""

    cores: list[Tensor]
    gates: list[Tensor]
    macs: int


def _listed(parameters: nn.ParameterList) -> list[nn.Parameter]:
    """A ``ParameterList``'s parameters in order, read from its dict (walking the list
    builds an index string and an attribute lookup per item: tens of microseconds a lookup
    when cold)."""
    listed = list(parameters._parameters.values())
    return listed if len(listed) == len(parameters) else list(parameters)  # a plain tensor


@functools.lru_cache(maxsize=1024)
def _row_macs(row_modes: tuple[int, ...], col_modes: tuple[int, ...],
              ranks: tuple[int, ...]) -> int:
    return chain_costs(row_modes, col_modes, ranks, 1)[0]


@torch._disable_dynamo  # torch.compiler.disable, with dynamo imported on first call, not at import
def _eager_forward(layer: TTEmbedding, input: Tensor, offsets: Tensor | None,
                   weights: Tensor | None) -> Tensor:
    """A cached table's forward, run eagerly (a graph break when called from compiled code)."""
    return layer._forward(input, offsets, weights)


SLICES_FIRST = "slices_first"
"""``layout()["cores"]`` of a table whose cores are stored ``(m_k, r_{k-1}, n_k, r_k)``;
a checkpoint without the key holds chain-order cores, turned on load."""


def slices_first(cores: Sequence[Tensor]) -> list[Tensor]:
    """Chain-order cores ``(r_{k-1}, m_k, n_k, r_k)`` stored slices first."""
    return [c.transpose(0, 1).contiguous() for c in cores]


def weighted_lowrank_cores(layer: TTEmbedding, table: Tensor, frequencies: Tensor,
                           ranks: int | Sequence[int] | None,
                           damping: float = TABLE_DAMPING) -> list[Tensor]:
    """Cores for ``layer`` (the low-rank layout) of the rank-``ranks`` table closest to
    ``table`` with rows weighed by their lookup ``frequencies`` (``formats.whiten``)."""
    if not is_lowrank_table(layer.row_modes, layer.col_modes):
        raise ValueError(
            f"row_frequencies need the low-rank table layout, row_modes ({layer.num_embeddings}, "
            f"1) and col_modes (1, {layer.embedding_dim}); got {list(layer.row_modes)} and "
            f"{list(layer.col_modes)}"
        )
    if frequencies.numel() != table.shape[0]:
        raise ValueError(f"row_frequencies has {frequencies.numel()} entries for a table of "
                         f"{table.shape[0]} rows")
    rank = min(table.shape) if ranks is None else internal_ranks(ranks, 2)[0]
    left, right = weighted_lowrank_table(table, frequencies.to(table.device), rank, damping)
    r = left.shape[1]
    return [left.reshape(1, table.shape[0], 1, r), right.reshape(r, 1, table.shape[1], 1)]


def dense_options(module: nn.Embedding | nn.EmbeddingBag) -> dict:
    """The settings of a dense table that its TT replacement keeps (keyword arguments)."""
    bag = isinstance(module, nn.EmbeddingBag)
    return {"padding_idx": module.padding_idx, "mode": module.mode if bag else None,
            "include_last_offset": bool(bag and module.include_last_offset),
            "sparse": bool(module.sparse)}


_sparse_adam_watched = False


def _watch_sparse_adam() -> None:
    """Once per process: make SparseAdam explain what to do with dense (TT core) gradients."""
    global _sparse_adam_watched
    if not _sparse_adam_watched:
        register_optimizer_step_pre_hook(_refuse_dense_grads_in_sparse_adam)
        _sparse_adam_watched = True


def _refuse_dense_grads_in_sparse_adam(optimizer, args, kwargs) -> None:
    """SparseAdam would fail on a dense gradient anyway; this says why and what to use."""
    if not isinstance(optimizer, torch.optim.SparseAdam):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and not param.grad.is_sparse:
                raise RuntimeError(
                    "torch.optim.SparseAdam only takes sparse gradients, but a parameter of "
                    f"shape {tuple(param.shape)} has a dense one. Tensorized embedding tables "
                    "(TTEmbedding) give their TT cores sparse gradients only where the table "
                    "was declared sparse=True and no process group is initialized (DDP and "
                    "FSDP2 reduce dense ones), and their rank gates are dense: optimize "
                    "dense gradients with torch.optim.Adam, Adagrad or SGD instead of "
                    "SparseAdam, e.g. torch.optim.Adagrad(model.parameters())."
                )
