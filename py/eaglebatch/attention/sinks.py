"""Attention with sinks (gpt-oss): each query head h has a learned logit sinks[h] that joins
its softmax's denominator as one more column, visible to every query, and carries no value:

    out = sum_t exp(s_t - m) v_t / (sum_t exp(s_t - m) + exp(sinks[h] - m)),  m = max(s, sinks[h])

`scaled_dot_product_attention` has no input for it, so this computes the scores explicitly in
the reference's order (transformers' eager gpt-oss attention, the only one it runs that model
with): q k^T times the scale, masked, the sink column appended, the row maximum subtracted,
softmax, the sink column dropped, times V. Rescaling SDPA's output by sigmoid(lse - sink) would
need the log-sum-exp, which SDPA does not return, and rounds differently from the reference.
Query rows are computed in slices, so the [C, Hq, rows, Lk] scores stay within SCORE_ELEMENTS
(each row depends on its own scores only: a slice's values are the one-pass values up to the
GEMM's blocking, to float32 rounding; below the budget, as in every test model, no slicing).
Shapes alone decide the slices: no host synchronisation, so CUDA graphs capture it.
"""

from __future__ import annotations

import torch

SCORE_ELEMENTS = 1 << 25  # the most score entries computed at once (128 MiB in float32)


def attention_with_sinks(
    q: torch.Tensor,  # [C, Hq, Lq, D]
    k: torch.Tensor,  # [C, Hkv, Lk, D]
    v: torch.Tensor,  # [C, Hkv, Lk, D]
    sinks: torch.Tensor,  # [Hq]
    scale: float,
    mask: torch.Tensor | None,  # bool [C, 1, Lq, Lk], True = visible; None: see `causal`
    causal: bool,  # with no mask: key t visible to query j iff t <= j (SDPA's is_causal)
) -> torch.Tensor:  # [C, Hq, Lq, D]
    c, hq, lq, _ = q.shape
    group = hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [C, Hq, Lk, D]: query head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1)
    if mask is None and causal:
        mask = torch.ones(lq, k.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]
    rows = max(1, SCORE_ELEMENTS // max(1, c * hq * k.shape[2]))
    if rows >= lq:
        return _rows(q, k, v, sinks, scale, mask)
    parts = []
    for lo in range(0, lq, rows):
        part_mask = None if mask is None else mask[:, :, lo : lo + rows]
        parts.append(_rows(q[:, :, lo : lo + rows], k, v, sinks, scale, part_mask))
    return torch.cat(parts, dim=2)


def _rows(q, k, v, sinks, scale, mask) -> torch.Tensor:  # [C, Hq, rows, D]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [C, Hq, rows, Lk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    logits = torch.cat((scores, sink), dim=-1)  # [C, Hq, rows, Lk + 1]
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # the sink dropped
    return torch.matmul(probs.to(v.dtype), v)
