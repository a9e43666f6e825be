"""`SpecWorker`: EAGLE speculative decoding (chain drafts, topk == 1) on top of the plain Worker.

Plans (see _native.pyi and the speculative plan contract):
  * "prefill": row i is a sequence x_0..x_{n-1} from position c (c > 0: positions 0..c-1 are
    in both caches: found by prefix caching, forked from a sibling sample or computed by earlier
    chunks; the scheduler only reuses a block whose draft K/V is valid for the new row, see
    scheduler.rs), or a chunk of it that stops before n (chunked prefill: the plan's
    next_ids gives the token after the chunk, and the sampled token is dropped). The target
    runs it (capturing what the draft reads), samples x_n, then the draft EXTENDS over the
    query: draft input at p = (f_p, x_{p+1}) for p = c..n-1, writing draft K/V at c..n-1.
  * "verify": row i has L committed tokens (target K/V valid for 0..L-2) and a query of W+1
    tokens at positions L-1..L-1+W: x_{L-1} then W placeholders (W = max_draft_tokens: K,
    the head's longest chain, or more with prompt lookup). A round of width k <= W runs five
    phases over one `_Round`:
      1. draft: d_1 = argmax head(h^d_{L-2}) (slot state), then for j = 1..k-1 one draft step
         at p = L-2+j with input (h^d_{p-1}, d_j) -> h^d_p, d_{j+1} (writes draft K/V at p);
      2. verify: the target over [x_{L-1}, d_1..d_k] at positions L-1..L-1+k;
      3. accept: verify.py accepts a <= k drafts and adds one target token;
      4. extend: the draft over positions L-1..L-1+k with (target feature at p, x_{p+1}),
         overwriting what drafting wrote. Only rows p <= L-1+a are meaningful; later rows
         write draft K/V that is stale but never read before it is rewritten (a query at
         position q only attends to positions <= q, and every round rewrites its positions
         before reading them), so the round needs no host synchronisation before 5;
      5. record: the round's one device-to-host copy, then stats, lookup histories, policies.
  * "decode": plain steps, which the scheduler plans while the worker asks for them
    (`plain_steps`: where drafting cannot pay at the batch size, module doc below; with chunked
    prefill they also carry prompt chunks, as plain decoding's do). The target Worker runs them;
    every row in one leaves the head (stale), and prompt lookup's histories follow.
  * prompt lookup (speculative/ngram.py; README, Speculative decoding): a row whose latest
    tokens recur earlier in its sequence takes the k tokens that followed there as its drafts.
    When every row has K of them the head does not run, and the round may be up to
    `lookup_tokens` (>= K) wide, its width chosen by a second adaptive policy; row i drafts
    n_i = min(its proposal, k) and is padded after them (verify.py never accepts padding).
    Without the adaptive policy a row's n_i depends only on its own sequence, so sampled
    output does not depend on the batch.
  * deferred extends (adaptive policy, eager steps; README): a round of k = 0 keeps each row's
    extend input (its new token, the target's captured states) for up to MAX_DEFERRED rounds
    (slots.py), and the next round with k > 0 first extends the draft over all of them in one
    forward. A row with more deferred rounds becomes "stale": it leaves the head for good
    (drafts by prompt lookup or not at all), and the policy counts only the rows that can still
    draft.
    Where drafting cannot pay at the batch size new rows join whatever the acceptance (the
    policy measured a round of k = 1 at twice the cost of k = 0: a CPU at large batches), they
    start stale: their prefill neither captures the target's states nor runs the head, and a
    round whose rows are all stale is a plain target step. There the worker also asks the
    scheduler for plain steps (`plain_steps`, eager steps only), so that prompts are computed in
    chunks riding in decode steps instead of steps of their own; rows drafting by lookup give way
    too (a k = 1 round at twice a plain step's cost leaves a draft little room to pay).
Invariant between steps, per running slot s that is not stale (speculative/slots.py names the
slot states and their transitions): the draft's K/V is valid for positions 0..L-2-d (like the
target's, less the d = deferred[s] deferred positions) and hidden[s] = h^d_{L-2-d}, the draft
output at the last extended position. A round's values are speculative/round.py's, one per phase.
K/V slots are the plan's: the draft's K/V of position p sits at the target's slot of p.

Output per plan row: accepted drafts then the target's token (1..k+1 tokens), num_accepted.
With `enable_graphs`, phases 1, 2 and 4 run as captured steps per padded batch size
(speculative/graphs.py), graph or eager chosen once per round; prefill, and batches above the
largest bucket, stay eager.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from eaglebatch.attention.base import AttentionMetadata, copy_blocks
from eaglebatch.cpu import accelerate, gemm_threads
from eaglebatch.job.config import SpeculativeConfig, widest_round
from eaglebatch.sampling.logits_processing import (
    NO_TOKEN,
    GrammarMask,
    LogitsControls,
    without_dead_rows,
)
from eaglebatch.sampling.logprobs import distribution, prompt_logprobs, top_logprobs, wanted
from eaglebatch.speculative.adaptive import AdaptiveDraftLength
from eaglebatch.speculative.eagle import EagleDraft, load_draft
from eaglebatch.speculative.grammar_drafts import GrammarDrafts
from eaglebatch.speculative.graphs import SpecGraphs
from eaglebatch.speculative.ngram import NgramLookup
from eaglebatch.speculative.round import (
    Accepted,
    Marks,
    Round,
    RoundShape,
    Verified,
)
from eaglebatch.speculative.slots import SlotStates
from eaglebatch.speculative.verify import deterministic_rows, verify, verify_greedy_host
from eaglebatch.transfer import to_device
from eaglebatch.worker import (
    Worker,
    check_graph_support,
    plan_metadata,
    sample_rows,
    sampling_tensors,
)

TREE_UNSUPPORTED = "speculative.topk > 1 (tree drafting) is not supported yet"


@dataclass
class SpecStats:
    prefill_steps: int = 0
    verify_rounds: int = 0  # target verify forwards
    draft_steps: int = 0  # autoregressive draft forwards (excluding extends)
    drafted: int = 0  # draft tokens proposed (rows x k), by the head or by prompt lookup
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens returned by verify rounds
    lookup_rows: int = 0  # rows of rounds whose drafts came from prompt lookup
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    deferred_extends: int = 0  # rows of k = 0 rounds whose draft extend was deferred
    stale_rows: int = 0  # sequences dropped from the head (deferred too long, or plain steps)
    plain_prefills: int = 0  # sequences prefilled without the head (stale from the start)
    plain_steps: int = 0  # "decode" plans run as plain target steps
    # structured output: drafts the grammar forced, how many were accepted, and drafts cut
    # because the grammar refused them (or a draft before them)
    forced_drafted: int = 0
    forced_accepted: int = 0
    grammar_cut: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Clock:
    """Wall-clock marks; CUDA events on GPU so that timing adds no synchronisation (the marks
    are read after the step's final device-to-host copy)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


class SpecWorker:
    def __init__(
        self,
        target: Worker,
        draft: EagleDraft,
        *,
        num_steps: int,
        max_batch_size: int,
        adaptive: bool = True,
        topk: int = 1,
        draft_kv_cache: torch.Tensor | None = None,
        prompt_lookup: tuple[int, int] | None = None,
        lookup_tokens: int | None = None,
        forced_tokens: int | None = None,
    ) -> None:
        """Shares the target Worker's model, KV caches and budget; allocates the draft's one-layer
        cache over the same blocks unless given. adaptive=False drafts K tokens every round.
        prompt_lookup: (min_n, max_n) n-gram sizes of prompt-lookup drafts, None = off.
        lookup_tokens: the most tokens a row drafts by lookup in a round without the head
        (default and minimum K). forced_tokens: how wide a round of a grammar's forced drafts may
        be (structured output; None: no forced drafts). Plans then carry `max_draft_tokens`
        placeholders per row."""
        if topk > 1:
            raise ValueError(TREE_UNSUPPORTED)
        if topk < 1 or num_steps < 1:
            raise ValueError("speculative: topk and num_steps must be >= 1")
        # K: the head's longest chain; max_draft_tokens: the widest round (lookup rounds)
        self.max_draft_tokens = widest_round(
            num_steps, lookup_tokens if prompt_lookup else None, forced_tokens
        )
        self.target = target
        self.logprobs_mode = target.logprobs_mode  # sample_rows
        self.model = target.model
        self.kv_caches = target.kv_caches
        self.budget = target.budget
        self.device = target.device
        self.max_model_len = target.max_model_len
        self.num_steps = num_steps
        self.draft = draft
        self._bind_draft_cache(draft_kv_cache)
        # verify queries reach position max_model_len - 1 + max_draft_tokens
        most = self.max_model_len + self.max_draft_tokens
        self._fit_rotary(most)
        self.slots = SlotStates(max_batch_size, draft.config.hidden_size, draft.dtype, self.device)
        # rows of the last verify round: about the batch new rows join (as many finished)
        self.running_rows = 0
        self._init_policies(max_batch_size, adaptive, prompt_lookup, most)
        self.stats = SpecStats()
        self._clock = _Clock(self.device)
        self.graphs: SpecGraphs | None = None  # enable_graphs
        self._verify_states = None  # a hybrid model's verify context (`_target_eager`)
        # structured output: the grammar hook (the scheduler's masks, bound by `bind`)
        self.grammar = GrammarDrafts(forced_tokens is not None, self.device)

    def _bind_draft_cache(self, draft_kv_cache: torch.Tensor | None) -> None:
        """The draft's own cache (given, or allocated over the target's blocks + the pad block
        of graph steps); the assistant drafter has none and reads the target's caches."""
        draft = self.draft
        self.draft_kv = (
            draft_kv_cache
            if draft_kv_cache is not None
            else draft.allocate_kv_cache(self.budget.num_blocks + 1, self.budget.block_size)
        )
        self._draft_caches = [] if self.draft_kv is None else [self.draft_kv]
        if getattr(draft, "fixed_position", False):
            draft.kv_caches = self.kv_caches

    def _fit_rotary(self, most: int) -> None:
        """Grows the target's and the draft's rotary tables to `most` positions if shorter."""
        for rotary in (*self.model.rotaries(), *self.draft.rotaries()):
            if rotary.max_positions < most:
                rotary.max_positions = most
                rotary.rebuild()

    def _init_policies(
        self,
        max_batch_size: int,
        adaptive: bool,
        prompt_lookup: tuple[int, int] | None,
        most: int,
    ) -> None:
        """The head's adaptive policy, prompt lookup (histories of `most` + 1 tokens a slot) and
        the policy that sets the width of rounds where every row drafts by lookup."""
        self.policy = AdaptiveDraftLength(self.num_steps) if adaptive else None
        self.lookup = None
        self.lookup_policy = None
        if prompt_lookup is not None:
            self.lookup = NgramLookup(max_batch_size, most + 1, *prompt_lookup)
            if adaptive:
                self.lookup_policy = AdaptiveDraftLength(self.max_draft_tokens)

    def enable_graphs(self, mode: str, max_batch_size: int) -> None:
        """Captures the draft loop, verify and draft-extend per padded batch size and draft
        length (speculative/graphs.py). mode: "cuda", "eager" (CPU tests) or "off"."""
        check_graph_support(self.target, mode)
        if mode == "off" or getattr(self.draft, "fixed_position", False):
            return  # the assistant drafter's rounds stay eager (speculative/assistant.py)
        if self.model.states is not None:
            return  # a hybrid model's rounds stay eager (engine_settings.resolve_graph_mode)
        if not self.draft.backend.supports_cuda_graphs or self.draft_kv.shape[1] <= self.num_blocks:
            raise ValueError("the draft's backend or KV cache cannot run graph steps")
        self.graphs = SpecGraphs(self, mode, max_batch_size)
        self.graphs.stats.reserved_bytes = self.target.graph_reserve_bytes

    def graph_stats(self) -> dict | None:
        return None if self.graphs is None else self.graphs.stats.as_dict()

    def bind(self, scheduler) -> None:
        """Rounds draft under the scheduler's grammars and validate against them (Worker.bind)."""
        self.grammar.bind(scheduler)

    def draft_stats(self) -> dict:
        return self.stats.as_dict()

    @classmethod
    def from_job(
        cls,
        target: Worker,
        draft_path: str | os.PathLike[str],
        spec: SpeculativeConfig,
        max_batch_size: int,
        forced_tokens: int | None = None,
    ) -> SpecWorker:
        """The job's `speculative` section over `target` (the engine and bench build it so);
        forced_tokens: the job's `forced_draft_tokens`."""
        return cls.from_target(
            target,
            draft_path,
            num_steps=spec.num_steps,
            max_batch_size=max_batch_size,
            topk=spec.topk,
            adaptive=spec.adaptive,
            prompt_lookup=spec.prompt_lookup,
            lookup_tokens=spec.prompt_lookup_tokens,
            forced_tokens=forced_tokens,
        )

    @classmethod
    def from_target(
        cls,
        target: Worker,
        draft_path: str | os.PathLike[str],
        *,
        num_steps: int,
        max_batch_size: int,
        topk: int = 1,
        adaptive: bool = True,
        prompt_lookup: tuple[int, int] | None = None,
        lookup_tokens: int | None = None,
        forced_tokens: int | None = None,
    ) -> SpecWorker:
        if topk > 1:
            raise ValueError(TREE_UNSUPPORTED)
        draft = load_draft(
            draft_path,
            target.model.config,
            target.model,
            max_positions=target.max_model_len
            + widest_round(num_steps, lookup_tokens if prompt_lookup else None, forced_tokens),
        )
        # as the target runs; a head shipped in bf16 is read from exact bf16 copies (same bits),
        # and the head's norms of few CPU rows are one native call each
        if isinstance(draft, EagleDraft):
            accelerate(draft, gemm_threads(target.model), bf16_weights=True, native_norms=True)
        return cls(
            target,
            draft,
            num_steps=num_steps,
            max_batch_size=max_batch_size,
            adaptive=adaptive,
            topk=topk,
            prompt_lookup=prompt_lookup,
            lookup_tokens=lookup_tokens,
            forced_tokens=forced_tokens,
        )

    @property
    def num_blocks(self) -> int:
        return self.budget.num_blocks

    @torch.inference_mode()
    def step(self, plan) -> tuple:
        """(tokens int32 [N], num_tokens int32 [B], num_accepted int32 [B]) in plan row order,
        and the tokens' logprobs after them when a row asks for them (`Scheduler.commit`)."""
        if plan.kind == "decode":  # the target Worker's step copies its own blocks
            if self._draft_caches:
                copy_blocks(self._draft_caches, plan.block_copies)
            return self._plain_step(plan)
        copy_blocks([*self.kv_caches, *self._draft_caches], plan.block_copies)  # forked samples
        if plan.kind == "prefill":
            self.target.prepare_states(plan)  # a hybrid model's recurrent states
            return self._prefill(plan)
        if plan.kind == "verify":
            return self._verify(plan)
        raise ValueError(f"unknown plan kind {plan.kind!r}")

    @property
    def plain_steps(self) -> bool:
        """Whether the scheduler should plan plain decode steps instead of verify rounds
        (`Scheduler.set_plain_steps`): where drafting cannot pay at the running batch size
        (module doc), eager steps only."""
        return (self.policy is not None and self.graphs is None
                and self.policy.drafting_cannot_pay(self.running_rows))  # fmt: skip

    # ---- helpers -------------------------------------------------------------------------------

    def _dev(self, a: np.ndarray, dtype=np.int64) -> torch.Tensor:
        return to_device(a, self.device, dtype)

    def _sampling(self, plan) -> tuple[torch.Tensor, ...]:
        """temperature, top_p, top_k, seeds, num_generated as device tensors."""
        return sampling_tensors(plan, self.device)

    def _meta(self, cu, seq_lens, block_tables, slot_mapping) -> AttentionMetadata:
        """Metadata for a query the plan did not spell out (draft steps, shorter verifies): the
        plan's device block tables [B, M] reused, host-side lengths (no synchronisation)."""
        return AttentionMetadata.from_numpy(
            cu, seq_lens, block_tables, slot_mapping, self.budget.block_size, self.device
        )

    def _draft_forward(self, ids, features, positions, meta, select=None) -> torch.Tensor:
        """The draft over `meta`'s query (a copy is prepared for the draft's own backend)."""
        dmeta = dataclasses.replace(meta, backend_state=None)
        self.draft.backend.prepare(dmeta)
        return self.draft(ids, features, positions, dmeta, self.draft_kv, select=select)

    # ---- prefill -------------------------------------------------------------------------------

    def _prefill(self, plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        meta = plan_metadata(plan, self.budget.block_size, self.device)
        self.model.backend.prepare(meta)
        ids = self._dev(plan.input_ids)  # [T]
        positions = self._dev(plan.positions)  # [T]
        head = self._head_prefills(plan)
        layers = self.draft.capture_layers if head else ()
        out = self.model(ids, positions, meta, self.kv_caches, capture_layers=layers)
        hidden, captured = out if head else (out, None)  # [T, H]
        last = self._dev(plan.cu_seqlens_q[1:].astype(np.int64) - 1)  # [B]
        logits = self.model.compute_logits(hidden.index_select(0, last))  # [B, V]
        tokens, logprobs = sample_rows(self, plan, logits, self._sampling(plan))  # [B]
        prompt_lps = prompt_logprobs(self.model.compute_logits, hidden, plan)
        if head:
            # draft extend over p = c..n-1: token x_{p+1} is the next prompt token, or the new
            # one (a chunk that stops before the row's end: the plan's next token, the new one
            # dropped)
            next_ids = torch.roll(ids, -1)
            after = self._dev(plan.next_ids)  # [B] -1: the sampled token follows
            next_ids[last] = torch.where(after >= 0, after, tokens.clamp(min=0))  # NO_TOKEN
            h = self._draft_forward(
                next_ids, self.draft.target_features(captured), positions, meta, select=last
            )  # [B, h]
            self.slots.set_hidden(self._dev(plan.request_slots), h)
        self.slots.prefilled(plan.request_slots, plan.next_ids >= 0)
        self.stats.prefill_steps += 1
        out = tokens.to(torch.int32).cpu().numpy()
        n = len(out)
        if self.lookup is not None:
            cu, cp = plan.cu_seqlens_q, plan.cu_prefix
            for i in np.flatnonzero(plan.next_ids < 0):  # rows whose prompt is now complete
                slot = plan.request_slots[i]
                prefix = plan.prefix_ids[cp[i] : cp[i + 1]]  # cached, before the query
                seq = np.concatenate((prefix, plan.input_ids[cu[i] : cu[i + 1]], out[i : i + 1]))
                self.lookup.reset(int(slot), seq)
        result = out, np.ones(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
        if logprobs is None and prompt_lps is None:
            return result
        return (*result, logprobs, prompt_lps)

    def _head_prefills(self, plan) -> bool:
        """Whether the head runs over this prefill: when it follows any of its rows. A row
        whose prompt starts here follows it unless drafting cannot pay at the batch size it
        joins (module doc): then it starts stale, and a prefill of such rows only neither
        captures the target's states nor runs the head."""
        slots = plan.request_slots
        starting = self.slots.starting(slots)
        if len(starting):
            plain = (self.policy is not None and self.graphs is None
                     and self.policy.drafting_cannot_pay(max(self.running_rows, plan.num_seqs)))
            self.slots.start(starting, plain)
            self.stats.plain_prefills += len(starting) if plain else 0
        return bool(self.slots.drafting(slots).any())

    # ---- plain steps (module doc) --------------------------------------------------------------

    def _plain_step(self, plan) -> tuple:
        """A "decode" plan by the target Worker: rows decoding (one token) and, with chunked
        prefill, rows computing prompt chunks. Every row leaves the head (stale); those whose
        prompt starts here count as plain prefills."""
        slots = plan.request_slots
        cu = plan.cu_seqlens_q
        mid_prompt = self.slots.prefilling[slots]  # [B] (a copy)
        # a row whose prompt starts here: not mid-prompt, and its query follows its cached prefix
        starting = ~mid_prompt & (plan.positions[cu[:-1]] == np.diff(plan.cu_prefix))
        self.stats.plain_prefills += int(starting.sum())
        self.stats.stale_rows += int((~starting & self.slots.drafting(slots)).sum())
        self.stats.plain_steps += 1
        self.slots.to_plain(slots, plan.next_ids >= 0)
        self.running_rows = plan.num_seqs  # every running row
        result = self.target.step(plan)
        if self.lookup is not None:
            self._plain_lookup(plan, starting | mid_prompt, result[0])
        return result

    def _plain_lookup(self, plan, prompt: np.ndarray, tokens: np.ndarray) -> None:
        """Prompt lookup's histories after a plain step: a decoding row appends its token, a
        row whose prompt is now complete (prompt [B]: its query is prompt tokens) starts over
        from its whole sequence."""
        cu, cp = plan.cu_seqlens_q, plan.cu_prefix
        for i, slot in enumerate(plan.request_slots.tolist()):
            if not prompt[i]:
                self.lookup.extend(slot, tokens[i : i + 1])
            elif plan.next_ids[i] < 0:
                prefix = plan.prefix_ids[cp[i] : cp[i + 1]]  # cached, before the query
                seq = np.concatenate((prefix, plan.input_ids[cu[i] : cu[i + 1]], tokens[i : i + 1]))
                self.lookup.reset(slot, seq)

    # ---- deferred draft extends (module doc) ---------------------------------------------------

    def _defer(
        self, request_slots: np.ndarray, tokens: torch.Tensor, captured: dict[int, torch.Tensor]
    ) -> None:
        """Keeps a k = 0 round's draft-extend input per row (SlotStates.defer)."""
        kept, stale = self.slots.defer(request_slots, tokens, captured)
        self.stats.stale_rows += stale
        self.stats.deferred_extends += kept

    def _catch_up(self, plan, start: np.ndarray, block_tables: torch.Tensor) -> None:
        """The deferred draft extends of the plan's rows (row i: positions start[i] - d_i ..
        start[i] - 1, d_i = deferred[slot]) as one draft forward; restores the invariant."""
        request_slots = plan.request_slots
        rows = self.slots.waiting(request_slots)
        if len(rows) == 0:
            return
        d = self.slots.deferred[request_slots[rows]]  # [R]
        cu = np.concatenate(([0], np.cumsum(d)))  # [R+1]
        index = np.concatenate([np.arange(x) for x in d])  # [T] deferral index of each query
        row_of = np.repeat(rows, d)  # [T] plan row of each query
        positions = start[row_of] - d.repeat(d) + index  # [T]
        bs = self.budget.block_size
        slot_mapping = plan.block_tables[row_of, positions // bs].astype(np.int64) * bs + (
            positions % bs
        )
        at = (self._dev(request_slots[row_of]), self._dev(index))
        captured = {layer: t[at] for layer, t in self.slots.deferred_states.items()}
        meta = self._meta(cu, start[rows], block_tables[self._dev(rows)], slot_mapping)
        h = self._draft_forward(
            self.slots.deferred_ids[at],
            self.draft.target_features(captured),
            self._dev(positions),
            meta,
            select=self._dev(cu[1:] - 1),
        )  # [R, h] h^d at start - 1
        self.slots.caught_up(request_slots[rows], self._dev(request_slots[rows]), h)

    # ---- verify round --------------------------------------------------------------------------

    def _proposals(self, request_slots: np.ndarray, k_plan: int) -> list[np.ndarray] | None:
        """Each row's prompt-lookup proposal (up to k_plan tokens, maybe none); None when off."""
        if self.lookup is None or k_plan == 0:
            return None
        return [self.lookup.propose(int(slot), k_plan) for slot in request_slots]

    def _round_shape(self, request_slots: np.ndarray, k_plan: int) -> RoundShape:
        """The shape of a round (module doc): its width k, the head's chain length, each
        row's own number of drafts and whether it drafts by lookup (round.py)."""
        b = len(request_slots)
        K = min(self.num_steps, k_plan)
        # proposals of K tokens (the head's width), and of k_plan where a row may draft more
        # (the occurrence propose() picks depends on how many following tokens are asked for)
        proposals = self._proposals(request_slots, K) or [np.zeros(0, np.int32)] * b
        lens = np.array([len(p) for p in proposals], dtype=np.int64)  # [B]
        if K > 0 and self.lookup is not None and bool((lens >= K).all()):
            return self._lookup_round_shape(request_slots, k_plan, K, proposals, lens)
        if self.policy is None:
            k = K
        else:
            # rows that left the head (stale) draft only by lookup; the rest may draft
            drafting = int((~self.slots.stale[request_slots] | (lens > 0)).sum())
            k = min(K, self.policy.choose(b, drafting=drafting))
        by_lookup = (lens >= k) & (k > 0)
        n = np.full(b, k, dtype=np.int64)
        if self.policy is None and k_plan > K:  # a row's n depends on its own sequence only
            for i in np.flatnonzero(by_lookup):
                proposals[i] = self.lookup.propose(int(request_slots[i]), k_plan)
                n[i] = len(proposals[i])
        # stale rows (module doc; only with the policy) never draft by the head
        stale = self.slots.stale[request_slots]  # [B]
        head_rows = ~by_lookup & ~stale
        n[~by_lookup & stale] = 0
        k_head = k if head_rows.any() else 0
        return RoundShape(int(n.max(initial=0)), k_head, n, by_lookup, proposals, False)

    def _lookup_round_shape(
        self, request_slots: np.ndarray, k_plan: int, K: int, proposals: list[np.ndarray],
        lens: np.ndarray,
    ) -> RoundShape:  # fmt: skip
        """A round where every row has K lookup drafts (lens [B] >= K): the head does not run,
        rows may draft up to k_plan copied tokens, the lookup policy sets the width."""
        if k_plan > K:
            proposals = self._proposals(request_slots, k_plan)
            lens = np.array([len(p) for p in proposals], dtype=np.int64)  # still >= K
        policy = self.lookup_policy
        k = k_plan if policy is None else min(k_plan, policy.choose(len(request_slots)))
        n = np.minimum(lens, k)
        return RoundShape(int(n.max()), 0, n, n > 0, proposals, True)

    def _check_verify_plan(self, plan) -> tuple[np.ndarray, int]:
        """(cu_seqlens_q int64 [B+1], W the plan's placeholders per row) of a verify or decode
        plan; a ValueError or RuntimeError for a plan this worker cannot run."""
        cu = plan.cu_seqlens_q.astype(np.int64)
        q_lens = cu[1:] - cu[:-1]
        k_plan = int(q_lens[0]) - 1
        if (q_lens != q_lens[0]).any() or not 0 <= k_plan <= self.max_draft_tokens:
            raise ValueError(
                f"verify plan: every row needs the same query length in 1.."
                f"{self.max_draft_tokens + 1}, got {sorted(set(q_lens.tolist()))}"
            )
        bad = plan.request_slots[~self.slots.ready[plan.request_slots]]  # never prefilled
        if len(bad):
            raise RuntimeError(
                f"verify plan uses request slots {bad.tolist()} that were never prefilled"
            )
        return cu, k_plan

    def _begin_round(self, plan) -> Round:
        """The round over `plan`: its shape, the plan's arrays its phases read, the lookup rows'
        drafts, its graph bucket and whether its extend is deferred (module doc)."""
        cu, k_plan = self._check_verify_plan(plan)
        b = plan.num_seqs
        stale = self.slots.stale[plan.request_slots]  # [B] rows the head no longer serves
        shape = self._round_shape(plan.request_slots, k_plan)
        # the grammar hook only where a row is constrained (its calls stay off other rounds)
        constrained = bool((plan.mask_rows >= 0).any())
        forced_ids = forced_lens = None
        if constrained:
            shape, forced_ids, forced_lens = self.grammar.forced(plan, shape, k_plan,
                                                                 self.graphs is not None)
        self.running_rows = b
        lookup_ids = np.zeros((b, shape.k), dtype=np.int64)  # padding (0) after each row's n
        for i in np.flatnonzero(shape.by_lookup):
            proposal = shape.proposals[i][: shape.n[i]]  # forced drafts may have raised n
            lookup_ids[i, : len(proposal)] = proposal
        bp = None if self.graphs is None else self.graphs.bucket(b)
        return Round(
            shape.k, shape.k_head, shape.n, shape.by_lookup, shape.lookup_round, plan, b, cu,
            stale,
            head_rows=not bool(stale.all()),
            lookup_ids=lookup_ids,
            head_drafts=shape.k_head > 0 and not shape.by_lookup.all(),
            start=plan.positions[cu[:-1]].astype(np.int64),  # [B] L-1
            kv_slots=plan.slot_mapping.reshape(b, k_plan + 1),  # [B, W+1] of L-1..L-1+W
            block_tables=self._dev(plan.block_tables, np.int32),
            request_slots=self._dev(plan.request_slots),
            per_row=np.arange(b + 1, dtype=np.int64),
            bp=bp,
            # a round of k = 0 chosen by the policy defers its draft extend; any other first
            # extends the draft over what earlier rounds deferred (module doc)
            defer=shape.k == 0 and self.policy is not None and bp is None,
            forced_ids=forced_ids,
            forced_lens=forced_lens,
            constrained=constrained,
        )  # fmt: skip

    def _verify(self, plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One round over a verify or decode plan (module doc): draft, verify, accept, extend,
        record, with graph or eager steps chosen once, by the round's bucket."""
        r = self._begin_round(plan)
        if r.bp is not None:
            chain, target, extend = self._chain_graph, self._target_graph, self._extend_graph
        else:
            chain, target = self._chain_eager, self._target_eager
            extend = self._extend_deferred if r.defer else self._extend_eager
        marks = Marks(tc=self._clock.mark())
        if not r.defer:
            self._catch_up(plan, r.start, r.block_tables)
        marks.t0 = self._clock.mark()
        draft_ids = self._draft(r, chain)
        grammar = None
        if r.constrained:
            grammar, cut = self.grammar.verify_masks(plan, r.n, draft_ids)
            self.stats.grammar_cut += cut
        marks.t1 = self._clock.mark()
        verified = target(r, draft_ids)
        accepted = self._accept(r, draft_ids, verified, grammar)
        extend(r, verified, accepted)
        return self._record(r, accepted, marks)

    # ---- 1. draft ------------------------------------------------------------------------------

    def _draft(self, r: Round, chain) -> torch.Tensor:
        """int64 [B, k]: the head's k_head drafts by `chain` (argmax only, topk == 1), padded to
        k, and the lookup rows' copied tokens in place of them."""
        draft_ids = torch.zeros(r.b, r.k, dtype=torch.long, device=self.device)  # [B, k]
        if r.head_drafts:  # else k == 0, or every row drafts by lookup
            h = self.slots.hidden.index_select(0, r.request_slots)  # h^d_{L-2} [B, h]
            chain(r, h, draft_ids)
            self.stats.draft_steps += r.k_head - 1
        if r.by_lookup.any():
            use = self._dev(r.by_lookup, bool)[:, None]  # [B, 1]
            draft_ids = torch.where(use, self._dev(r.lookup_ids), draft_ids)
        if r.forced_ids is not None:  # forced tokens first (the eager chain drafted after them)
            forced = np.arange(r.k)[None, :] < r.forced_lens[:, None]  # [B, k]
            draft_ids = torch.where(self._dev(forced, bool), r.forced_ids, draft_ids)
        return draft_ids

    def _chain_eager(self, r: Round, h: torch.Tensor, draft_ids: torch.Tensor) -> None:
        """The head's chain into draft_ids[:, :k_head], one draft forward per step."""
        d = None  # [B] the previous step's draft d_j
        # constrained rows: their next tokens
        allowed = self.grammar.head_masks(r.plan, None) if r.constrained else None
        for j in range(r.k_head):
            if j:  # one draft step at p = L-2+j from (h^d_{p-1}, d_j); the assistant: p = L-2
                p = r.start - 1 if self.draft.fixed_position else r.start + j - 1
                meta = self._meta(r.per_row, p + 1, r.block_tables, r.kv_slots[:, j - 1])
                h = self._draft_forward(d, h, self._dev(p), meta)  # [B, h] h^d_p
            d = self.draft.argmax_tokens(h) if allowed is None else (
                self.draft.argmax_tokens(h, allowed))  # [B] d_{j+1}
            if r.forced_ids is not None and bool((r.forced_lens > j).any()):
                # a forced token is the row's draft: the head goes on from it
                d = torch.where(self._dev(r.forced_lens > j, bool), r.forced_ids[:, j], d)
            draft_ids[:, j] = d
            if allowed is not None and j + 1 < r.k_head:
                allowed = self.grammar.head_masks(r.plan, d)

    def _chain_graph(self, r: Round, h: torch.Tensor, draft_ids: torch.Tensor) -> None:
        """The head's chain into draft_ids[:, :k_head], one graph replay."""
        draft_ids[:, : r.k_head] = self.graphs.draft_chain(
            r.bp, r.k_head, h, r.start, r.plan.block_tables, r.kv_slots
        )

    # ---- 2. verify -----------------------------------------------------------------------------

    def _target_eager(self, r: Round, draft_ids: torch.Tensor) -> Verified:
        """The target over [x_{L-1}, d_1..d_k] at L-1..L-1+k: logits [B, k+1, V], and the
        captured states, positions and metadata the extend reuses."""
        b, k = r.b, r.k
        first = self._dev(r.plan.input_ids[r.cu[:-1]])  # [B] x_{L-1}
        ids = torch.cat((first[:, None], draft_ids), dim=1).reshape(-1)  # [B*(k+1)]
        pos_np = (r.start[:, None] + np.arange(k + 1)).reshape(-1)  # [B*(k+1)]
        positions = self._dev(pos_np)
        meta = self._meta(
            r.per_row * (k + 1), r.start + k + 1, r.block_tables,
            r.kv_slots[:, : k + 1].reshape(-1),
        )  # fmt: skip
        self.model.backend.prepare(meta)
        # a hybrid model: every row in the step form; the slots keep the states before the
        # round and each row replays its accepted tokens after `_accept` (recurrent_state.py)
        if self.model.states is not None:
            self._verify_states = self.target.prepare_states(r.plan, [k + 1] * b, keep=True)
        captured = None
        if r.head_rows:
            hidden, captured = self.model(
                ids, positions, meta, self.kv_caches, capture_layers=self.draft.capture_layers
            )  # [B*(k+1), H]
        else:  # every row left the head: nothing extends it, so nothing is captured
            hidden = self.model(ids, positions, meta, self.kv_caches)
        logits = self.model.compute_logits(hidden).view(b, k + 1, -1)  # [B, k+1, V]
        return Verified(logits, captured, positions, meta)

    def _target_graph(self, r: Round, draft_ids: torch.Tensor) -> Verified:
        """As `_target_eager`, by a graph replay (the features stay in the graph)."""
        first = self._dev(r.plan.input_ids[r.cu[:-1]])  # [B] x_{L-1}
        return Verified(self.graphs.target_verify(
            r.bp, r.k, first, draft_ids, r.start, r.plan.block_tables, r.kv_slots
        ))  # fmt: skip

    # ---- 3. accept -----------------------------------------------------------------------------

    def _accept(
        self, r: Round, draft_ids: torch.Tensor, v: Verified, grammar: GrammarMask | None = None
    ) -> Accepted:
        """tokens int64 [B, k+1] (accepted drafts, then the target's token; the rest unused)
        and accepted int64 [B], by verify.py; rows drafting fewer than k are masked."""
        plan = r.plan
        padded = bool((r.n < r.k).any())
        controls = LogitsControls.from_plan(plan, self.device, grammar)
        # position j as plain decoding sees it after the drafts before j (logits_processing.py)
        logits, dead = v.logits, None
        if controls is not None:  # dead [B, k+1]: positions with no allowed token
            logits, dead = without_dead_rows(controls.apply(v.logits, draft_ids))
        if logits.is_cpu and bool(deterministic_rows(plan.temperature, plan.top_k).all()):
            # every row greedy: the same tokens and counts from a few numpy operations
            tokens, accepted = verify_greedy_host(logits, draft_ids, r.n if padded else None)
        else:
            tokens, accepted = verify(
                logits, draft_ids, *self._sampling(plan), self._dev(r.n) if padded else None
            )
        logprobs = None
        if wanted(plan):
            processed = None if controls is None else logits
            logprobs = self._round_logprobs(r, v.logits, tokens, processed)
        no_token = None
        if dead is not None:  # a row reaching a dead position stops there with NO_TOKEN
            k1 = dead.shape[1]
            first = torch.where(dead.any(dim=1), dead.long().argmax(dim=1), k1)  # [B]
            accepted = torch.minimum(accepted, first.to(accepted.device))
            no_token = first == accepted
        if self._verify_states is not None:  # each row's state after its last accepted token
            self.model.states.keep_accepted(self._verify_states, accepted.tolist())
            self._verify_states = None
        return Accepted(tokens, accepted, logprobs, no_token)

    def _round_logprobs(
        self, r: Round, raw: torch.Tensor, tokens: torch.Tensor, processed: torch.Tensor | None
    ) -> tuple:
        """The logprobs of tokens [B, k+1] at every position of the round, [B*(k+1)] rows (what
        `_record` keeps of them: the emitted tokens')."""
        plan, k1 = r.plan, r.k + 1
        vocab = raw.shape[-1]
        temperature, top_p, top_k = (t.repeat_interleave(k1) for t in self._sampling(plan)[:3])
        flat = None if processed is None else processed.reshape(-1, vocab)
        lp = distribution(raw.reshape(-1, vocab), flat, temperature, top_k, top_p,
                          self.logprobs_mode)  # [B*(k+1), V]
        return top_logprobs(lp, tokens.reshape(-1), wanted(plan))

    # ---- 4. extend: the draft over L-1..L-1+k, keeping h^d at L-1+a ----------------------------

    def _extend_eager(self, r: Round, v: Verified, a: Accepted) -> None:
        if not r.head_rows:  # no row keeps a draft state
            return
        select = torch.arange(r.b, device=self.device) * (r.k + 1) + a.accepted  # [B]
        features = self.draft.target_features(v.captured)  # [B*(k+1), h]
        h = self._draft_forward(a.tokens.reshape(-1), features, v.positions, v.meta, select)
        self.slots.set_hidden(r.request_slots, h)

    def _extend_graph(self, r: Round, v: Verified, a: Accepted) -> None:
        h = self.graphs.draft_extend(r.bp, r.k, a.tokens, a.accepted)  # [B, h]
        self.slots.set_hidden(r.request_slots, h)

    def _extend_deferred(self, r: Round, v: Verified, a: Accepted) -> None:
        """A k = 0 round of the policy: the extend waits for the next round with drafts."""
        self._defer(r.plan.request_slots, a.tokens[:, 0], v.captured or {})

    # ---- 5. record -----------------------------------------------------------------------------

    def _record(self, r: Round, a: Accepted, marks: Marks) -> tuple:
        """The round's one synchronisation, its stats, lookup histories and cost; returns
        (tokens int32 [N], num_tokens int32 [B], num_accepted int32 [B]) as `step` does."""
        tokens_np = a.tokens.cpu().numpy()  # the step's only synchronisation
        accepted_np = a.accepted.cpu().numpy()
        if a.no_token is not None:  # its emitted token is NO_TOKEN: an error row at the commit
            rows = np.flatnonzero(a.no_token.cpu().numpy())
            tokens_np = tokens_np.copy()
            tokens_np[rows, accepted_np[rows]] = NO_TOKEN
        marks.t2 = self._clock.mark()
        num_tokens = accepted_np + 1
        keep = np.arange(r.k + 1)[None, :] < num_tokens[:, None]  # [B, k+1]
        self._record_stats(r, accepted_np, num_tokens)
        if self.lookup is not None:
            for i, slot in enumerate(r.plan.request_slots):
                self.lookup.extend(int(slot), tokens_np[i, : num_tokens[i]])
        self._record_cost(r, accepted_np, marks)
        result = (
            tokens_np[keep].astype(np.int32),
            num_tokens.astype(np.int32),
            accepted_np.astype(np.int32),
        )
        if a.logprobs is None:
            return result
        chosen, ids, lps = a.logprobs
        k_lp = ids.shape[1]
        flat = keep.reshape(-1)  # the emitted tokens, in the order of result[0]
        return (*result, (chosen[flat], ids.reshape(-1, k_lp)[flat], lps.reshape(-1, k_lp)[flat]))

    def _record_stats(self, r: Round, accepted: np.ndarray, num_tokens: np.ndarray) -> None:
        n, by_lookup = r.n, r.by_lookup
        self.stats.verify_rounds += 1
        self.stats.drafted += int(n.sum())
        self.stats.accepted += int(accepted.sum())
        self.stats.emitted += int(num_tokens.sum())
        if r.forced_lens is not None:
            self.stats.forced_drafted += int(r.forced_lens.sum())
            self.stats.forced_accepted += int(np.minimum(accepted, r.forced_lens).sum())
        if by_lookup.any():
            self.stats.lookup_rows += int(by_lookup.sum())
            self.stats.lookup_drafted += int(n[by_lookup].sum())
            self.stats.lookup_accepted += int(accepted[by_lookup].sum())

    def _record_cost(self, r: Round, accepted: np.ndarray, marks: Marks) -> None:
        """Tells the round's policy its cost at width k and its acceptance (accepted [B])."""
        clock = self._clock
        # a catch-up extend is part of its round's cost (the rounds that deferred cost less)
        catch_up = clock.seconds(marks.tc, marks.t0)
        verify_s = catch_up + clock.seconds(marks.t1, marks.t2)
        if r.lookup_round and self.lookup_policy is not None:
            # copied drafts cost nothing to make: the round's cost is its verify
            self.lookup_policy.record(r.b, r.k, None, verify_s, accepted.tolist(), r.n.tolist())
        elif self.policy is not None and r.k <= self.num_steps:  # not widened by forced drafts
            # every round's cost at its width k (also when only lookup rows drafted: the others
            # were padded to k + 1 query tokens all the same); acceptance from the head's drafts
            drafting = clock.seconds(marks.t0, marks.t1)
            self.policy.record(
                r.b,
                r.k,
                drafting / r.k if r.head_drafts else None,
                verify_s,
                accepted[~r.by_lookup & ~r.stale].tolist() if r.head_drafts else [],
            )
