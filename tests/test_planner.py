"""Tests for comera_compile.planner: optimality against brute force, numerics and gradients
against an independent reference, caches (memory and disk), records, torch.compile."""

from __future__ import annotations

import functools
import json
import math
import os
import random
import warnings
from pathlib import Path

import pytest
import torch

import comera_compile.planner as planner
import comera_compile.planner.cache as plan_cache
import comera_compile.planner.planning as planning
from comera_compile.planner import (
    EmbeddingPlan,
    ForwardPlan,
    Network,
    Plan,
    PlanReport,
    clear_memory_cache,
    embedding_plan,
    evaluate_path,
    get_plan,
    plan_network,
    record_plan,
    tt_linear_network,
    ttm_linear_network,
)
from comera_compile.planner.costs import parse_objective
from comera_compile.planner.dp import kbest_trees, tree_to_ssa
from comera_compile.planner.embedding import CHAIN

RANKS = (4, 16, 30)
BATCHES = (1, 8, 64, 512, 4096)
TT_SHAPES = {
    "768x768": ([12, 8, 8], [8, 8, 12]),
    "768x3072": ([12, 8, 8], [12, 16, 16]),
}
TTM_SHAPE = ([12, 8, 8], [8, 8, 12])  # in modes, out modes
EMB_SHAPE = ([16, 20, 10, 10], [4, 4, 8, 6])  # the CoMERA paper's word embedding (vocab, dim)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "plans"))
    clear_memory_cache()
    yield
    clear_memory_cache()


def _networks():
    for label, (n, m) in TT_SHAPES.items():
        for r in RANKS:
            for b in BATCHES:
                yield f"tt-{label}-r{r}-b{b}", tt_linear_network(n, m, r, b)
    for r in RANKS:
        for b in BATCHES:
            yield f"ttm-r{r}-b{b}", ttm_linear_network(*TTM_SHAPE, r, b)


# ----- an independent brute force over every binary contraction tree ---------------------
def open_legs(network: Network, subset) -> set:
    """Indices a contraction of the operands in ``subset`` leaves open (plain set math)."""
    terms = [set(t) for t in network.inputs]
    inside = set().union(*(terms[k] for k in subset))
    rest = set(range(len(terms))) - set(subset)
    outside = set(network.output).union(*(terms[k] for k in rest))
    return inside & outside


def largest_cores_only_intermediate(network: Network, path) -> int:
    """Elements of the largest intermediate along an SSA ``path`` that holds no ``x``."""
    groups = [frozenset([k]) for k in range(len(network.inputs))]
    sizes, largest = network.size_dict, 0
    for i, j in path:
        merged = groups[i] | groups[j]
        groups.append(merged)
        if 0 not in merged:
            largest = max(largest, math.prod(sizes[ix] for ix in open_legs(network, merged)))
    return largest


def brute_force_cost(
    network: Network, objective: str = "combo", training: bool = False, no_dense: bool = True
):
    """Minimum objective over ALL binary trees (outer products included), by memoised
    recursion over operand subsets with plain set arithmetic (shares no planner code).

    ``no_dense``: trees with a cores-only intermediate (operand 0 = x not in it) as large
    as the dense weight are not allowed, as in the planner."""
    terms = [set(t) for t in network.inputs]
    sizes = network.size_dict
    out = set(network.output)
    everyone = frozenset(range(len(terms)))
    if objective == "combo":
        factor, kind = 64, "combo"
    elif objective.startswith("combo-"):
        factor, kind = float(objective.split("-")[1]), "combo"
    else:
        factor, kind = 0, objective

    def legs(subset):
        inside = set().union(*(terms[k] for k in subset))
        outside = set(out).union(*(terms[k] for k in everyone - subset))
        return inside & outside

    def numel(ixs):
        return math.prod(sizes[i] for i in ixs)

    dense = math.prod(sizes[i] for i in (network.inputs[0] + network.output) if i != "b")

    @functools.cache
    def best(subset):
        if len(subset) == 1:
            return 0
        if no_dense and 0 not in subset and numel(legs(subset)) >= dense:
            return math.inf
        items = sorted(subset)
        first, rest = items[0], items[1:]
        found = math.inf
        for mask in range(2 ** len(rest)):
            left = frozenset([first] + [rest[q] for q in range(len(rest)) if mask >> q & 1])
            right = subset - left
            if not right:
                continue
            flops = numel(legs(left) | legs(right))
            size = numel(legs(subset))
            if training:
                flops, size = 3 * flops, size + numel(legs(left)) + numel(legs(right))
            local = {"flops": flops, "write": size, "size": size, "combo": flops + factor * size}[
                kind
            ]
            if kind == "size":
                total = max(best(left), best(right), local)
            else:
                total = best(left) + best(right) + local
            found = min(found, total)
        return found

    return best(everyone)


@pytest.mark.parametrize(
    "label,network", list(_networks()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_chosen_tree_is_the_brute_force_optimum(label, network):
    plan = get_plan(network, dtype=torch.float32, device_type="cpu")
    assert plan.cost == brute_force_cost(network)
    assert plan.rows_bucket == network.rows
    assert plan.optimizer.startswith(("cotengra.OptimalOptimizer", "comera.exact_dp"))


def test_no_plan_rebuilds_the_dense_weight():
    """At 4096 rows a TTM layer is cheapest on paper by merging its cores into the dense
    weight; the planner must take the best tree that does not."""
    net = ttm_linear_network(*TTM_SHAPE, 30, 4096)
    assert brute_force_cost(net, no_dense=False) < brute_force_cost(net)
    plan = get_plan(net, dtype=torch.float32, device_type="cpu")
    assert plan.cost == brute_force_cost(net)
    assert "no dense weight" in plan.optimizer
    assert largest_cores_only_intermediate(net, plan.path) < 768 * 768


@pytest.mark.parametrize("objective", ["flops", "size", "write", "combo-8"])
def test_other_objectives_are_optimal(objective):
    for b in (1, 4096):
        net = tt_linear_network([12, 8, 8], [8, 8, 12], 16, b)
        plan = plan_network(net, objective=objective)
        assert plan.cost == brute_force_cost(net, objective)
        assert plan.objective == objective


def test_bad_objective_is_rejected():
    with pytest.raises(ValueError, match="objective"):
        get_plan(
            tt_linear_network([4], [4], 2, 1),
            dtype=torch.float32,
            device_type="cpu",
            objective="fastest",
        )


def test_our_dp_matches_cotengra_and_brute_force():
    for label, net in _networks():
        if not label.endswith(("b1", "b4096")):
            continue
        obj = parse_objective("combo")
        ((cost, tree),) = kbest_trees(net.inputs, net.output, net.size_dict, obj)
        assert cost == brute_force_cost(net, no_dense=False)
        assert plan_network(net).cost == brute_force_cost(net)
        assert (
            evaluate_path(
                net.inputs, net.output, net.size_dict, tree_to_ssa(tree, len(net.inputs))
            ).cost
            == cost
        )


def test_training_cost_option_is_optimal_under_each_cost():
    """Each plan is optimal under its own cost, so neither tree beats the other there."""
    changed = 0
    for label, net in _networks():
        plain = plan_network(net)
        trained = plan_network(net, training=True)
        assert trained.training and trained.cost == brute_force_cost(net, training=True)
        plain_cost_when_training, trained_cost_when_plain = (
            evaluate_path(net.inputs, net.output, net.size_dict, p.path, "combo", training=t).cost
            for p, t in ((plain, True), (trained, False))
        )
        assert plain_cost_when_training >= trained.cost, label
        assert trained_cost_when_plain >= plain.cost, label
        changed += plain_cost_when_training > trained.cost
    assert changed < len(list(_networks()))  # the gradient-aware cost is a refinement


# ----- an independent reference contraction ----------------------------------------------
def reference_contract(inputs, output, operands):
    """Sweep the operands left to right with tensordot (float64); no planner code."""
    acc, acc_ix = operands[0], inputs[0]
    for k in range(1, len(inputs)):
        later = set(output).union(*inputs[k + 1 :])
        ix = inputs[k]
        shared = [c for c in acc_ix if c in ix]
        assert all(c not in later for c in shared)
        acc = torch.tensordot(
            acc,
            operands[k],
            dims=([acc_ix.index(c) for c in shared], [ix.index(c) for c in shared]),
        )
        acc_ix = "".join(c for c in acc_ix if c not in shared) + "".join(
            c for c in ix if c not in shared
        )
    return acc.permute([acc_ix.index(c) for c in output])


def random_operands(network: Network, rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    sizes = network.size_dict
    ops = []
    for term in network.inputs:
        shape = [rows if c == "b" else sizes[c] for c in term]
        fan = math.prod(sizes[c] for c in term if c != "b") if "b" not in term else 1
        t = torch.randn(shape, generator=gen, dtype=torch.float64)
        ops.append(t / math.sqrt(fan) * (1.0 if "b" in term else math.sqrt(sizes[term[-1]])))
    return ops


def _check_forward_and_grads(network: Network, rows: int, run_rows: int | None = None) -> None:
    """The plan chosen for ``rows`` against the reference, run on ``run_rows`` (default
    ``rows``; a plan serves every row count up to its bucket)."""
    plan = get_plan(network, dtype=torch.float32, device_type="cpu")
    ops64 = [t.requires_grad_() for t in random_operands(network, run_rows or rows)]
    ops32 = [t.detach().float().requires_grad_() for t in ops64]
    ref = reference_contract(network.inputs, network.output, ops64)
    out = plan.execute(*ops32)
    assert out.shape == ref.shape and out.dtype == torch.float32
    scale = ref.abs().max()
    assert (out.double() - ref).abs().max() <= 1e-5 * scale
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads_ref = torch.autograd.grad((ref * weight).sum(), ops64)
    grads = torch.autograd.grad((out * weight.float()).sum(), ops32)
    for g, gr in zip(grads, grads_ref):
        assert (g.double() - gr).abs().max() <= 1e-5 * gr.abs().max()


@pytest.mark.parametrize("rows", [1, 5, 8, 64, 512, 4096])
def test_forward_and_gradients_match_reference(rows):
    run = min(rows, 96)  # large-batch trees checked on 96 rows: the float64 reference is slow
    for n, m in TT_SHAPES.values():
        for r in RANKS:
            _check_forward_and_grads(tt_linear_network(n, m, r, rows), rows, run)
    for r in RANKS:
        _check_forward_and_grads(ttm_linear_network(*TTM_SHAPE, r, rows), rows, run)


@pytest.mark.parametrize(
    "build,args",
    [
        (tt_linear_network, ([6], [10], [1, 3, 1])),
        (tt_linear_network, ([4, 6], [10], 3)),
        (tt_linear_network, ([24], [2, 5], [3, 4])),
        (ttm_linear_network, ([6], [10], [1, 1])),
        (ttm_linear_network, ([2, 3, 4, 2], [3, 2, 2, 2], [5, 6, 7])),
    ],
)
def test_small_and_uneven_orders(build, args):
    for rows in (1, 3, 33):
        _check_forward_and_grads(build(*args, rows), rows)


def test_network_shapes_follow_the_spec():
    net = tt_linear_network([12, 8, 8], [8, 8, 12], [1, 12, 30, 30, 30, 12, 1], 7)
    assert net.shapes() == [
        (7, 12, 8, 8),
        (12, 12),
        (12, 8, 30),
        (30, 8, 30),
        (30, 8, 30),
        (30, 8, 12),
        (12, 12),
    ]
    assert net.names == ("x", "G1", "G2", "G3", "G4", "G5", "G6")
    assert net.equation.count(",") == 6 and "->b" in net.equation
    assert tt_linear_network([6], [10], 3, 2).shapes() == [(2, 6), (6, 3), (3, 10)]
    ttm = ttm_linear_network([12, 8, 8], [8, 8, 12], 4, 2)  # (in, out): cores (r, m, n, r)
    assert ttm.shapes() == [(2, 12, 8, 8), (8, 12, 4), (4, 8, 8, 4), (4, 12, 8)]
    assert ttm_linear_network([6], [10], 4, 2).shapes() == [(2, 6), (10, 6)]
    assert hash(net) == hash(tt_linear_network([12, 8, 8], [8, 8, 12], [12, 30, 30, 30, 12], 7))
    assert net == tt_linear_network([12, 8, 8], [8, 8, 12], [12, 30, 30, 30, 12], 7)
    with pytest.raises(ValueError, match="ranks"):
        tt_linear_network([4, 4], [4], [2, 2, 2, 2], 1)
    with pytest.raises(ValueError, match="TTM"):
        ttm_linear_network([4, 4], [4], 2, 1)


def test_plans_differ_across_batch_sizes():
    """One row is cheapest swept through the cores (x joins the first pair); 4096 rows
    amortize merging cores first. Both trees are the optimum at their own size."""
    small_net = tt_linear_network([12, 8, 8], [8, 8, 12], 30, 1)
    large_net = tt_linear_network([12, 8, 8], [8, 8, 12], 30, 4096)
    small = get_plan(small_net, dtype=torch.float32, device_type="cpu")
    large = get_plan(large_net, dtype=torch.float32, device_type="cpu")
    assert small.cost == brute_force_cost(small_net) and large.cost == brute_force_cost(large_net)
    assert 0 in small.path[0] and 0 not in large.path[0]
    assert small.order_expression() != large.order_expression()


# ----- caches ------------------------------------------------------------------------------
def test_memory_cache_buckets_rows():
    def plan(rows):
        return get_plan(
            tt_linear_network([12, 8, 8], [8, 8, 12], 16, rows),
            dtype=torch.float32,
            device_type="cpu",
        )

    p5 = plan(5)
    assert p5 is plan(8) and p5 is plan(7) and p5.rows_bucket == 8
    assert plan(9).rows_bucket == 16


def test_lru_forgets_the_least_recently_used():
    lru = plan_cache.LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.hit("a") == 1  # "a" is now the most recent
    lru.put("c", 3)
    assert (lru.hit("a"), lru.hit("b"), lru.hit("c"), len(lru)) == (1, None, 3, 2)


def test_memory_caches_are_bounded(monkeypatch):
    monkeypatch.setenv("COMERA_CACHE_DIR", "off")
    monkeypatch.setattr(plan_cache._requests, "maxsize", 3)
    monkeypatch.setattr(plan_cache._buckets, "maxsize", 3)
    nets = [tt_linear_network([4, 4], [4, 4], 2, rows) for rows in (1, 2, 4, 8)]

    def plan(net):
        return get_plan(net, dtype=torch.float32, device_type="cpu")

    first, *_, last = [plan(net) for net in nets]  # the 4th evicts the 1st from both
    assert len(plan_cache._requests) == len(plan_cache._buckets) == 3
    assert plan(nets[3]) is last and plan(nets[0]) is not first


def test_disk_cache_evicts_the_least_recently_used_files(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_cache, "MAX_DISK_ENTRIES", 3)
    nets = [tt_linear_network([4, 4], [4, 4], 2, rows) for rows in (1, 2, 4, 8)]
    files = []
    for age, net in enumerate(nets[:3]):
        get_plan(net, dtype=torch.float32, device_type="cpu")
        (new,) = set(_cache_files(tmp_path)) - set(files)
        os.utime(new, (1000 + age, 1000 + age))  # written in this order, seconds apart
        files.append(new)
    clear_memory_cache()
    get_plan(nets[0], dtype=torch.float32, device_type="cpu")  # a disk hit refreshes it
    get_plan(nets[3], dtype=torch.float32, device_type="cpu")  # the 4th file evicts one
    left = _cache_files(tmp_path)
    assert len(left) == 3 and files[1] not in left and {files[0], files[2]} <= set(left)


def _cache_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "plans").glob("*.json"))


def _forbid_planning(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("planned although a valid disk entry exists")

    monkeypatch.setattr(plan_cache, "plan_network", boom)


def test_plan_round_trips_through_dict_and_json():
    plan = get_plan(
        tt_linear_network([12, 8, 8], [8, 8, 12], 30, 64), dtype=torch.float32, device_type="cpu"
    )
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.to_dict() == plan.to_dict()
    assert again.order_expression() == plan.order_expression()
    ops = [
        t.float() for t in random_operands(tt_linear_network([12, 8, 8], [8, 8, 12], 30, 64), 64)
    ]
    assert torch.equal(again.execute(*ops), plan.execute(*ops))


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    net = tt_linear_network([12, 8, 8], [8, 8, 12], 30, 4096)
    plan = get_plan(net, dtype=torch.float32, device_type="cpu")
    (file,) = _cache_files(tmp_path)
    entry = json.loads(file.read_text())
    assert entry["plan"]["path"] == [list(p) for p in plan.path]
    assert entry["key"]["dtype"] == "float32" and entry["key"]["objective"] == "combo"
    clear_memory_cache()
    _forbid_planning(monkeypatch)
    loaded = get_plan(net, dtype=torch.float32, device_type="cpu")
    assert loaded is not plan and loaded.to_dict() == plan.to_dict()
    # another dtype or objective is another key
    monkeypatch.undo()
    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "plans"))
    get_plan(net, dtype=torch.float16, device_type="cpu")
    get_plan(net, dtype=torch.float32, device_type="cpu", objective="flops")
    assert len(_cache_files(tmp_path)) == 3


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda text: text[: len(text) // 2],  # truncated
        lambda text: "{not json",  # garbled
        lambda text: json.dumps({"hello": "world"}),  # foreign JSON
        lambda text: json.dumps([1, 2, 3]),
        lambda text: text.replace('"cotengra_version": "', '"cotengra_version": "0.0.'),
        lambda text: _edit_plan(text, path=[[0, 1], [0, 2]]),  # invalid path
        lambda text: _edit_plan(
            text, path=[[5, 6], [4, 7], [3, 8], [2, 9], [1, 10], [0, 11]]
        ),  # valid path, wrong costs
        lambda text: _edit_plan(text, macs=1),
    ],
)
def test_bad_disk_entries_are_replanned_and_rewritten(tmp_path, monkeypatch, corrupt):
    net = tt_linear_network([12, 8, 8], [8, 8, 12], 30, 4096)
    plan = get_plan(net, dtype=torch.float32, device_type="cpu")
    (file,) = _cache_files(tmp_path)
    good = file.read_text()
    file.write_text(corrupt(good))
    clear_memory_cache()
    calls = []
    real = plan_cache.plan_network
    monkeypatch.setattr(
        plan_cache, "plan_network", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    again = get_plan(net, dtype=torch.float32, device_type="cpu")
    assert calls == [1]
    assert again.to_dict() == plan.to_dict()
    assert json.loads(file.read_text()) == json.loads(good)


def _edit_plan(text: str, **changes) -> str:
    entry = json.loads(text)
    entry["plan"].update(changes)
    return json.dumps(entry)


def test_unwritable_cache_dir_warns_once(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("COMERA_CACHE_DIR", str(blocker / "plans"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (1, 2, 4):
            get_plan(
                tt_linear_network([4, 4], [4, 4], 2, rows), dtype=torch.float32, device_type="cpu"
            )
    assert len([w for w in caught if "not writable" in str(w.message)]) == 1


def test_cache_dir_default_and_off(monkeypatch):
    monkeypatch.delenv("COMERA_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert planner.cache_dir() == Path.home() / ".cache" / "comera_compile" / "plans"
    monkeypatch.setenv("COMERA_CACHE_DIR", "off")
    assert planner.cache_dir() is None


# ----- execution -----------------------------------------------------------------------------
def test_torch_compile_fullgraph():
    net = tt_linear_network([12, 8, 8], [8, 8, 12], 16, 64)
    plan = get_plan(net, dtype=torch.float32, device_type="cpu")
    ops = [t.float() for t in random_operands(net, 64)]

    def forward(x, *cores):
        return plan.execute(x, *cores) * 2

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*ops), forward(*ops))
    x = ops[0][:40].clone().requires_grad_()  # same plan, fewer rows
    compiled(x, *ops[1:]).sum().backward()
    assert x.grad is not None and x.grad.shape == (40, 12, 8, 8)


def test_no_einsum_and_no_upward_imports():
    root = Path(planner.__file__).parent
    for file in root.glob("*.py"):
        text = file.read_text()
        assert "einsum" not in text, file
        for upper in ("nn", "passes", "training", "compile", "api"):
            assert f"comera_compile.{upper}" not in text, file
            assert f"from ..{upper}" not in text, file


def test_large_network_uses_cotengra_hyper_deterministically():
    net = tt_linear_network([2] * 9, [2] * 9, 3, 16)  # 19 operands
    random.seed(1)
    first = plan_network(net)
    assert first.optimizer.startswith("cotengra.HyperOptimizer")
    random.seed(2)  # cotengra's greedy trials draw from the global generator
    state = random.getstate()
    assert plan_network(net).path == first.path
    assert random.getstate() == state  # the caller's random stream is left as it was
    _check_forward_and_grads(net, 16)


def _timed_candidates(monkeypatch) -> list:
    """Record the candidate lists autotuning times (the timing itself still runs)."""
    seen = []
    real = planning.fastest

    def recording(candidates, *args, **kwargs):
        seen.append(list(candidates))
        return real(candidates, *args, **kwargs)

    monkeypatch.setattr(planning, "fastest", recording)
    return seen


def test_autotune_picks_a_top_candidate(monkeypatch):
    net = ttm_linear_network(*TTM_SHAPE, 16, 64)
    ops = [t.float() for t in random_operands(net, 64)]
    seen = _timed_candidates(monkeypatch)
    plan = get_plan(
        net, dtype=torch.float32, device_type="cpu", autotune=True, operands_example=ops
    )
    assert plan.autotuned and plan.optimizer.startswith("comera.exact_dp(k=4")
    (candidates,) = seen
    costs = [c.cost for c in candidates]
    assert len(candidates) == 4 and costs == sorted(costs)
    assert costs[0] == brute_force_cost(net)  # the best by model cost is the optimum
    assert plan.path in [c.path for c in candidates]
    assert not get_plan(net, dtype=torch.float32, device_type="cpu").autotuned
    _check_forward_and_grads(net, 64)


# ----- embedding -----------------------------------------------------------------------------
def embedding_split_macs(m, n, ranks, rows):
    """Independent count: simulate every merge by shapes, then the per-row bmm."""
    d = len(m)
    full = [1, *ranks, 1] if len(ranks) == d - 1 else list(ranks)
    out = {}
    for s in range(1, d):
        macs = 0
        shape = (m[0], n[0], full[1])  # left (M, N, r)
        for k in range(1, s):
            macs += shape[0] * shape[1] * full[k] * m[k] * n[k] * full[k + 1]
            shape = (shape[0] * m[k], shape[1] * n[k], full[k + 1])
        n_left = shape[1]
        rshape = (full[d - 1], m[d - 1], n[d - 1])  # right (r, M, N)
        for k in range(d - 2, s - 1, -1):
            macs += full[k] * m[k] * n[k] * full[k + 1] * rshape[1] * rshape[2]
            rshape = (full[k], m[k] * rshape[1], n[k] * rshape[2])
        out[s] = macs + rows * n_left * full[s] * rshape[2]
    chain, width = 0, n[0]  # per-row chain: (b, N, r) @ (b, r, n_k r') for k >= 2
    for k in range(1, d):
        chain += rows * width * full[k] * n[k] * full[k + 1]
        width *= n[k]
    out[CHAIN] = chain
    return out


@pytest.mark.parametrize("rank", RANKS)
def test_embedding_split_is_optimal(rank):
    splits = []
    for rows in BATCHES:
        plan = embedding_plan(*EMB_SHAPE, rank, rows)
        costs = embedding_split_macs(*EMB_SHAPE, [rank] * 3, rows)
        assert plan.macs == min(costs.values()) and plan.cost == plan.macs
        assert plan.rows_bucket == rows
        splits.append(plan.split)
    # the per-row chain grows with the ids, merging half-chains does not: a few ids take
    # the chain, thousands a split
    assert splits[0] == CHAIN and splits[-1] != CHAIN
    assert embedding_plan(*EMB_SHAPE, [1, rank, rank, rank, 1], 3) is embedding_plan(
        *EMB_SHAPE, rank, 4
    )


def ttm_table(cores, m, n):
    """Full (prod m, prod n) TTM table, float64, by sequential tensordot (tests only)."""
    acc = cores[0].reshape(m[0], n[0], -1)
    for core in cores[1:]:
        acc = torch.tensordot(acc, core, dims=([acc.dim() - 1], [0]))
    acc = acc.reshape(*[x for pair in zip(m, n) for x in pair])
    d = len(m)
    acc = acc.permute(*range(0, 2 * d, 2), *range(1, 2 * d, 2))
    return acc.reshape(math.prod(m), math.prod(n))


def _ttm_cores(m, n, ranks, seed=0):
    full = [1, *ranks, 1]
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(full[k], m[k], n[k], full[k + 1], generator=gen, dtype=torch.float64)
        / math.sqrt(full[k])
        for k in range(len(m))
    ]


@pytest.mark.parametrize(
    "m,n,ranks",
    [
        ([4, 5, 6], [2, 3, 4], [3, 5]),
        ([3, 2, 4, 2], [2, 3, 2, 2], [4, 6, 3]),
        ([7], [5], []),
        ([3, 5], [4, 2], [6]),
    ],
)
def test_embedding_lookup_matches_table_and_grads(m, n, ranks):
    cores64 = [c.requires_grad_() for c in _ttm_cores(m, n, ranks)]
    # a lookup reads its cores slices first, (m, r, n, r')
    cores32 = [c.detach().float().transpose(0, 1).contiguous().requires_grad_() for c in cores64]
    ids = torch.randint(0, math.prod(m), (37,), generator=torch.Generator().manual_seed(2))
    table = ttm_table(cores64, m, n)
    ref = table.index_select(0, ids)
    for rows in (1, 37, 4096):
        plan = embedding_plan(m, n, [1, *ranks, 1], rows)
        splits = [*range(1, len(m)), CHAIN] if len(m) > 1 else [0]
        for split in splits:
            forced = EmbeddingPlan(
                plan.row_modes, plan.col_modes, plan.ranks, plan.rows_bucket, split, 0, 0, 0
            )
            out = forced.lookup(ids, cores32)
            assert out.shape == (37, math.prod(n))
            assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    plan = embedding_plan(m, n, [1, *ranks, 1], 37)
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g_ref = torch.autograd.grad((ref * w).sum(), cores64)
    for split in splits:
        forced = EmbeddingPlan(plan.row_modes, plan.col_modes, plan.ranks, 64, split, 0, 0, 0)
        g = torch.autograd.grad((forced.lookup(ids, cores32) * w.float()).sum(), cores32)
        for a, b in zip(g, g_ref):
            assert (a.transpose(0, 1).double() - b).abs().max() <= 1e-5 * b.abs().max()


def test_embedding_chain_wins_for_few_ids_and_split_for_many():
    m, n, ranks = [16, 20, 10, 10], [4, 4, 8, 6], [1, 32, 32, 32, 1]
    assert embedding_plan(m, n, ranks, 1).split == CHAIN
    assert embedding_plan(m, n, ranks, 4096).split != CHAIN
    record = record_plan("emb", embedding_plan(m, n, ranks, 1), 768, 1)
    assert record.macs == 4 * 32 * 4 * 32 + 16 * 32 * 8 * 32 + 128 * 32 * 6


def test_embedding_reference_config_rows():
    m, n = EMB_SHAPE
    cores64 = _ttm_cores(m, n, [30, 30, 30])
    ids = torch.tensor([0, 1, 31999, 12345, 800, 20000])
    plan = embedding_plan(m, n, 30, len(ids))
    out = plan.lookup(ids, [c.float().transpose(0, 1) for c in cores64])
    for row, token in zip(out, ids.tolist()):
        digits, rest = [], token
        for size in reversed(m):
            digits.append(rest % size)
            rest //= size
        digits.reverse()
        acc = cores64[0][:, digits[0]].reshape(n[0], -1)
        for k in range(1, len(m)):
            acc = torch.tensordot(acc, cores64[k][:, digits[k]], dims=([acc.dim() - 1], [0]))
        expect = acc.reshape(-1)
        assert (row.double() - expect).abs().max() <= 1e-5 * expect.abs().max()


def test_embedding_lookup_compiles_fullgraph():
    m, n = [4, 5, 6], [2, 3, 4]
    cores = [c.float().transpose(0, 1) for c in _ttm_cores(m, n, [3, 5])]  # slices first
    plan = embedding_plan(m, n, [3, 5], 16)
    ids = torch.randint(0, 120, (16,))
    torch._dynamo.reset()
    compiled = torch.compile(lambda i, *c: plan.lookup(i, c), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids, *cores), plan.lookup(ids, cores))


# ----- records -------------------------------------------------------------------------------
def test_records_and_report(tmp_path):
    net = tt_linear_network([12, 8, 8], [8, 8, 12], 30, 32)
    plan = get_plan(net, dtype=torch.float32, device_type="cpu")
    dense = 768 * 768
    rec = record_plan("encoder.0.q", plan, dense_macs=dense * 32, batch_size=32)
    assert rec.macs == plan.macs and rec.batch_size == 32 and rec.order == plan.order_expression()
    rec20 = record_plan("encoder.0.q", plan, dense_macs=dense * 20, batch_size=20)
    net20 = tt_linear_network([12, 8, 8], [8, 8, 12], 30, 20)  # the same tree on 20 rows
    at20 = evaluate_path(net20.inputs, net20.output, net20.size_dict, plan.path, plan.objective)
    assert (rec20.macs, rec20.peak, rec20.cost) == (at20.macs, at20.peak, at20.cost)

    assert rec20.macs < rec.macs and rec20.rows_bucket == 32
    assert rec20.sizes["b"] == 20 and 0 < rec20.ratio < 1
    emb = embedding_plan(*EMB_SHAPE, 30, 4096)
    assert isinstance(plan, ForwardPlan) and isinstance(emb, ForwardPlan)  # one protocol
    rec_e = record_plan("embeddings.word", emb, dense_macs=0, batch_size=4096)
    assert rec_e.macs == emb.macs and rec_e.kind == "tt_embedding"
    assert rec_e.order.startswith("gather(")
    report = PlanReport([rec, rec20, rec_e])
    text = str(report)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["layer", "kind", "batch"]
    assert len(lines) == 5 and "encoder.0.q" in text and "gather(" in text
    out = tmp_path / "plans.json"
    dumped = report.to_json(out)
    assert json.loads(out.read_text()) == json.loads(dumped)
    assert json.loads(dumped)[0]["path"] == [list(p) for p in plan.path]


@pytest.mark.parametrize("rows", [1, 4096])
def test_bias_fused_into_last_matmul_matches_separate_add(rows):
    net = tt_linear_network((4, 3), (2, 5), 3, rows)
    plan = get_plan(net, dtype=torch.float64, device_type="cpu")
    ops = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in net.shapes()]
    bias = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    fused = plan.execute(*ops, bias=bias)
    separate = plan.execute(*ops) + bias
    torch.testing.assert_close(fused, separate)
    g1 = torch.autograd.grad(fused.sum(), [*ops, bias])
    g2 = torch.autograd.grad(separate.sum(), [*ops, bias])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    if rows == 4096:  # the (x . L) . R order ends in a plain matmul: the bias rides in it
        assert plan.program().bias_dims == 2


def test_reference_order_is_an_autotune_candidate(monkeypatch):
    from comera_compile.planner.networks import tt_linear_reference_path
    from comera_compile.planner.planning import make_plan

    net = tt_linear_network([4, 3], [2, 5], 3, 16)
    reference = make_plan(net, tt_linear_reference_path(net), "combo", False, "reference order")
    assert reference.order_expression() == "(x . (G1 . G2)) . (G3 . G4)"
    ops = [torch.randn(s, dtype=torch.float64) for s in net.shapes()]
    torch.testing.assert_close(reference.execute(*ops), plan_network(net).execute(*ops))
    seen = _timed_candidates(monkeypatch)
    tuned = plan_network(net, autotune=True)
    (candidates,) = seen
    assert reference.path in [c.path for c in candidates]
    assert tuned.autotuned and tuned.path in [c.path for c in candidates]
    assert tuned.optimizer == "reference order" or tuned.optimizer.startswith("comera.exact_dp")
