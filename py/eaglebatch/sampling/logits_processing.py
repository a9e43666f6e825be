"""Per-row logits processing before sampling: `min_new_tokens`, structured output's token
masks, vLLM's three penalties and min-p.

Applied to the target's logits of a step, [B, Q, V] with Q = 1 (plain decoding, prefill) or
k + 1 (a verify round). Position j of row i is processed as plain decoding would process it
after the row's tokens plus drafts d_0..d_{j-1} (the ones verification must have accepted to
reach j): so greedy verification of processed logits equals plain greedy decoding, and
speculative sampling from them stays exact.

- min_new_tokens: the row's end ids (the plan's `end_ids`: EOS unless the row ignores it, and
  its stop_token_ids) are -inf while the row has generated fewer tokens (num_generated + j <
  min_tokens).
- structured output: a constrained row's disallowed tokens are -inf, by the packed mask the
  scheduler computed for that (row, position) (rust/src/run/structured.rs: bit t % 32 of
  u32 word t / 32 set = token t allowed); greedy rows stay an argmax over the masked logits.
- repetition_penalty r (1 = off), over every token in the prompt or the output: a positive
  logit is divided by r, a non-positive one multiplied by it;
- frequency_penalty f and presence_penalty p (0 = off), over output tokens only: logit -= f *
  count - p * (count > 0).
- min_p m (0 = off), sampled rows only: a token whose probability after temperature,
  softmax(logits / T), is below m times the most likely token's is -inf. The sampler divides
  by T afterwards and filters by top-k and top-p, so this is vLLM's order (temperature, min-p,
  top-k, top-p) and greedy rows are untouched.
In that order, on the raw logits (before temperature, top-k and top-p), as vLLM does.

A row (or verify position) left with no finite logit has no token to sample, whatever the
cause (a grammar that allows only its end below min_new_tokens, a failed grammar):
`without_dead_rows` gives the sampler a harmless stand-in there, and the step reports
`NO_TOKEN` for it, which the scheduler turns into that row's error row; the other rows of the
batch are generated as usual.

Sparse: only the tokens a row has seen (its penalty ids and drafts) are gathered, penalised and
scattered back, so the cost is O(B * Q * distinct tokens), not O(B * Q * V); min-p is dense
over the rows that ask for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from eaglebatch.sampling.sampler import deterministic_rows
from eaglebatch.transfer import to_device

# The token a step reports for a row with no allowed token (Scheduler.commit: an error row).
NO_TOKEN = -1


def without_dead_rows(
    processed: torch.Tensor,  # float [..., V] after LogitsControls.apply
) -> tuple[torch.Tensor, torch.Tensor]:  # (float [..., V], bool [...])
    """(`processed` with zeros where no logit is finite, which rows / positions those are): the
    sampler, verification and logprobs then never see an all -inf row (module doc). On the
    device, without a synchronisation."""
    dead = ~(processed > float("-inf")).any(dim=-1)
    return processed.masked_fill(dead[..., None], 0.0), dead


@dataclass(frozen=True)
class LogitsControls:
    """What a plan asks of its logits. Built by `from_plan`, None when it asks nothing."""

    ends: _EndMask | None  # rows below their min_tokens: their end ids
    grammar: GrammarMask | None  # constrained rows: their allowed tokens
    penalties: _Penalties | None
    min_p: _MinP | None

    @classmethod
    def from_plan(cls, plan, device, grammar: GrammarMask | None = None) -> LogitsControls | None:
        """`grammar`: a verify round's masks (`GrammarMask.of_drafts`); other plans carry
        their own (one position per constrained row)."""
        masking = bool((plan.min_tokens > plan.num_generated).any()) and len(plan.end_ids) > 0
        penalised = int(plan.cu_penalty[-1]) > 0
        min_p_rows = (plan.min_p > 0) & ~deterministic_rows(plan.temperature, plan.top_k)
        if grammar is None and plan.kind != "verify":
            grammar = GrammarMask.of_plan(plan, device)
        if not (masking or grammar is not None or penalised or min_p_rows.any()):
            return None

        def dev(a, dtype):
            return to_device(a, torch.device(device), dtype)

        return cls(
            ends=_EndMask.from_plan(plan, dev) if masking else None,
            grammar=grammar,
            penalties=_Penalties.from_plan(plan, dev) if penalised else None,
            min_p=_MinP.from_plan(plan, min_p_rows, dev) if min_p_rows.any() else None,
        )

    def apply(
        self,
        logits: torch.Tensor,  # float [B, Q, V] (not modified)
        drafts: torch.Tensor | None = None,  # int64 [B, Q-1]: the tokens before positions 1..
    ) -> torch.Tensor:  # float32 [B, Q, V]
        out = logits.float().clone()
        if self.ends is not None:
            self.ends.apply(out)
        if self.grammar is not None:
            self.grammar.apply(out)
        if self.penalties is not None:
            self.penalties.apply(out, drafts)
        if self.min_p is not None:
            self.min_p.apply(out)
        return out


@dataclass(frozen=True)
class _EndMask:
    """(row, end id) pairs of the rows below their min_tokens, and each row's counts."""

    rows: torch.Tensor  # int64 [E]
    ids: torch.Tensor  # int64 [E]
    min_tokens: torch.Tensor  # int64 [B]
    num_generated: torch.Tensor  # int64 [B]

    @classmethod
    def from_plan(cls, plan, dev) -> _EndMask:
        lens = np.diff(plan.cu_end_ids.astype(np.int64))
        return cls(
            rows=dev(np.repeat(np.arange(len(lens)), lens), np.int64),
            ids=dev(plan.end_ids, np.int64),
            min_tokens=dev(plan.min_tokens, np.int64),
            num_generated=dev(plan.num_generated, np.int64),
        )

    def apply(self, out: torch.Tensor) -> None:
        """-inf at each pair's id in `out` [B, Q, V] where position j is below min_tokens."""
        pos = torch.arange(out.shape[1], device=out.device)
        generated = self.num_generated[self.rows][:, None] + pos[None, :]  # [E, Q]
        masked = generated < self.min_tokens[self.rows][:, None]
        at = (self.rows[:, None], pos[None, :], self.ids[:, None])
        out[at] = torch.where(masked, float("-inf"), out[at])


@dataclass(frozen=True)
class GrammarMask:
    """Structured output: the constrained rows and their allowed tokens per position."""

    rows: torch.Tensor  # int64 [R] plan rows
    allowed: torch.Tensor  # bool [R, Q, W*32] (sliced to V when applied)

    @classmethod
    def of_plan(cls, plan, device) -> GrammarMask | None:
        """A prefill or decode plan's masks: one position per constrained row that samples."""
        rows = np.flatnonzero(plan.mask_rows >= 0)
        if len(rows) == 0:
            return None
        packed = plan.token_masks[plan.mask_rows[rows]][:, None, :]  # [R, 1, W]
        return cls._of(rows, packed, device)

    @classmethod
    def of_drafts(cls, rows: np.ndarray, masks: np.ndarray, device) -> GrammarMask | None:
        """A verify round's masks from `Scheduler.draft_masks`: rows [R], masks [R, k+1, W]."""
        if len(rows) == 0:
            return None
        return cls._of(rows, masks, device)

    @classmethod
    def _of(cls, rows: np.ndarray, packed: np.ndarray, device) -> GrammarMask:
        # little-endian u32 words as bytes, little bit order: bit t of the row is token t
        bits = np.unpackbits(np.ascontiguousarray(packed).view(np.uint8), axis=-1,
                             bitorder="little")  # fmt: skip
        dev = torch.device(device)
        return cls(
            rows=to_device(rows, dev, np.int64),
            allowed=to_device(bits.view(np.bool_), dev, np.bool_),
        )

    def apply(self, out: torch.Tensor) -> None:
        """-inf in `out` [B, Q, V] at the constrained rows' disallowed tokens."""
        v = out.shape[-1]
        allowed = self.allowed[:, : out.shape[1], :v]  # [R, Q, V]
        out[self.rows] = out[self.rows].masked_fill(~allowed, float("-inf"))


@dataclass(frozen=True)
class _MinP:
    """The min-p rows: their indices, min_p and temperature."""

    rows: torch.Tensor  # int64 [R]
    min_p: torch.Tensor  # float32 [R, 1, 1]
    temperature: torch.Tensor  # float32 [R, 1, 1], > 0

    @classmethod
    def from_plan(cls, plan, rows: np.ndarray, dev) -> _MinP:
        index = np.flatnonzero(rows)
        return cls(
            rows=dev(index, np.int64),
            min_p=dev(plan.min_p[index], np.float32)[:, None, None],
            temperature=dev(plan.temperature[index], np.float32)[:, None, None],
        )

    def apply(self, out: torch.Tensor) -> None:
        """-inf where softmax(logits / T) < min_p * its maximum, per row and position."""
        x = out[self.rows]  # [R, Q, V]
        probs = torch.softmax(x / self.temperature, dim=-1)
        cut = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
        out[self.rows] = x.masked_fill(cut, float("-inf"))


@dataclass(frozen=True)
class _Penalties:
    """The penalised rows' seen tokens as (row, token) pairs with their prompt flag and output
    count, and each row's three penalty values."""

    rows: torch.Tensor  # int64 [U]
    token_ids: torch.Tensor  # int64 [U]
    in_prompt: torch.Tensor  # bool [U]
    output_count: torch.Tensor  # float32 [U]
    repetition: torch.Tensor  # float32 [B]
    frequency: torch.Tensor  # float32 [B]
    presence: torch.Tensor  # float32 [B]
    vocab_keys: int  # keys are row * vocab_keys + token

    @classmethod
    def from_plan(cls, plan, dev) -> _Penalties:
        cu = plan.cu_penalty.astype(np.int64)
        ids = plan.penalty_ids.astype(np.int64)
        lens = np.diff(cu)
        row = np.repeat(np.arange(len(lens)), lens)  # [N] row of each penalty id
        index = np.arange(len(ids)) - np.repeat(cu[:-1], lens)  # [N] position in the row
        prompt = index < np.repeat(plan.penalty_prompt_lens.astype(np.int64), lens)
        keys_v = int(ids.max()) + 1 if len(ids) else 1
        return cls(
            *_seen(row, ids, prompt, keys_v, dev),
            repetition=dev(plan.repetition_penalty, np.float32),
            frequency=dev(plan.frequency_penalty, np.float32),
            presence=dev(plan.presence_penalty, np.float32),
            vocab_keys=keys_v,
        )

    def apply(self, out: torch.Tensor, drafts: torch.Tensor | None) -> None:
        """Penalises `out` [B, Q, V] in place (module doc)."""
        q, vocab = out.shape[1:]
        drafted = drafts is not None and drafts.shape[1] > 0
        if drafted:
            rows, tokens, in_prompt, count = self._with_drafts(drafts, vocab)
        else:
            rows, tokens, in_prompt, count = (
                self.rows, self.token_ids, self.in_prompt, self.output_count)
        count = count[:, None].expand(-1, q).clone()  # [U, Q]
        if drafted:
            # drafts d_0..d_{j-1} precede position j: + #{m < j : d_m == token}
            same = (drafts[rows] == tokens[:, None]).float()  # [U, Q-1]
            count[:, 1:] += same.cumsum(dim=1)
        pos = torch.arange(q, device=out.device)
        x = out[rows[:, None], pos[None, :], tokens[:, None]]  # [U, Q]
        rep = self.repetition[rows][:, None]  # [U, 1]
        seen = in_prompt[:, None] | (count > 0)  # [U, Q]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - self.frequency[rows][:, None] * count
        x = x - self.presence[rows][:, None] * (count > 0).float()
        out[rows[:, None], pos[None, :], tokens[:, None]] = x

    def _with_drafts(self, drafts: torch.Tensor, vocab: int):
        """The (row, token) pairs with the drafts' tokens added (prompt flag False, count 0
        where they were not seen before): the pairs position j > 0 may penalise."""
        b, k = drafts.shape
        kv = max(self.vocab_keys, vocab)
        keys = self.rows * kv + self.token_ids  # [U] sorted, unique
        draft_rows = torch.arange(b, device=drafts.device).repeat_interleave(k)
        draft_keys = torch.unique(draft_rows * kv + drafts.reshape(-1))  # [D]
        penalised = self.repetition[draft_keys // kv] != 1
        penalised |= self.frequency[draft_keys // kv] != 0
        penalised |= self.presence[draft_keys // kv] != 0
        draft_keys = draft_keys[penalised]
        new = draft_keys[~torch.isin(draft_keys, keys)]
        all_keys = torch.cat((keys, new))
        n_new = len(new)
        zeros_b = torch.zeros(n_new, dtype=torch.bool, device=keys.device)
        zeros_f = torch.zeros(n_new, dtype=torch.float32, device=keys.device)
        return (
            all_keys // kv,
            all_keys % kv,
            torch.cat((self.in_prompt, zeros_b)),
            torch.cat((self.output_count, zeros_f)),
        )


def _seen(row, ids, prompt, keys_v: int, dev):
    """(rows, token ids, in_prompt, output count) of each distinct (row, token), sorted."""
    keys = row * keys_v + ids  # [N]
    uniq, inverse = np.unique(keys, return_inverse=True)  # [U]
    count = np.bincount(inverse, weights=~prompt, minlength=len(uniq)).astype(np.float32)
    in_prompt = np.bincount(inverse, weights=prompt, minlength=len(uniq)) > 0
    return (
        dev(uniq // keys_v, np.int64),
        dev(uniq % keys_v, np.int64),
        dev(in_prompt, np.bool_),
        dev(count, np.float32),
    )
