"""`SpecWorker`: EAGLE speculative decoding (chain drafts, topk == 1) on top of the plain Worker.

Plans (see _native.pyi and the speculative plan contract):
  * "prefill": row i is a whole sequence x_0..x_{n-1} from position 0. The target runs it
    (capturing what the draft reads), samples x_n, then the draft EXTENDS over the sequence:
    draft input at p = (f_p, x_{p+1}) for p = 0..n-1, writing draft K/V at positions 0..n-1.
  * "verify": row i has L committed tokens (target K/V valid for 0..L-2) and a query of K'+1
    tokens at positions L-1..L-1+K': x_{L-1} then K' placeholders (K' = max_draft_tokens: K,
    the head's longest chain, or more with prompt lookup). A round with k <= K' drafts:
      1. draft d_1 = argmax head(h^d_{L-2}) (slot state), then for j = 1..k-1 one draft step at
         p = L-2+j with input (h^d_{p-1}, d_j) -> h^d_p, d_{j+1} (writes draft K/V at p);
      2. the target verifies [x_{L-1}, d_1..d_k] at positions L-1..L-1+k;
      3. verify.py accepts a <= k drafts and adds one target token;
      4. the draft extends over positions L-1..L-1+k with (target feature at p, x_{p+1}),
         overwriting what drafting wrote. Only rows p <= L-1+a are meaningful; later rows
         write draft K/V that is stale but never read before it is rewritten (a query at
         position q only attends to positions <= q, and every round rewrites its positions
         before reading them). This keeps the step free of host synchronisation until the end.
    "decode" plans (1 query token per row) run as rounds with k = 0.
  * prompt lookup (`prompt_lookup`, speculative/ngram.py): a row whose latest tokens recur
    earlier in its sequence, followed there by k tokens, takes those as its k drafts instead of
    the head's. When every row has K of them the head does not run (step 1 is skipped) and a
    row may draft up to `lookup_tokens` (>= K) copied tokens: the round's width k is then chosen
    by a second adaptive policy that prices lookup rounds (no drafting cost, a verify over k+1
    tokens, the acceptance of copied tokens), and row i drafts n_i = min(its proposal, k).
    Rows with n_i < k are padded; verify.py never accepts padding. Without the adaptive
    policy a row's n_i depends only on its own sequence: min(proposal, lookup_tokens) when it
    drafts by lookup, else K, so sampled output does not depend on the batch. Steps 2-4 run
    over the round's width as usual, so the draft's state stays as the invariant below says.
  * deferred extends (adaptive policy, eager steps): a round the policy runs with k = 0 drafts
    nothing, so its step 4 is only bookkeeping for later rounds. It is deferred: each row keeps
    the target's captured states and the new token of up to MAX_DEFERRED such rounds, and the
    first round with k > 0 first extends the draft over all of them at once (one draft forward
    over the deferred positions of every row that has some). A row with more deferred rounds
    than that is dropped from the head for good ("stale": its draft state is never read again;
    it drafts by prompt lookup or not at all), so a batch where the policy keeps choosing k = 0
    stops paying for the draft. The policy is told how many rows can still draft (not stale, or
    with a lookup proposal) and learns every round's cost, so a batch of stale rows goes back
    to k = 0 instead of widening every row's query for a few lookup drafts.
Invariant between steps, per running slot s that is not stale: the draft's K/V is valid for
positions 0..L-2-d (like the target's, less the d = deferred[s] deferred positions) and
hidden[s] = h^d_{L-2-d}, the draft output at the last extended position.
K/V slots are the plan's: the draft's K/V of position p sits at the target's slot of p.

Output per plan row: accepted drafts then the target's token (1..k+1 tokens), num_accepted.
With `enable_graphs`, stages 1, 2 and 4 of a round run as captured steps per padded batch size
(speculative/graphs.py); prefill, and batches above the largest bucket, stay eager.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from eaglebatch.attention.base import AttentionMetadata
from eaglebatch.config import SpeculativeConfig
from eaglebatch.model.linear import use_small_gemm
from eaglebatch.model.llama import RMSNorm
from eaglebatch.sampling import sample
from eaglebatch.speculative.adaptive import AdaptiveDraftLength
from eaglebatch.speculative.eagle import EagleDraft, load_draft
from eaglebatch.speculative.graphs import SpecGraphs
from eaglebatch.speculative.ngram import NgramLookup
from eaglebatch.speculative.verify import deterministic_rows, verify, verify_greedy_host
from eaglebatch.worker import Worker, check_graph_support, plan_metadata

TREE_UNSUPPORTED = "speculative.topk > 1 (tree drafting) is not supported yet"
# the most k = 0 rounds a row's draft extend waits for before the row leaves the head (module doc)
MAX_DEFERRED = 8


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
    stale_rows: int = 0  # sequences dropped from the head (more than MAX_DEFERRED deferred)

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
        num_speculative_tokens: int,
        max_batch_size: int,
        adaptive: bool = True,
        topk: int = 1,
        draft_kv_cache: torch.Tensor | None = None,
        prompt_lookup: tuple[int, int] | None = None,
        lookup_tokens: int | None = None,
    ) -> None:
        """Shares the target Worker's model, KV caches and budget; allocates the draft's one-layer
        cache over the same blocks unless given. adaptive=False drafts K tokens every round.
        prompt_lookup: (min_n, max_n) n-gram sizes of prompt-lookup drafts, None = off.
        lookup_tokens: the most tokens a row drafts by lookup in a round without the head
        (default and minimum K). Plans then carry `max_draft_tokens` placeholders per row."""
        if topk > 1:
            raise ValueError(TREE_UNSUPPORTED)
        if topk < 1 or num_speculative_tokens < 1:
            raise ValueError("speculative: topk and num_speculative_tokens must be >= 1")
        # K: the head's longest chain; max_draft_tokens: the widest round (lookup rounds)
        self.max_draft_tokens = self.widest_round(
            num_speculative_tokens, prompt_lookup, lookup_tokens
        )
        self.target = target
        self.model = target.model
        self.kv_caches = target.kv_caches
        self.budget = target.budget
        self.device = target.device
        self.max_model_len = target.max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.draft = draft
        self.draft_kv = (
            draft_kv_cache
            if draft_kv_cache is not None
            else draft.allocate_kv_cache(self.budget.num_blocks + 1, self.budget.block_size)
        )  # + the pad block of graph steps
        # verify queries reach position max_model_len - 1 + max_draft_tokens
        most = self.max_model_len + self.max_draft_tokens
        for rotary in (self.model.model.rotary_emb, draft.rotary_emb):
            if rotary.max_positions < most:
                rotary.max_positions = most
                rotary.rebuild()
        # per-slot draft state: h^d at the last extended position (see the module doc)
        self.hidden = torch.zeros(
            max_batch_size, draft.config.hidden_size, dtype=draft.dtype, device=self.device
        )
        self.ready = np.zeros(max_batch_size, dtype=bool)  # slot has been prefilled
        # deferred extends (module doc): per slot, how many; their tokens and captured states
        self.deferred = np.zeros(max_batch_size, dtype=np.int64)
        self.stale = np.zeros(max_batch_size, dtype=bool)
        self.deferred_ids = torch.zeros(
            max_batch_size, MAX_DEFERRED, dtype=torch.long, device=self.device
        )
        self.deferred_states: dict[int, torch.Tensor] = {}  # layer -> [slots, MAX_DEFERRED, H]
        self.policy = AdaptiveDraftLength(num_speculative_tokens) if adaptive else None
        self.lookup = None
        self.lookup_policy = None  # the width of rounds where every row drafts by lookup
        if prompt_lookup is not None:
            self.lookup = NgramLookup(max_batch_size, most + 1, *prompt_lookup)
            if adaptive:
                self.lookup_policy = AdaptiveDraftLength(self.max_draft_tokens)
        self.stats = SpecStats()
        self._clock = _Clock(self.device)
        self.graphs: SpecGraphs | None = None  # enable_graphs

    def enable_graphs(self, mode: str, max_batch_size: int) -> None:
        """Captures the draft loop, verify and draft-extend per padded batch size and draft
        length (speculative/graphs.py). mode: "cuda", "eager" (CPU tests) or "off"."""
        check_graph_support(self.target, mode)
        if mode == "off":
            return
        if not self.draft.backend.supports_cuda_graphs or self.draft_kv.shape[1] <= self.num_blocks:
            raise ValueError("the draft's backend or KV cache cannot run graph steps")
        self.graphs = SpecGraphs(self, mode, max_batch_size)
        self.graphs.stats.reserved_bytes = self.target.graph_reserve_bytes

    def graph_stats(self) -> dict | None:
        return None if self.graphs is None else self.graphs.stats.as_dict()

    def draft_stats(self) -> dict:
        return self.stats.as_dict()

    @staticmethod
    def widest_round(
        num_speculative_tokens: int,
        prompt_lookup: tuple[int, int] | None,
        lookup_tokens: int | None,
    ) -> int:
        """max_draft_tokens: K, or lookup_tokens when larger and prompt lookup is on."""
        if prompt_lookup is None or lookup_tokens is None:
            return num_speculative_tokens
        return max(num_speculative_tokens, lookup_tokens)

    @classmethod
    def from_job(
        cls,
        target: Worker,
        draft_path: str | os.PathLike[str],
        spec: SpeculativeConfig,
        max_batch_size: int,
    ) -> SpecWorker:
        """The job's `speculative` section over `target` (the engine and bench build it so)."""
        return cls.from_target(
            target,
            draft_path,
            num_speculative_tokens=spec.num_steps,
            max_batch_size=max_batch_size,
            topk=spec.topk,
            adaptive=spec.adaptive,
            prompt_lookup=spec.prompt_lookup,
            lookup_tokens=spec.prompt_lookup_tokens,
        )

    @classmethod
    def from_target(
        cls,
        target: Worker,
        draft_path: str | os.PathLike[str],
        *,
        num_speculative_tokens: int,
        max_batch_size: int,
        topk: int = 1,
        adaptive: bool = True,
        prompt_lookup: tuple[int, int] | None = None,
        lookup_tokens: int | None = None,
    ) -> SpecWorker:
        if topk > 1:
            raise ValueError(TREE_UNSUPPORTED)
        draft = load_draft(
            draft_path,
            target.model.config,
            target.model,
            max_positions=target.max_model_len
            + cls.widest_round(num_speculative_tokens, prompt_lookup, lookup_tokens),
        )
        # as the target runs; a head shipped in bf16 is read from exact bf16 copies (same bits)
        native = use_small_gemm(draft, target.model.small_gemm_threads, bf16_weights=True)
        for m in draft.modules():
            if isinstance(m, RMSNorm):
                m.native = native  # the head's norms of few CPU rows: one native call each
        return cls(
            target,
            draft,
            num_speculative_tokens=num_speculative_tokens,
            max_batch_size=max_batch_size,
            adaptive=adaptive,
            topk=topk,
            prompt_lookup=prompt_lookup,
            lookup_tokens=lookup_tokens,
        )

    @property
    def num_blocks(self) -> int:
        return self.budget.num_blocks

    @torch.inference_mode()
    def step(self, plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens int32 [N], num_tokens int32 [B], num_accepted int32 [B]) in plan row order."""
        if plan.kind == "prefill":
            return self._prefill(plan)
        if plan.kind in ("verify", "decode"):
            return self._verify(plan)
        raise ValueError(f"unknown plan kind {plan.kind!r}")

    # ---- helpers -------------------------------------------------------------------------------

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the worker's device (itself on the CPU: no .to() dispatch)."""
        return t if self.device.type == "cpu" else t.to(self.device)

    def _dev(self, a: np.ndarray, dtype=np.int64) -> torch.Tensor:
        return self._on_device(torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)))

    def _sampling(self, plan) -> tuple[torch.Tensor, ...]:
        """temperature, top_p, top_k, seeds, num_generated as device tensors."""
        return (
            self._dev(plan.temperature, np.float32),
            self._dev(plan.top_p, np.float32),
            self._dev(plan.top_k, np.int32),
            self._dev(plan.seeds, np.int64),
            self._dev(plan.num_generated, np.int32),
        )

    def _meta(
        self,
        cu: np.ndarray,  # [B+1] query offsets
        seq_lens: np.ndarray,  # [B] context incl. the query
        block_tables: torch.Tensor,  # int32 [B, M] on the device (the plan's)
        slot_mapping: np.ndarray,  # [T]
    ) -> AttentionMetadata:
        """Metadata for a query the plan did not spell out (draft steps, shorter verifies): same
        block tables, host-side lengths, no device synchronisation."""
        cu_cpu = torch.from_numpy(np.ascontiguousarray(cu, dtype=np.int32))
        lens_cpu = torch.from_numpy(np.ascontiguousarray(seq_lens, dtype=np.int32))
        q = cu[1:] - cu[:-1]
        return AttentionMetadata(
            cu_seqlens_q=self._on_device(cu_cpu),
            seq_lens=self._on_device(lens_cpu),
            block_tables=block_tables,
            slot_mapping=self._dev(slot_mapping),
            block_size=self.budget.block_size,
            max_seqlen_q=int(q.max()),
            max_seqlen_k=int(seq_lens.max()),
            is_prefill=bool((q == seq_lens).all()),
            cu_seqlens_q_cpu=cu_cpu,
            seq_lens_cpu=lens_cpu,
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
        hidden, captured = self.model(
            ids, positions, meta, self.kv_caches, capture_layers=self.draft.capture_layers
        )  # [T, H]
        last = self._dev(plan.cu_seqlens_q[1:].astype(np.int64) - 1)  # [B]
        logits = self.model.compute_logits(hidden.index_select(0, last))  # [B, V]
        tokens = sample(logits, *self._sampling(plan))  # [B]
        # draft extend over p = 0..n-1: token x_{p+1} is the next prompt token, or the new one
        next_ids = torch.roll(ids, -1)
        next_ids[last] = tokens
        h = self._draft_forward(
            next_ids, self.draft.target_features(captured), positions, meta, select=last
        )  # [B, h]
        self.hidden.index_copy_(0, self._dev(plan.slots), h)
        self.ready[plan.slots] = True
        self.deferred[plan.slots] = 0
        self.stale[plan.slots] = False
        self.stats.prefill_steps += 1
        out = tokens.to(torch.int32).cpu().numpy()
        n = len(out)
        if self.lookup is not None:
            cu = plan.cu_seqlens_q
            for i, slot in enumerate(plan.slots):
                seq = np.append(plan.input_ids[cu[i] : cu[i + 1]], out[i])
                self.lookup.reset(int(slot), seq)
        return out, np.ones(n, dtype=np.int32), np.zeros(n, dtype=np.int32)

    # ---- deferred draft extends (module doc) ---------------------------------------------------

    def _defer(
        self, slots: np.ndarray, tokens: torch.Tensor, captured: dict[int, torch.Tensor]
    ) -> None:
        """Keeps a k = 0 round's draft-extend input per row: the new token x_L (int64 [B]) and
        the target's captured states at L-1 ({layer: [B, H]}). A row with MAX_DEFERRED already
        kept becomes stale instead."""
        live = ~self.stale[slots]
        full = live & (self.deferred[slots] >= MAX_DEFERRED)
        self.stale[slots[full]] = True
        self.stats.stale_rows += int(full.sum())
        keep = np.flatnonzero(live & ~full)
        if len(keep) == 0:
            return
        rows = self._dev(keep)
        at = (self._dev(slots[keep]), self._dev(self.deferred[slots[keep]]))  # (slot, index)
        self.deferred_ids.index_put_(at, tokens.index_select(0, rows))
        for layer, state in captured.items():
            if layer not in self.deferred_states:
                self.deferred_states[layer] = torch.zeros(
                    *self.deferred_ids.shape, state.shape[-1], dtype=state.dtype,
                    device=self.device,
                )  # fmt: skip
            self.deferred_states[layer].index_put_(at, state.index_select(0, rows))
        self.deferred[slots[keep]] += 1
        self.stats.deferred_extends += len(keep)

    def _catch_up(self, plan, start: np.ndarray, block_tables: torch.Tensor) -> None:
        """The deferred draft extends of the plan's rows (row i: positions start[i] - d_i ..
        start[i] - 1, d_i = deferred[slot]) as one draft forward; restores the invariant."""
        slots = plan.slots
        rows = np.flatnonzero((self.deferred[slots] > 0) & ~self.stale[slots])
        if len(rows) == 0:
            return
        d = self.deferred[slots[rows]]  # [R]
        cu = np.concatenate(([0], np.cumsum(d)))  # [R+1]
        index = np.concatenate([np.arange(x) for x in d])  # [T] deferral index of each query
        row_of = np.repeat(rows, d)  # [T] plan row of each query
        positions = start[row_of] - d.repeat(d) + index  # [T]
        bs = self.budget.block_size
        slot_mapping = plan.block_tables[row_of, positions // bs].astype(np.int64) * bs + (
            positions % bs
        )
        at = (self._dev(slots[row_of]), self._dev(index))
        captured = {layer: t[at] for layer, t in self.deferred_states.items()}
        meta = self._meta(cu, start[rows], block_tables[self._dev(rows)], slot_mapping)
        h = self._draft_forward(
            self.deferred_ids[at],
            self.draft.target_features(captured),
            self._dev(positions),
            meta,
            select=self._dev(cu[1:] - 1),
        )  # [R, h] h^d at start - 1
        self.hidden.index_copy_(0, self._dev(slots[rows]), h)
        self.deferred[slots[rows]] = 0

    # ---- verify round --------------------------------------------------------------------------

    def _proposals(self, slots: np.ndarray, k_plan: int) -> list[np.ndarray] | None:
        """Each row's prompt-lookup proposal (up to k_plan tokens, maybe none); None when off."""
        if self.lookup is None or k_plan == 0:
            return None
        return [self.lookup.propose(int(slot), k_plan) for slot in slots]

    def _round_shape(
        self, slots: np.ndarray, k_plan: int
    ) -> tuple[int, int, np.ndarray, np.ndarray, list[np.ndarray], bool]:
        """(k, k_head, n, by_lookup, proposals, lookup_round) of a round over `slots` (see the
        module doc): the round's width k (a query of k + 1 tokens per row), the head's chain
        length (0: the head does not run), each row's own number of drafts n (int64 [B], <= k),
        whether it drafts by lookup (bool [B]), each row's proposal, and whether every row
        drafts by lookup (the lookup policy's round)."""
        b = len(slots)
        K = min(self.num_speculative_tokens, k_plan)
        # proposals of K tokens (the head's width), and of k_plan where a row may draft more
        # (the occurrence propose() picks depends on how many following tokens are asked for)
        proposals = self._proposals(slots, K) or [np.zeros(0, np.int32)] * b
        lens = np.array([len(p) for p in proposals], dtype=np.int64)  # [B]
        if K > 0 and self.lookup is not None and bool((lens >= K).all()):
            if k_plan > K:
                proposals = self._proposals(slots, k_plan)
                lens = np.array([len(p) for p in proposals], dtype=np.int64)  # still >= K
            policy = self.lookup_policy
            k = k_plan if policy is None else min(k_plan, policy.choose(b))
            n = np.minimum(lens, k)
            return int(n.max()), 0, n, n > 0, proposals, True
        if self.policy is None:
            k = K
        else:
            # rows that left the head (stale) draft only by lookup; the rest may draft
            drafting = int((~self.stale[slots] | (lens > 0)).sum())
            k = min(K, self.policy.choose(b, drafting=drafting))
        by_lookup = (lens >= k) & (k > 0)
        n = np.full(b, k, dtype=np.int64)
        if self.policy is None and k_plan > K:  # a row's n depends on its own sequence only
            for i in np.flatnonzero(by_lookup):
                proposals[i] = self.lookup.propose(int(slots[i]), k_plan)
                n[i] = len(proposals[i])
        # stale rows (module doc; only with the policy) never draft by the head
        head_rows = ~by_lookup & ~self.stale[slots]
        n[~by_lookup & self.stale[slots]] = 0
        k_head = k if head_rows.any() else 0
        return int(n.max(initial=0)), k_head, n, by_lookup, proposals, False

    def _verify(self, plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b = plan.num_seqs
        cu = plan.cu_seqlens_q.astype(np.int64)
        q_lens = cu[1:] - cu[:-1]
        k_plan = int(q_lens[0]) - 1
        if (q_lens != q_lens[0]).any() or not 0 <= k_plan <= self.max_draft_tokens:
            raise ValueError(
                f"verify plan: every row needs the same query length in 1.."
                f"{self.max_draft_tokens + 1}, got {sorted(set(q_lens.tolist()))}"
            )
        if not self.ready[plan.slots].all():
            bad = plan.slots[~self.ready[plan.slots]].tolist()
            raise RuntimeError(f"verify plan uses slots {bad} that were never prefilled")
        stale = self.stale[plan.slots]  # [B] rows the head no longer serves (module doc)
        k, k_head, n, by_lookup, proposals, lookup_round = self._round_shape(plan.slots, k_plan)
        # drafts int64 [B, k]: lookup rows' copied tokens, padding (0) after each row's n
        lookup_ids = np.zeros((b, k), dtype=np.int64)
        for i in np.flatnonzero(by_lookup):
            lookup_ids[i, : n[i]] = proposals[i][: n[i]]
        head_drafts = k_head > 0 and not by_lookup.all()
        start = plan.positions[cu[:-1]].astype(np.int64)  # [B] L-1
        plan_slots = plan.slot_mapping.reshape(b, k_plan + 1)  # [B, K'+1] slots of L-1..L-1+K'
        block_tables = self._dev(plan.block_tables, np.int32)
        slots = self._dev(plan.slots)
        per_row = np.arange(b + 1, dtype=np.int64)

        bp = None if self.graphs is None else self.graphs.bucket(b)  # None: eager
        # a round of k = 0 chosen by the policy defers its draft extend; any other first
        # extends the draft over what earlier rounds deferred (module doc)
        defer = k == 0 and self.policy is not None and bp is None
        tc = self._clock.mark()
        if not defer:
            self._catch_up(plan, start, block_tables)
        t0 = self._clock.mark()
        # 1. drafting: argmax only (topk == 1); the head's k_head drafts, padded to k
        draft_ids = torch.zeros(b, k, dtype=torch.long, device=self.device)  # [B, k] target ids
        if not head_drafts:
            pass  # k == 0, or every row drafts by lookup (below)
        elif bp is not None:
            h = self.hidden.index_select(0, slots)  # [B, h] h^d_{L-2}
            draft_ids[:, :k_head] = self.graphs.draft_chain(
                bp, k_head, h, start, plan.block_tables, plan_slots
            )
            self.stats.draft_steps += k_head - 1
        else:
            h = self.hidden.index_select(0, slots)  # [B, h] h^d_{L-2}
            d = self.draft.argmax_tokens(h)
            draft_ids[:, 0] = d
            for j in range(1, k_head):
                p = start + j - 1  # this step's position L-2+j
                meta = self._meta(per_row, p + 1, block_tables, plan_slots[:, j - 1])
                h = self._draft_forward(d, h, self._dev(p), meta)  # [B, h] h^d_p
                d = self.draft.argmax_tokens(h)
                draft_ids[:, j] = d
            self.stats.draft_steps += k_head - 1
        if by_lookup.any():
            use = self._dev(by_lookup, bool)[:, None]  # [B, 1]
            draft_ids = torch.where(use, self._dev(lookup_ids), draft_ids)
        t1 = self._clock.mark()

        # 2. target verify over [x_{L-1}, d_1..d_k] at L-1..L-1+k
        first = self._dev(plan.input_ids[cu[:-1]])  # [B] x_{L-1}
        if bp is not None:
            logits = self.graphs.target_verify(
                bp, k, first, draft_ids, start, plan.block_tables, plan_slots
            )  # [B, k+1, V]
        else:
            ids = torch.cat((first[:, None], draft_ids), dim=1).reshape(-1)  # [B*(k+1)]
            pos_np = (start[:, None] + np.arange(k + 1)).reshape(-1)  # [B*(k+1)]
            positions = self._dev(pos_np)
            meta = self._meta(
                per_row * (k + 1), start + k + 1, block_tables, plan_slots[:, : k + 1].reshape(-1)
            )
            self.model.backend.prepare(meta)
            hidden, captured = self.model(
                ids, positions, meta, self.kv_caches, capture_layers=self.draft.capture_layers
            )  # [B*(k+1), H]
            logits = self.model.compute_logits(hidden).view(b, k + 1, -1)  # [B, k+1, V]
        padded = bool((n < k).any())
        if logits.is_cpu and bool(deterministic_rows(plan.temperature, plan.top_k).all()):
            # every row greedy: the same tokens and counts from a few numpy operations
            tokens, accepted = verify_greedy_host(logits, draft_ids, n if padded else None)
        else:
            tokens, accepted = verify(
                logits, draft_ids, *self._sampling(plan), self._dev(n) if padded else None
            )

        # 4. draft extend over L-1..L-1+k; keep h^d at L-1+a (or defer it: k == 0)
        if defer:
            self._defer(plan.slots, tokens[:, 0], captured)
        elif bp is not None:
            h = self.graphs.draft_extend(bp, k, tokens, accepted)
            self.hidden.index_copy_(0, slots, h)
        else:
            select = torch.arange(b, device=self.device) * (k + 1) + accepted  # [B]
            h = self._draft_forward(
                tokens.reshape(-1), self.draft.target_features(captured), positions, meta, select
            )
            self.hidden.index_copy_(0, slots, h)

        tokens_np = tokens.cpu().numpy()  # the step's only synchronisation
        accepted_np = accepted.cpu().numpy()
        t2 = self._clock.mark()
        num_tokens = accepted_np + 1
        keep = np.arange(k + 1)[None, :] < num_tokens[:, None]  # [B, k+1]
        self.stats.verify_rounds += 1
        self.stats.drafted += int(n.sum())
        self.stats.accepted += int(accepted_np.sum())
        self.stats.emitted += int(num_tokens.sum())
        if self.lookup is not None:
            for i, slot in enumerate(plan.slots):
                self.lookup.extend(int(slot), tokens_np[i, : num_tokens[i]])
        if by_lookup.any():
            self.stats.lookup_rows += int(by_lookup.sum())
            self.stats.lookup_drafted += int(n[by_lookup].sum())
            self.stats.lookup_accepted += int(accepted_np[by_lookup].sum())
        # a catch-up extend is part of its round's cost (the rounds that deferred cost less)
        catch_up = self._clock.seconds(tc, t0)
        if lookup_round and self.lookup_policy is not None:
            # copied drafts cost nothing to make: the round's cost is its verify
            self.lookup_policy.record(
                b, k, None, catch_up + self._clock.seconds(t1, t2), accepted_np.tolist(),
                n.tolist(),
            )  # fmt: skip
        elif self.policy is not None:
            # every round's cost at its width k (also when only lookup rows drafted: the others
            # were padded to k + 1 query tokens all the same); acceptance from the head's drafts
            drafting = self._clock.seconds(t0, t1)
            self.policy.record(
                b,
                k,
                drafting / k if head_drafts else None,
                catch_up + self._clock.seconds(t1, t2),
                accepted_np[~by_lookup & ~stale].tolist() if head_drafts else [],
            )
        return (
            tokens_np[keep].astype(np.int32),
            num_tokens.astype(np.int32),
            accepted_np.astype(np.int32),
        )
