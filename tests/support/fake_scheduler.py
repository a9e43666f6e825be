"""A small Python stand-in for the Rust scheduler: StepPlan-like plans for plain decoding and for
speculative verification, block allocation, commit with truncation, and preemption.

Plans follow the contract in eaglebatch/_native.pyi and the speculative plan contract:
  * "prefill": whole sequences (prompt + already generated tokens) from position 0 (no prefix
    caching: prefix_ids empty, cu_prefix all 0);
  * "decode" (max_draft_tokens == 0): one query token per row, x_{L-1} at L-1;
  * "verify" (K > 0): K+1 query tokens per row at L-1..L-1+K, x_{L-1} then K zero placeholders,
    seq_lens = L+K, blocks for L+K tokens.
Policy (simple on purpose): admit waiting requests (oldest first) into free slots as a prefill
plan when blocks allow, else run every running request. When blocks run out for a decode step
the most recently admitted request is preempted (blocks and slot freed, re-prefilled later with
prompt + outputs, in a different slot when one is free). `preempt_at` forces preemptions.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class FakePlan:
    kind: str
    num_seqs: int
    num_tokens: int
    request_slots: np.ndarray  # int32 [B]
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    cu_seqlens_q: np.ndarray  # int32 [B+1]
    seq_lens: np.ndarray  # int32 [B]
    block_tables: np.ndarray  # int32 [B, M]
    slot_mapping: np.ndarray  # int64 [T]
    temperature: np.ndarray  # float32 [B]
    top_p: np.ndarray  # float32 [B]
    top_k: np.ndarray  # int32 [B]
    seeds: np.ndarray  # int64 [B]
    num_generated: np.ndarray  # int32 [B]
    max_seqlen_q: int
    max_seqlen_k: int
    prefix_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # no caching
    cu_prefix: np.ndarray | None = None  # int32 [B+1], all 0
    block_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))
    next_ids: np.ndarray | None = None  # int64 [B], all -1 (no chunked prefill)
    prev_rows: np.ndarray | None = None  # int32 [B], all -1 (no overlap placeholders)
    # per-row controls, all off unless given (no min tokens, no penalty, no logprobs)
    min_tokens: np.ndarray | None = None  # int32 [B]
    end_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    cu_end_ids: np.ndarray | None = None  # int32 [B+1], all 0
    min_p: np.ndarray | None = None  # float32 [B]
    repetition_penalty: np.ndarray | None = None  # float32 [B]
    frequency_penalty: np.ndarray | None = None  # float32 [B]
    presence_penalty: np.ndarray | None = None  # float32 [B]
    logprobs: np.ndarray | None = None  # int32 [B]
    prompt_logprobs: np.ndarray | None = None  # int32 [B]
    prompt_lens: np.ndarray | None = None  # int32 [B]
    prompt_logprobs_from: np.ndarray | None = None  # int32 [B]
    penalty_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    cu_penalty: np.ndarray | None = None  # int32 [B+1], all 0
    penalty_prompt_lens: np.ndarray | None = None  # int32 [B]
    # structured output: no constrained row
    mask_rows: np.ndarray | None = None  # int32 [B], all -1
    token_masks: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), np.uint32))
    forced_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    cu_forced: np.ndarray | None = None  # int32 [B+1], all 0

    def __post_init__(self) -> None:
        b = self.num_seqs
        if self.cu_prefix is None:
            self.cu_prefix = np.zeros(b + 1, dtype=np.int32)
        defaults = {"min_tokens": (0, np.int32), "min_p": (0, np.float32),
                    "repetition_penalty": (1, np.float32),
                    "frequency_penalty": (0, np.float32), "presence_penalty": (0, np.float32),
                    "logprobs": (0, np.int32), "penalty_prompt_lens": (0, np.int32),
                    "prompt_logprobs": (0, np.int32), "prompt_lens": (1, np.int32),
                    "prompt_logprobs_from": (0, np.int32)}
        for name, (value, dtype) in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, np.full(b, value, dtype=dtype))
        if self.cu_penalty is None:
            self.cu_penalty = np.zeros(b + 1, dtype=np.int32)
        if self.cu_end_ids is None:
            self.cu_end_ids = np.zeros(b + 1, dtype=np.int32)
        if self.next_ids is None:
            self.next_ids = np.full(self.num_seqs, -1, dtype=np.int64)
        if self.prev_rows is None:
            self.prev_rows = np.full(self.num_seqs, -1, dtype=np.int32)
        if self.mask_rows is None:
            self.mask_rows = np.full(self.num_seqs, -1, dtype=np.int32)
        if self.cu_forced is None:
            self.cu_forced = np.zeros(b + 1, dtype=np.int32)


@dataclass
class FakeRequest:
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    outputs: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" (EOS) | "length"
    slot: int | None = None
    slots_used: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    accepted: int = 0
    preemptions: int = 0

    @property
    def seq(self) -> list[int]:
        return self.prompt + self.outputs


class FakeScheduler:
    def __init__(
        self,
        requests: list[FakeRequest],
        *,
        num_blocks: int,
        block_size: int,
        max_batch_size: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        max_draft_tokens: int = 0,
        max_prefill_tokens: int = 4096,
        preempt_at: dict[int, int] | None = None,
        seed: int = 0,
    ) -> None:
        """`preempt_at[r] = n`: preempt request r once it has n or more outputs (once)."""
        self.requests = requests
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.eos = set(eos_token_ids)
        self.k = max_draft_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.preempt_at = dict(preempt_at or {})
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)  # non-contiguous block tables
        self.free_request_slots = list(range(max_batch_size))
        self.waiting: deque[int] = deque(range(len(requests)))
        self.running: list[int] = []  # admission order
        self._rows: list[int] = []  # requests of the last plan, in row order
        self._kind = ""
        self.plans = 0
        self.plan_kinds: Counter[str] = Counter()
        self.verify_plans = 0
        self.accept_log: list[np.ndarray] = []  # num_accepted of every verify plan

    # ---- blocks and slots ----------------------------------------------------------------------

    def _blocks_needed(self, r: FakeRequest, tokens: int) -> int:
        return max(0, -(-tokens // self.block_size) - len(r.blocks))

    def _grow(self, r: FakeRequest, tokens: int) -> None:
        for _ in range(self._blocks_needed(r, tokens)):
            r.blocks.append(self.free_blocks.pop())

    def _release(self, i: int) -> None:
        r = self.requests[i]
        self.free_blocks.extend(r.blocks)
        r.blocks = []
        self.free_request_slots.append(r.slot)
        r.slot = None
        self.running.remove(i)

    def _preempt(self, i: int) -> None:
        self._release(i)
        self.requests[i].preemptions += 1
        self.waiting.appendleft(i)

    def _take_slot(self, r: FakeRequest) -> int:
        others = [s for s in self.free_request_slots if not r.slots_used or s != r.slots_used[-1]]
        slot = min(others or self.free_request_slots)
        self.free_request_slots.remove(slot)
        r.slot = slot
        r.slots_used.append(slot)
        return slot

    # ---- plans ---------------------------------------------------------------------------------

    def next_plan(self) -> FakePlan | None:
        for i in list(self.running):
            n = self.preempt_at.get(i)
            if n is not None and len(self.requests[i].outputs) >= n:
                del self.preempt_at[i]
                self._preempt(i)
        admitted: list[int] = []
        tokens = 0
        while self.waiting and self.free_request_slots:
            r = self.requests[self.waiting[0]]
            n = len(r.seq)
            if admitted and tokens + n > self.max_prefill_tokens:
                break
            if self._blocks_needed(r, n) > len(self.free_blocks):
                break
            i = self.waiting.popleft()
            self._grow(r, n)
            self._take_slot(r)
            self.running.append(i)
            admitted.append(i)
            tokens += n
        if admitted:
            return self._plan("prefill", admitted)
        if not self.running:
            if self.waiting:
                raise RuntimeError("a waiting request can never fit in the KV cache")
            return None
        while True:  # blocks for L + K tokens of every running request, preempting if short
            need = sum(
                self._blocks_needed(self.requests[i], len(self.requests[i].seq) + self.k)
                for i in self.running
            )
            if need <= len(self.free_blocks) or len(self.running) == 1:
                break
            self._preempt(self.running[-1])
        for i in self.running:
            self._grow(self.requests[i], len(self.requests[i].seq) + self.k)
        return self._plan("verify" if self.k else "decode", list(self.running))

    def _plan(self, kind: str, rows: list[int]) -> FakePlan:
        ids, pos, slots_map, cu, lens = [], [], [], [0], []
        for i in rows:
            r = self.requests[i]
            seq = r.seq
            if kind == "prefill":
                q_ids, start = seq, 0
            else:
                q_ids, start = [seq[-1]] + [0] * self.k, len(seq) - 1
            for j, t in enumerate(q_ids):
                p = start + j
                ids.append(t)
                pos.append(p)
                block = r.blocks[p // self.block_size]
                slots_map.append(block * self.block_size + p % self.block_size)
            cu.append(cu[-1] + len(q_ids))
            lens.append(start + len(q_ids))
        width = max(len(self.requests[i].blocks) for i in rows)
        tables = np.zeros((len(rows), width), dtype=np.int32)
        for row, i in enumerate(rows):
            tables[row, : len(self.requests[i].blocks)] = self.requests[i].blocks
        reqs = [self.requests[i] for i in rows]
        cu_np = np.array(cu, dtype=np.int32)
        self._rows = rows
        self._kind = kind
        self.plans += 1
        self.plan_kinds[kind] += 1
        return FakePlan(
            kind=kind,
            num_seqs=len(rows),
            num_tokens=len(ids),
            request_slots=np.array([r.slot for r in reqs], dtype=np.int32),
            input_ids=np.array(ids, dtype=np.int64),
            positions=np.array(pos, dtype=np.int64),
            cu_seqlens_q=cu_np,
            seq_lens=np.array(lens, dtype=np.int32),
            block_tables=tables,
            slot_mapping=np.array(slots_map, dtype=np.int64),
            temperature=np.array([r.temperature for r in reqs], dtype=np.float32),
            top_p=np.array([r.top_p for r in reqs], dtype=np.float32),
            top_k=np.array([r.top_k for r in reqs], dtype=np.int32),
            seeds=np.array([r.seed for r in reqs], dtype=np.int64),
            num_generated=np.array([len(r.outputs) for r in reqs], dtype=np.int32),
            max_seqlen_q=int(np.diff(cu_np).max()),
            max_seqlen_k=max(lens),
        )

    # ---- commit --------------------------------------------------------------------------------

    def commit(self, tokens, num_tokens, num_accepted=None) -> None:
        assert len(num_tokens) == len(self._rows) and int(np.sum(num_tokens)) == len(tokens)
        assert all(1 <= n <= self.k + 1 for n in num_tokens)
        if num_accepted is not None and self._kind == "verify":
            self.accept_log.append(np.asarray(num_accepted).copy())
        off = 0
        for row, i in enumerate(list(self._rows)):
            r = self.requests[i]
            n = int(num_tokens[row])
            for t in tokens[off : off + n]:
                r.outputs.append(int(t))
                if int(t) in self.eos:
                    r.finish = "stop"
                elif len(r.outputs) >= r.max_new_tokens or len(r.seq) >= self.max_model_len:
                    r.finish = "length"
                if r.finish:
                    break
            off += n
            if num_accepted is not None:
                r.accepted += int(num_accepted[row])
            if r.finish:
                self._release(i)
        self._rows = []

    def run(self, worker, max_steps: int = 100_000) -> list[list[int]]:
        """Drives `worker.step` until every request finished; returns outputs per request."""
        for _ in range(max_steps):
            plan = self.next_plan()
            if plan is None:
                return [r.outputs for r in self.requests]
            if plan.kind == "verify":
                self.verify_plans += 1
            self.commit(*worker.step(plan))
        raise RuntimeError("fake scheduler: too many steps")
