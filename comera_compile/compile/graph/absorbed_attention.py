"""Attention through the rank bonds: Q, K, V and O projections that are TT, low-rank or
CoLA layers never expand to the model width."""
from __future__ import annotations

import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from comera_compile.formats.tt import merge_cores
from comera_compile.nn.tt_linear import merge_right
from comera_compile.planner.ops import CONTRACT, symbolic_hint

log = logging.getLogger("comera_compile")

_SDPA = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
_SPLITTERS = {torch.split, torch.chunk, torch.unbind}
_absorbed = 0  # attentions rewritten in this process (attentions_absorbed)
_BOND_KINDS = ("tt", "lowrank")


def bond_factors(cores: Sequence[Tensor], n_in: int) -> tuple[Tensor, Tensor]:
    """``(L, R)`` with ``W = L @ R`` for a TT linear's squeezed cores (first ``n_in`` of them
    over the input modes): ``L`` is ``N_in x r``, ``R`` is ``r x N_out``. Both are built from
    the cores (weights only), never from the dense weight."""
    return merge_cores(cores[:n_in]), merge_right(cores[n_in:])


def _resolve(view: Sequence, rows) -> tuple:
    """``(b, t, h, d)`` of a head view, with a ``-1`` batch or length read from the rows."""
    b, t, h, d = view
    if isinstance(b, int) and b == -1:
        b = rows // t
    if isinstance(t, int) and t == -1:
        t = rows // b
    return b, t, h, d


def attention_on_bonds(tq: Tensor, tk: Tensor, tv: Tensor, rq: Tensor, rk: Tensor, rv: Tensor,
                       lo: Tensor, q_bias: Tensor | None, k_bias: Tensor | None,
                       v_bias: Tensor | None, q_view: Sequence, k_view: Sequence, v_view: Sequence,
                       attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                       is_causal: bool = False, scale: float | None = None,
                       out_dims: int = 2) -> Tensor:
    """``concat_h(attention_h) @ lo`` of a standard attention whose queries, keys and values
    are ``t @ R + b`` on bond activations ``t`` (``(..., r)``, rows in ``(b, t)`` order),
    computed without the model-wide Q, K and V (module docstring): ``rows x r_o``, or
    ``b x t x r_o`` for ``out_dims=3``."""
    r_q, r_k, r_v, r_o = rq.shape[0], rk.shape[0], rv.shape[0], lo.shape[1]
    tq, tk, tv = tq.reshape(-1, r_q), tk.reshape(-1, r_k), tv.reshape(-1, r_v)
    b, t_q, h, d = _resolve(q_view, tq.shape[0])
    t_k, dv = _resolve(k_view, tk.shape[0])[1], v_view[3]
    s = scale if scale is not None else 1.0 / math.sqrt(d)
    rk_h = rk.reshape(r_k, h, d)
    m = torch.einsum("ihd,jhd->ihj", rq.reshape(r_q, h, d), rk_h) * s  # (r_q, h, r_k)
    q2 = (tq @ m.reshape(r_q, h * r_k)).view(b, t_q, h, r_k)
    shift = torch.zeros((), dtype=q2.dtype, device=q2.device)
    if k_bias is not None:  # cancelled by the softmax: an exact zero, so its grad is zeros
        shift = shift + (k_bias.to(q2.dtype) * 0).sum()
    if q_bias is not None:
        shift = shift + torch.einsum("jhd,hd->hj", rk_h, q_bias.to(rk.dtype).view(h, d)) * s
    q2 = (q2 + shift).transpose(1, 2)  # (b, h, tq, r_k)
    keys = tk.view(b, 1, t_k, r_k)
    lo_h = lo.reshape(h, dv, r_o)
    n = torch.einsum("ihd,hdj->ihj", rv.reshape(r_v, h, dv), lo_h)  # (r_v, h, r_o)
    w = (tv @ n.reshape(r_v, h * r_o)).view(b, t_k, h, r_o).transpose(1, 2)  # (b, h, tk, r_o)
    if v_bias is not None:  # each query's attention weights sum to one (or all are zero)
        c_o = torch.einsum("hd,hdj->hj", v_bias.to(lo.dtype).view(h, dv), lo_h)
        w = w + c_o.view(1, h, 1, r_o)
    # torch's attention on the bond-wide heads (its kernel choice: no score matrix where a
    # flash kernel takes the shapes, which asks one width of queries, keys and values:
    # zero columns pad the narrower, exactly); the scale is already in ``m``. Symbolic
    # ranks are padded by a symbolic amount, not compared: a rank cut adds no guard.
    width = torch.sym_max(r_k, r_o)
    if q2.is_cuda:  # CUDA's flash and memory-efficient kernels take head widths in 8s
        width = (width + 7) // 8 * 8
    symbolic = not isinstance(width, int)
    if symbolic or r_k != width:
        q2, keys = F.pad(q2, (0, width - r_k)), F.pad(keys, (0, width - r_k))
    if symbolic or r_o != width:
        w = F.pad(w, (0, width - r_o))
    heads = F.scaled_dot_product_attention(q2, keys.expand(b, h, t_k, width), w, attn_mask,
                                           dropout_p, is_causal, scale=1.0)
    t_o = heads[..., :r_o].sum(1)  # (b, tq, r_o)
    return t_o if out_dims == 3 else t_o.reshape(-1, r_o)


def absorbed_attention(xq: Tensor, xk: Tensor, xv: Tensor, q_cores: list[Tensor],
                       k_cores: list[Tensor], v_cores: list[Tensor], o_cores: list[Tensor],
                       q_bias: Tensor | None, k_bias: Tensor | None, v_bias: Tensor | None,
                       n_in: tuple[int, int, int, int], q_view: Sequence, k_view: Sequence,
                       v_view: Sequence, o_out_shape: Sequence, attn_mask: Tensor | None = None,
                       dropout_p: float = 0.0, is_causal: bool = False,
                       scale: float | None = None) -> Tensor:
    """The O layer's contraction output (``rows x *out_modes``) of a standard attention whose
    projections are TT layers, computed through their bonds (module docstring)."""
    lq, rq = bond_factors(q_cores, n_in[0])
    lk, rk = bond_factors(k_cores, n_in[1])
    lv, rv = bond_factors(v_cores, n_in[2])
    lo, ro = bond_factors(o_cores, n_in[3])
    t_o = attention_on_bonds(
        xq.reshape(xq.shape[0], -1) @ lq, xk.reshape(xk.shape[0], -1) @ lk,
        xv.reshape(xv.shape[0], -1) @ lv, rq, rk, rv, lo, q_bias, k_bias, v_bias,
        q_view, k_view, v_view, attn_mask, dropout_p, is_causal, scale)
    return (t_o @ ro).reshape(o_out_shape)


@dataclass
class _Projection:
    """One of Q, K, V: a layer's output ``t @ R (+ bias)`` viewed as heads. ``contract``: a
    TT layer's contraction node (``t`` and ``R`` come from its input and cores); else
    ``matmul`` is the layer's last product ``t @ R`` (a CoLA layer's second factor)."""

    contract: fx.Node | None
    matmul: fx.Node | None
    bias: fx.Node | None  # the bias added to its output
    view: Sequence  # (b, t, h, d) of the head view
    chain: list[fx.Node]  # the nodes from the layer's output to the head layout
    columns: tuple[int, int] | None = None  # its share of a fused Q/K/V layer's outputs


def _is_method(node: fx.Node, *names: str) -> bool:
    return node.op == "call_method" and node.target in names


def _is_matmul(node: fx.Node | None) -> bool:
    return (node is not None and node.op == "call_function" and len(node.args) == 2
            and node.target in (operator.matmul, torch.matmul) and not node.kwargs)


def _used_once(node: fx.Node) -> bool:
    """Whether one node of the graph reads ``node``, besides the graph's output (a key /
    value cache a model returns keeps its tensors, computed as before, and nothing else)."""
    return sum(user.op != "output" for user in node.users) == 1


def _single_input(node: fx.Node) -> fx.Node | None:
    arg = node.args[0] if node.args else None
    return arg if isinstance(arg, fx.Node) else None


def _same_dtype_to(node: fx.Node) -> bool:
    """``x.to(dtype)`` that changes nothing (the TT layer's output is already that dtype)."""
    if not _is_method(node, "to") or len(node.args) != 2 or node.kwargs:
        return False
    source = _single_input(node)
    value = source.meta.get("example_value") if source is not None else None
    return isinstance(node.args[1], torch.dtype) and isinstance(value, Tensor) and (
        value.dtype == node.args[1])


def _view_shape(node: fx.Node) -> list | None:
    args = list(node.args[1:])
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = list(args[0])
    return args if len(args) == 4 else None


def _skip_no_ops(node: fx.Node | None, chain: list[fx.Node]) -> fx.Node | None:
    while node is not None and (_is_method(node, "contiguous") or _same_dtype_to(node)):
        chain.append(node)
        node = _single_input(node)
    return node


def _bias_add(node: fx.Node | None, chain: list[fx.Node]) -> tuple[fx.Node | None, object]:
    """``(y, bias)`` of ``y + bias`` (``bias`` None where ``node`` adds nothing);
    ``(None, None)`` where the added term is no graph value."""
    if node is not None and node.op == "call_function" and node.target in (
            operator.add, torch.add) and len(node.args) == 2 and not node.kwargs:
        chain.append(node)
        y, bias = node.args
        return (y, bias) if isinstance(bias, fx.Node) else (None, None)
    return node, None


def _projection(node: fx.Node) -> _Projection | None:
    """``layer output -> [+ bias] -> view(b,t,h,d) -> transpose(1,2)``, where the output is
    a TT contraction's (``contract -> reshape``, the bias between two reshapes) or a plain
    product ``t @ R`` (the bias a vector over the heads)."""
    chain = []
    node = _after_empty_cache(node, chain)
    packed = _packed_share(node)
    if packed is not None:
        output, view, columns = packed
        return _plain_projection(output, view, columns, [*chain, node])
    chain.append(node)
    if not (_is_method(node, "transpose") and tuple(node.args[1:]) in ((1, 2), (2, 1))):
        return None
    node = _skip_no_ops(_single_input(node), chain)
    if node is None or not _is_method(node, "view", "reshape") or _view_shape(node) is None:
        return None
    value = node.meta.get("example_value")
    if value is None or value.dim() != 4:
        return None
    # heads and head width from the traced shape (a ``-1`` there is common), batch and
    # length as the graph computes them
    view = [*_view_shape(node)[:2], *(int(n) for n in value.shape[2:])]
    chain.append(node)
    node = _skip_no_ops(_single_input(node), chain)
    if node is not None and _is_method(node, "reshape", "view"):  # a TT layer's output
        chain.append(node)
        node, bias = _bias_add(_single_input(node), chain)
        if node is None or not _is_method(node, "reshape", "view"):
            return None
        chain.append(node)
        node = _single_input(node)
        if node is None or node.op != "call_function" or node.target is not CONTRACT:
            return None
        if node.args[2] not in _BOND_KINDS or not all(map(_used_once, [*chain, node])):
            return None
        return _Projection(node, None, bias, view, chain)
    node, columns = _fused_share(node, view[2] * view[3], chain)
    return _plain_projection(node, view, columns, chain)


def _plain_projection(node: fx.Node | None, view: list, columns: tuple[int, int] | None,
                      chain: list[fx.Node]) -> _Projection | None:
    """The projection whose output ``node`` is ``t @ R [+ bias]`` (``columns``: its share
    ``(start, total)`` of a fused layer's outputs, None for a layer of its own)."""
    width = view[2] * view[3]
    if not all(map(_used_once, chain)):
        return None
    fused = columns is not None
    node, bias = _bias_add(node, chain)
    if not _is_matmul(node) or (not fused and not all(map(_used_once, (*chain, node)))):
        return None
    t, r = (_shape(n) if isinstance(n, fx.Node) else None for n in node.args)
    out = columns[1] if fused else width
    bias_shape = _shape(bias) if isinstance(bias, fx.Node) else ()
    if t is None or r is None or len(r) != 2 or r[1] != out or (
            symbolic_hint(t[-1]) != symbolic_hint(r[0])) or (
            bias is not None and bias_shape != (out,)):
        return None
    return _Projection(None, node, bias, view, chain,
                       (columns[0], columns[0] + width) if fused else None)


def _after_empty_cache(node: fx.Node, chain: list[fx.Node]) -> fx.Node:
    """The head tensor behind ``cat([empty, heads], dim=-2)`` (an empty key / value cache, as
    Hugging Face models build in training), or ``node`` itself."""
    if (node.op == "call_function" and node.target is torch.cat and len(node.args) >= 1
            and isinstance(node.args[0], (list, tuple)) and len(node.args[0]) == 2):
        empty, heads = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        shape = _shape(empty) if isinstance(empty, fx.Node) else None
        if isinstance(heads, fx.Node) and dim in (-2, 2) and shape is not None and (
                math.prod(shape) == 0):
            chain.append(node)
            return heads
    return node


def _item_of(node: fx.Node | None, *names: str) -> tuple[fx.Node, int] | None:
    """``(call, i)`` where ``node`` is ``call[i]`` and ``call`` is the method or torch
    function ``names`` (``split``, ``chunk``, ``unbind``)."""
    if node is None or node.op != "call_function" or node.target is not operator.getitem:
        return None
    call, index = node.args
    if not (isinstance(call, fx.Node) and isinstance(index, int) and call.args):
        return None
    if _is_method(call, *names) or (call.op == "call_function" and getattr(
            call.target, "__name__", None) in names and call.target in _SPLITTERS):
        return call, index
    return None


def _argument(call: fx.Node, position: int, name: str, default: object = None) -> object:
    return call.args[position] if len(call.args) > position else call.kwargs.get(name, default)


def _fused_share(node: fx.Node | None, width: int, chain: list[fx.Node]):
    """``(y, (start, total))`` where ``node`` is ``y.split(width, dim=-1)[i]`` or
    ``y.chunk(n, dim=-1)[i]`` (a fused Q/K/V layer, as GPT-2's ``c_attn``: this head tensor
    is columns ``start:start + width`` of ``total``), else ``(node, None)``."""
    item = _item_of(node, "split", "chunk")
    if item is None:
        return node, None
    call, index = item
    total = _shape(call.args[0]) if isinstance(call.args[0], fx.Node) else None
    if total is None:
        return node, None
    if call.target in ("split", torch.split):
        size = _argument(call, 1, "split_size_or_sections", call.kwargs.get("split_size"))
    else:
        chunks = _argument(call, 1, "chunks")
        size = total[-1] // chunks if isinstance(chunks, int) and total[-1] % chunks == 0 else 0
    if size != width or _argument(call, 2, "dim", 0) not in (-1, len(total) - 1):
        return node, None
    chain.append(node)
    return call.args[0], (index * width, total[-1])


def _packed_share(node: fx.Node) -> tuple[fx.Node, list, tuple[int, int]] | None:
    """``(y, (b, t, h, d), (start, total))`` where ``node`` is ``y.reshape(b, t, 3, h, d)
    .permute(2, 0, 3, 1, 4).unbind(0)[i]`` (a fused Q/K/V layer as timm's vision
    transformers and many encoders lay it out), else None."""
    item = _item_of(node, "unbind")
    if item is None or _argument(item[0], 1, "dim", 0) != 0:
        return None
    permute = item[0].args[0]
    if not (isinstance(permute, fx.Node) and _is_method(permute, "permute")):
        return None
    order = permute.args[1:]
    if len(order) == 1 and isinstance(order[0], (tuple, list)):
        order = tuple(order[0])
    reshape = _single_input(permute)
    if tuple(order) != (2, 0, 3, 1, 4) or reshape is None or not _is_method(
            reshape, "reshape", "view"):
        return None
    value, args = reshape.meta.get("example_value"), list(reshape.args[1:])
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = list(args[0])
    if value is None or value.dim() != 5 or len(args) != 5 or not isinstance(
            reshape.args[0], fx.Node):
        return None
    parts, h, d = (int(n) for n in value.shape[2:])
    return reshape.args[0], [*args[:2], h, d], (item[1] * h * d, parts * h * d)


def _output_projection(sdpa: fx.Node) -> fx.Node | None:
    """``sdpa -> transpose(1, 2) -> reshape(b, t, c) -> ... -> O layer``: the O layer's
    contraction node (a TT layer, after ``reshape(rows, *modes)``) or its first product
    ``x @ L`` (a CoLA layer). Before the transpose, reshapes to the same shape (a no-op some
    attention wrappers make) are allowed."""
    heads_shape = _shape(sdpa)
    node, steps, transposed = sdpa, 0, False
    while steps <= 8:
        if len(node.users) != 1:
            return None
        previous, node = node, next(iter(node.users))
        if node.op == "call_function" and node.target is CONTRACT:
            return node if transposed and node.args[2] in _BOND_KINDS else None
        if _is_matmul(node):
            left = _shape(node.args[1]) if isinstance(node.args[1], fx.Node) else None
            ok = transposed and node.args[0] is previous and left is not None and len(left) == 2
            return node if ok else None
        if _is_method(node, "transpose") and tuple(node.args[1:]) in ((1, 2), (2, 1)):
            if transposed:
                return None
            transposed = True
        elif not (_is_method(node, "reshape", "view", "contiguous") or _same_dtype_to(node)):
            return None
        elif not transposed and (heads_shape is None or _shape(node) != heads_shape):
            return None
        steps += 1
    return None


def _shape(node: fx.Node) -> tuple | None:
    value = node.meta.get("example_value")
    return tuple(value.shape) if isinstance(value, Tensor) else None


def _bond(projection: _Projection | fx.Node, side: str) -> int:
    """The bond width of a projection's layer: its contraction's middle bond, or the inner
    size of its plain product (``t @ R``: R's rows; the O layer's ``x @ L``: L's columns).
    A symbolic rank is read at its traced value without a guard: a rank cut then compiles
    nothing, and only narrows a bond absorbed as cheaper."""
    node = projection if isinstance(projection, fx.Node) else (
        projection.contract or projection.matmul)
    if node.target is CONTRACT:
        cores, n_in = node.args[1], len(node.args[3])
        value = cores[n_in - 1].meta.get("example_value")
        return symbolic_hint(value.shape[-1]) if value is not None else 1 << 30
    shape = _shape(node.args[1])
    return symbolic_hint(shape[0] if side == "in" else shape[1]) if shape else 1 << 30


def _cheaper(q: _Projection, k: _Projection, v: _Projection, o: fx.Node) -> bool:
    """Absorb only when the bonds are narrower than the heads (fewer flops per head)."""
    d, dv = q.view[3], v.view[3]
    if not all(isinstance(x, int) for x in (d, dv, k.view[3], q.view[2], k.view[2], v.view[2])):
        return False
    if not (q.view[2] == k.view[2] == v.view[2] and d == k.view[3]):
        return False
    return _bond(k, "in") < d and _bond(o, "out") < dv


def _sdpa_arguments(sdpa: fx.Node) -> dict | None:
    """The attention's arguments by name; None for a form not absorbed (grouped-query heads,
    an unknown keyword, or a dropout, causal flag or scale computed in the graph)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    args = dict(zip(names, sdpa.args))
    args.update(sdpa.kwargs)
    if set(args) - {*names, "enable_gqa"} or args.get("enable_gqa"):
        return None
    if any(isinstance(args.get(name), fx.Node) for name in ("dropout_p", "is_causal", "scale")):
        return None
    return args


def _share(graph: fx.Graph, p: _Projection) -> tuple[fx.Node, fx.Node | None]:
    """``(R, bias)`` of a plain projection: its own, or its columns of a fused layer's."""
    r, bias = p.matmul.args[1], p.bias
    if p.columns is None:
        return r, bias
    columns = slice(*p.columns)
    r = graph.call_function(operator.getitem, (r, (slice(None), columns)))
    if bias is not None:
        bias = graph.call_function(operator.getitem, (bias, columns))
    return r, bias


def attentions_absorbed() -> int:
    """How many attentions this process's compiled graphs compute through their bonds."""
    return _absorbed


def absorb_attention(gm: fx.GraphModule) -> int:
    """Rewrite each matching attention of ``gm`` (module docstring); returns how many."""
    global _absorbed
    count = 0
    for sdpa in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _SDPA]:
        args = _sdpa_arguments(sdpa)
        if args is None:
            continue
        q, k, v = (_projection(args[name]) for name in ("query", "key", "value"))
        o = _output_projection(sdpa)
        if None in (q, k, v, o) or not _cheaper(q, k, v, o):
            continue
        tt = [p.contract is not None for p in (q, k, v)] + [o.target is CONTRACT]
        if len(set(tt)) != 1:  # TT and plain layers mixed in one attention: left as it is
            continue
        out_value = o.meta.get("example_value")
        if out_value is None or (not tt[0] and out_value.dim() not in (2, 3)):
            continue
        options = (args.get("attn_mask"), float(args.get("dropout_p", 0.0)),
                   bool(args.get("is_causal", False)), args.get("scale"))
        with gm.graph.inserting_before(o):
            if tt[0]:
                rows = gm.graph.call_method("size", (q.contract.args[0], 0))
                new = gm.graph.call_function(absorbed_attention, (
                    q.contract.args[0], k.contract.args[0], v.contract.args[0],
                    q.contract.args[1], k.contract.args[1], v.contract.args[1], o.args[1],
                    q.bias, k.bias, v.bias,
                    tuple(len(n.args[3]) for n in (q.contract, k.contract, v.contract, o)),
                    tuple(q.view), tuple(k.view), tuple(v.view),
                    (rows, *(int(s) for s in out_value.shape[1:])), *options,
                ))
            else:
                shares = [_share(gm.graph, p) for p in (q, k, v)]
                new = gm.graph.call_function(attention_on_bonds, (
                    *(p.matmul.args[0] for p in (q, k, v)), *(r for r, _ in shares),
                    o.args[1], *(b for _, b in shares),
                    tuple(q.view), tuple(k.view), tuple(v.view), *options, out_value.dim(),
                ))
        new.meta.update(o.meta)
        o.replace_all_uses_with(new)
        count += 1
    if count:
        _absorbed += count
        gm.graph.eliminate_dead_code()
        gm.recompile()
        log.info("comera backend: %d attention(s) computed through their rank bonds", count)
    return count
