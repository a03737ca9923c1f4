"""SplitMultiheadAttention: ``nn.MultiheadAttention`` with its four projections as modules."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from comera_compile.nn.base import encode_layout

SPLIT_ATTENTION = "split_attention"


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """A Linear holding copies of the given weight and bias (no random init)."""
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach().clone(), weight.requires_grad)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), bias.requires_grad)
    return layer


def _batch_first(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sequence-first inputs as contiguous batch-first ones (one copy where they are one
    tensor, as in self-attention)."""
    q = query.transpose(0, 1).contiguous()
    k = q if key is query else key.transpose(0, 1).contiguous()
    v = q if value is query else k if value is key else value.transpose(0, 1).contiguous()
    return q, k, v


class SplitMultiheadAttention(nn.Module):
    """Drop-in for ``nn.MultiheadAttention`` whose projections are separate modules."""

    # read by nn.TransformerEncoder(Layer) to decide on their fused kernels, which need the
    # packed weights: these values make them take the module path, which calls forward.
    _qkv_same_embed_dim = False
    in_proj_weight = None
    in_proj_bias = None

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        e = mha.embed_dim
        self.embed_dim, self.kdim, self.vdim = e, mha.kdim, mha.vdim
        self.num_heads, self.head_dim = mha.num_heads, mha.head_dim
        self.dropout, self.batch_first = mha.dropout, mha.batch_first
        self.add_zero_attn = mha.add_zero_attn
        if mha._qkv_same_embed_dim:
            weights = mha.in_proj_weight.chunk(3)
        else:
            weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
        biases = (None,) * 3 if mha.in_proj_bias is None else mha.in_proj_bias.chunk(3)
        self.q_proj = _linear(weights[0], biases[0])
        self.k_proj = _linear(weights[1], biases[1])
        self.v_proj = _linear(weights[2], biases[2])
        self.out_proj = _linear(mha.out_proj.weight, mha.out_proj.bias)
        self.bias_k, self.bias_v = mha.bias_k, mha.bias_v
        self.train(mha.training)

    def get_extra_state(self) -> Tensor:
        return encode_layout({"format": SPLIT_ATTENTION})

    def set_extra_state(self, state) -> None:
        pass

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Tensor | None = None, need_weights: bool = True,
                attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask, mask_name="key_padding_mask",
            other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
            target_type=query.dtype,
        )
        attn_mask = F._canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
            target_type=query.dtype, check_other=False,
        )
        batched = query.dim() == 3
        if not batched:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if is_causal and attn_mask is None:
            raise RuntimeError("is_causal=True needs attn_mask too (as nn.MultiheadAttention)")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # the kernel builds the causal mask itself
        else:
            is_causal = False
        if batched and not need_weights and self.bias_k is None and not self.add_zero_attn:
            if self.batch_first:
                return self._attend_batch_first(query, key, value, key_padding_mask,
                                                attn_mask, is_causal), None
            query, key, value = _batch_first(query, key, value)
            out = self._attend_batch_first(query, key, value, key_padding_mask, attn_mask,
                                           is_causal)
            return out.transpose(0, 1), None
        if self.batch_first and batched:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        out, weights = self._attend(query, key, value, key_padding_mask, need_weights,
                                    attn_mask, average_attn_weights, is_causal)
        if not batched:
            out = out.squeeze(1)
            weights = weights.squeeze(0) if weights is not None else None
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _attend(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                average_attn_weights, is_causal):
        """Sequence-first ``(L, N, E)`` inputs, as ``F.multi_head_attention_forward``."""
        tgt_len, bsz, _ = query.shape
        heads, head_dim = self.num_heads, self.head_dim
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if attn_mask is not None and attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.repeat(1, bsz, 1)])
            v = torch.cat([v, self.bias_v.repeat(1, bsz, 1)])
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        q = q.reshape(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.reshape(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.reshape(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(bsz * heads, 1, head_dim)], dim=1)
            v = torch.cat([v, v.new_zeros(bsz * heads, 1, head_dim)], dim=1)
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        src_len = k.shape[1]
        attn_mask = self._with_padding(attn_mask, key_padding_mask, bsz, src_len)
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            scores = (q * math.sqrt(1.0 / head_dim)) @ k.transpose(-2, -1)
            if attn_mask is not None:
                scores = scores + attn_mask
            weights = F.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, self.embed_dim)
            out = self.out_proj(out).view(tgt_len, bsz, -1)
            weights = weights.view(bsz, heads, tgt_len, src_len)
            return out, weights.mean(dim=1) if average_attn_weights else weights
        attn_mask = self._per_head(attn_mask, bsz, src_len)
        q = q.view(bsz, heads, tgt_len, head_dim)
        k = k.view(bsz, heads, src_len, head_dim)
        v = v.view(bsz, heads, src_len, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, self.embed_dim)
        return self.out_proj(out).view(tgt_len, bsz, -1), None

    def _attend_batch_first(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        """Batch-first ``(N, L, E)`` inputs without attention weights: each projection's rows
        in ``(batch, position)`` order, viewed as heads as in the common
        ``q(x).view(b, t, h, d).transpose(1, 2)`` form (no layout copies of Q, K and V, and
        the compiled form can compute it through rank bonds:
        ``compile.graph.absorbed_attention``)."""
        bsz, tgt_len, _ = query.shape
        src_len, heads, head_dim = key.shape[1], self.num_heads, self.head_dim
        q = self.q_proj(query).view(bsz, tgt_len, heads, head_dim).transpose(1, 2)
        k = self.k_proj(key).view(bsz, src_len, heads, head_dim).transpose(1, 2)
        v = self.v_proj(value).view(bsz, src_len, heads, head_dim).transpose(1, 2)
        if attn_mask is not None and attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)
        attn_mask = self._with_padding(attn_mask, key_padding_mask, bsz, src_len)
        attn_mask = self._per_head(attn_mask, bsz, src_len)
        dropout_p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        return self.out_proj(out.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim))

    def _with_padding(self, attn_mask, key_padding_mask, bsz: int, src_len: int):
        """The attention mask (``(N * heads | 1, L, S)``) with the key padding added."""
        if key_padding_mask is None:
            return attn_mask
        padding = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, self.num_heads, -1, -1)
        padding = padding.reshape(bsz * self.num_heads, 1, src_len)
        return padding if attn_mask is None else attn_mask + padding

    def _per_head(self, attn_mask, bsz: int, src_len: int):
        """The mask laid out for ``(N, heads, L, S)`` scores."""
        if attn_mask is None:
            return None
        if attn_mask.shape[0] == 1:  # one mask for every batch row and head
            return attn_mask.unsqueeze(0)
        return attn_mask.view(bsz, self.num_heads, -1, src_len)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
