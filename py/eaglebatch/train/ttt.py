"""Training-time test (EAGLE-3): the draft head unrolled over its own outputs, dense and
differentiable, over a padded batch of whole sequences.

Positions p = 0..T-2 of a sequence x_0..x_{T-1}. Step 1 is teacher-forced: the draft input at p is
(fc(target features at p), token x_{p+1}) and its output out_1[p] predicts x_{p+2}. Step j > 1
mirrors inference, where the j-th draft token is produced from the draft's own previous output:
input at p is (out_{j-1}[p-1], x_{p+1}) and it attends to
    step-1 keys at positions <= p-j+1   (what draft-extend wrote from target features)
    step-i keys at position p-j+i, i = 2..j   (the draft's own earlier steps of this chain),
exactly the keys the paged draft cache holds when the j-th draft token is produced at inference.
Every step predicts the token after x_{p+1}: the target's greedy choice there (labels), which is
x_{p+2} in self-distilled text. Step j is only defined for p >= j-1.

At inference a chain only goes on from accepted drafts: the token fed to step j > 1 is the draft's
previous output, and it equals the target's greedy choice. In recorded (reference) answers x_{p+1}
is often not the target's choice at p; a step-j example at p is therefore trained and measured only
where x_{q+1} is the target's greedy choice at q for every q = p-j+2 .. p (`chain_ok`), so the
per-step accuracies are the conditional acceptance rates the chain sees. Step 1 trains on every
position: its input token is the verified (bonus) token, which under sampling is any token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaglebatch.model.rotary import apply_rotary
from eaglebatch.speculative.eagle import EagleDraft


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, p] -> x[:, p - n] along dim 1 (zeros where p < n). x: [B, T, ...]."""
    if n == 0:
        return x
    out = torch.zeros_like(x)
    out[:, n:] = x[:, :-n]
    return out


def step_mask(labels: torch.Tensor, chain_ok: torch.Tensor | None, j: int) -> torch.Tensor:
    """bool [B, T-1]: positions where step j (1-based) is trained: a label, p >= j-1, and a chain
    of target-chosen tokens x_{q+1}, q = p-j+2 .. p, fed to steps 2..j."""
    sel = labels >= 0
    sel[:, : j - 1] = False
    if chain_ok is not None:
        for i in range(j - 1):  # x_{p-i+1} fed to step j-i
            sel &= _shift(chain_ok, i)
    return sel


@dataclass
class _Positions:
    """What every unroll step of one batch shares (t = T-1 positions p = 0..T-2)."""

    emb_n: torch.Tensor  # [B, t, h] input_layernorm(embedding of x_{p+1})
    cos: torch.Tensor  # [B * t, 1, D] rotary tables, every step's rows
    sin: torch.Tensor
    p_idx: torch.Tensor  # [t, 1] query position
    k_idx: torch.Tensor  # [1, t] key position
    key_ok: torch.Tensor  # bool [B, 1, t] real keys


def _positions(draft: EagleDraft, tokens: torch.Tensor, lengths: torch.Tensor) -> _Positions:
    """The embeddings, rotary tables and key masks of a batch (tokens int64 [B, T], lengths
    int64 [B])."""
    bsz, t_full = tokens.shape
    t = t_full - 1  # positions p = 0..T-2
    emb = draft.target.model.embed_tokens(tokens[:, 1:]).to(draft.dtype)  # [B, t, h] x_{p+1}
    emb_n = draft.midlayer.input_layernorm(emb)
    pos = torch.arange(t, device=tokens.device)
    cos, sin = draft.rotary_emb(pos, emb.dtype)  # [t, 1, D]
    cos, sin = cos.repeat(bsz, 1, 1), sin.repeat(bsz, 1, 1)  # [B * t, 1, D], every step's rows
    p_idx = pos[:, None]  # [t, 1] query position
    k_idx = pos[None, :]  # [1, t] key position
    key_ok = k_idx < (lengths[:, None, None] - 1)  # [B, 1, t] real keys
    return _Positions(emb_n, cos, sin, p_idx, k_idx, key_ok)


def ttt_forward(
    draft: EagleDraft,
    tokens: torch.Tensor,  # int64 [B, T] x_0..x_{T-1} (padding: any id)
    features: torch.Tensor,  # [B, T, n_aux * h] target hidden states at the aux layers
    lengths: torch.Tensor,  # int64 [B] real length of each row
    labels: torch.Tensor,  # int64 [B, T-1] draft-vocab id of the target's greedy token after
    #                           x_{p+1} (x_{p+2} in self-distilled text) at p, -100 = no loss
    unroll: int,
    chain_ok: torch.Tensor | None = None,  # bool [B, T-1] x_{p+1} is the target's greedy at p
    outputs: list[torch.Tensor] | None = None,
    hits: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Returns (loss, per-step CE [unroll], per-step top-1 accuracy [unroll]) over the positions
    of `step_mask`; appends each step's pre-norm draft output [B, T-1, h] to `outputs` when
    given (tests), and each step's bool [B, T-1] "top-1 right at a position of `step_mask`" to
    `hits` (evaluation). chain_ok None: every chain counts (self-distilled text)."""
    layer = draft.midlayer
    attn = layer.self_attn
    group = attn.num_heads // attn.num_kv_heads
    ctx = _positions(draft, tokens, lengths)
    hidden = draft.fc(features[:, :-1].to(draft.dtype))  # [B, t, h] step-1 input
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    losses, accs = [], []
    total = hidden.new_zeros(())
    out = hidden
    for j in range(1, unroll + 1):
        if j > 1:
            hidden = _shift(out, 1)  # out_{j-1}[p-1]
        q, k, v = _qkv(draft, ctx, hidden)
        ks.append(k)
        vs.append(v)
        if j == 1:  # step-1 keys serve every later step: expand to the query heads once
            k1 = ks[0].transpose(1, 2).repeat_interleave(group, dim=1)  # [B, Hq, t, D]
            v1 = vs[0].transpose(1, 2).repeat_interleave(group, dim=1)
        o = _attend(attn, ctx, q, k1, v1, ks, vs, j)  # [B, t, Hq * D]
        h = hidden + attn.o_proj(o)
        out = h + layer.mlp(layer.post_attention_layernorm(h))  # [B, t, h]
        if outputs is not None:
            outputs.append(out)
        ce, acc = _step_loss(draft, out, labels, chain_ok, j, hits)
        losses.append(ce.detach())
        accs.append(acc.detach())
        total = total + ce * (0.8 ** (j - 1))  # later steps weigh less (they matter less)
    return total, losses, accs


def _qkv(
    draft: EagleDraft, ctx: _Positions, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's queries [B, Hq, t, D] (rotated), keys [B, t, Hkv, D] (rotated) and values
    [B, t, Hkv, D] from its input hidden [B, t, h] and the tokens' embeddings."""
    layer = draft.midlayer
    attn = layer.self_attn
    bsz, t, _ = hidden.shape
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    x = torch.cat((ctx.emb_n, layer.hidden_norm(hidden)), dim=-1)  # [B, t, 2h]
    q = attn.q_proj(x).view(bsz, t, hq, d)
    k = attn.k_proj(x).view(bsz, t, hkv, d)
    v = attn.v_proj(x).view(bsz, t, hkv, d)
    q = apply_rotary(q.reshape(bsz * t, hq, d), ctx.cos, ctx.sin)
    k = apply_rotary(k.reshape(bsz * t, hkv, d), ctx.cos, ctx.sin)
    q = q.view(bsz, t, hq, d).transpose(1, 2)  # [B, Hq, t, D]
    k = k.view(bsz, t, hkv, d)
    return q, k, v


def _attend(
    attn,
    ctx: _Positions,
    q: torch.Tensor,  # [B, Hq, t, D]
    k1: torch.Tensor,  # [B, Hq, t, D] step-1 keys, expanded to the query heads
    v1: torch.Tensor,  # [B, Hq, t, D]
    ks: list[torch.Tensor],  # per step so far: keys [B, t, Hkv, D]
    vs: list[torch.Tensor],
    j: int,
) -> torch.Tensor:
    """Step j's attention output [B, t, Hq * D]: the step-1 keys at positions <= p-j+1 and the
    chain's own step-i keys at p-j+i, i = 2..j (module doc)."""
    bsz, hq, t, d = q.shape
    group = hq // ks[0].shape[2]
    # scores against the step-1 keys (the causal block, shifted by j-1) -> [B, Hq, t, t]
    scores = torch.matmul(q, k1.transpose(-1, -2)) * attn.scale  # [B, Hq, t, t]
    mask1 = (ctx.k_idx <= ctx.p_idx - (j - 1)) & ctx.key_ok  # [B, t, t]
    scores = scores.masked_fill(~mask1[:, None], float("-inf"))
    parts_s, parts_v = [scores], [v1]
    for i in range(2, j + 1):  # the chain's own keys: step i at position p-j+i
        ki = _shift(ks[i - 1], j - i).transpose(1, 2).repeat_interleave(group, dim=1)
        vi = _shift(vs[i - 1], j - i).transpose(1, 2).repeat_interleave(group, dim=1)
        s = (q * ki).sum(-1, keepdim=True) * attn.scale  # [B, Hq, t, 1]
        parts_s.append(s)
        parts_v.append(vi)
    all_s = torch.cat(parts_s, dim=-1)  # [B, Hq, t, t + j - 1]
    # rows with no visible key (p < j-1) are outside the loss; keep softmax finite there
    all_s = torch.nan_to_num(all_s, neginf=-1e30)
    w = torch.softmax(all_s.float(), dim=-1).to(q.dtype)
    o = torch.matmul(w[..., :t], v1)  # [B, Hq, t, D]
    for i, vi in enumerate(parts_v[1:]):
        o = o + w[..., t + i : t + i + 1] * vi
    return o.transpose(1, 2).reshape(bsz, t, hq * d)


def _step_loss(
    draft: EagleDraft,
    out: torch.Tensor,  # [B, t, h] step j's draft output
    labels: torch.Tensor,  # int64 [B, t]
    chain_ok: torch.Tensor | None,
    j: int,
    hits: list[torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, top-1 accuracy) of step j over its `step_mask` positions (zeros when it
    has none); appends its hits bool [B, t] when `hits` is given."""
    sel = step_mask(labels, chain_ok, j)
    # evaluation needs logits at every position [B, T-1, Vd]; training only at sel [N, Vd]
    full = draft.compute_logits(out) if hits is not None else None
    if full is not None:
        hits.append((full.argmax(-1) == labels) & sel)
    if bool(sel.any()):
        logits = full[sel] if full is not None else draft.compute_logits(out[sel])
        ce = F.cross_entropy(logits, labels[sel])
        acc = (logits.argmax(-1) == labels[sel]).float().mean()
    else:
        ce = acc = out.new_zeros(())
    return ce, acc
