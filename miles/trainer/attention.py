"""The learner's attention: torch's `scaled_dot_product_attention`, except on short lines in bf16
on a CPU, where a plain fp32 attention over the key/value heads is faster.

Every model the learner loads (`miles.trainer.model.load_policy`) runs `ATTENTION`, an attention
function registered with transformers (`AttentionInterface`, its masks `sdpa`'s) in place of
`sdpa`. It sends a forward to `short_line_attention` when the queries are in bf16 on a CPU, lines
are at most `SHORT_LINE_WIDTH` tokens, keys are as long as queries (no cache) and there is no
dropout; every other forward to transformers' own `sdpa` function, unchanged.

Why: torch's fused CPU kernel has a fixed cost of 11-14 ms a layer (forward + backward) in bf16
on lines of 32-128 tokens (docs/benchmarks.md, "Attention kernels"), and its math kernel, given
the learner's boolean mask, converts the mask, checks it for fully masked rows and repeats the
key/value heads in every layer. `short_line_attention` computes what the math kernel computes
(scores, softmax and their product with the values in fp32), with the mask turned into an
additive bias and the query heads of each key/value head folded into one matrix product.

Simplification: a fully masked row (padding) attends uniformly to its line instead of giving
zeros: its output reaches only its own position, which no loss reads.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "miles_sdpa"
"""The attention implementation name of the learner's models."""
SHORT_LINE_WIDTH = 128
"""Lines of at most this many tokens take `short_line_attention` (bf16 on a CPU). Measured by
`benchmarks/bench_attention.py` (docs/benchmarks.md, "Attention kernels"): up to 128 tokens it is
faster than both of torch's kernels (3-5x the fused one's speed), at 256 as fast as the fused one,
beyond that slower."""

UNSUPPORTED = ("position_bias", "softcap", "s_aux")
"""Attention arguments of some architectures that `short_line_attention` does not apply: a forward
given any of them goes to transformers' `sdpa` function (which applies or refuses it)."""


def takes_short_path(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                     dropout: float, extras: dict) -> bool:
    """Whether `attention` computes this forward with `short_line_attention`: bf16 queries on a
    CPU, lines of at most `SHORT_LINE_WIDTH` tokens and no cache, no dropout, a mask shared by
    all heads (or none) and none of the `UNSUPPORTED` arguments."""
    return (query.device.type == "cpu" and query.dtype == torch.bfloat16 and dropout == 0.0
            and query.shape[2] == key.shape[2] <= SHORT_LINE_WIDTH
            and (mask is None or mask.shape[1] == 1)
            and all(extras.get(name) is None for name in UNSUPPORTED))


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
              scaling: float | None = None, is_causal: bool | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function: `short_line_attention` where it applies
    (`takes_short_path`), transformers' `sdpa` otherwise. Returns ([B, T, H, D], None)."""
    if not takes_short_path(query, key, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    bias = additive_bias(attention_mask, query.shape[2], causal=causal)
    return short_line_attention(query, key, value, bias, scale), None


def additive_bias(mask: torch.Tensor | None, length: int, *, causal: bool) -> torch.Tensor:
    """The fp32 bias added to the scores, [B or 1, 1, T, T]: 0 where a query may attend, the
    float32 minimum where it may not. `mask`: boolean (True: attend) or additive, [B, 1, T, T];
    None: causal, or no mask."""
    if mask is None:
        bias = torch.zeros(1, 1, length, length)
        if causal:
            bias.masked_fill_(torch.ones(length, length, dtype=torch.bool).triu(1),
                              torch.finfo(torch.float32).min)
        return bias
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    return mask.float()


def short_line_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         bias: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * q k^T + bias) v in fp32, in the queries' dtype, [B, T, H, D]. query
    [B, H, T, D]; key and value [B, KV, T, D], H a multiple of KV (grouped-query attention: the
    H / KV query heads of a key/value head are one matrix product, nothing is repeated)."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    q = (query.float() * scale).reshape(batch, kv_heads, group * length, dim)
    scores = torch.matmul(q, key.float().transpose(-1, -2))  # [B, KV, group * T, T]
    scores = scores.view(batch, kv_heads, group, length, length) + bias.unsqueeze(1)
    weights = scores.softmax(dim=-1).view(batch, kv_heads, group * length, length)
    out = torch.matmul(weights, value.float())  # [B, KV, group * T, D]
    return out.view(batch, heads, length, dim).transpose(1, 2).to(query.dtype).contiguous()


AttentionInterface.register(ATTENTION, attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
