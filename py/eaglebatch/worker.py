"""The worker: owns the weights, the paged KV cache and sampling; turns a StepPlan into tokens.

It keeps no per-request state of its own (plain decoding) but a hybrid model's recurrent
states, per request slot, which the scheduler's plans say how to restore and save
(`prepare_states`); everything else about requests lives in the Rust scheduler. Inputs arrive
as numpy arrays and are moved to the device once per step.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from eaglebatch.attention import (
    AttentionMetadata,
    allocate_kv_cache,
    get_backend,
    kv_cache_bytes_per_block,
)
from eaglebatch.attention.base import copy_blocks, kv_layer_bytes_per_block
from eaglebatch.cpu import accelerate
from eaglebatch.cpu.allocator import keep_freed_memory
from eaglebatch.cpu.bf16_rows import use_bf16_rows
from eaglebatch.cpu.gguf_blocks import checkpoint
from eaglebatch.cpu.quantized import QuantizedWeight, use_quantized_weights
from eaglebatch.cpu.stored import load_stored, stored_names
from eaglebatch.cpu.threads import join as join_workers
from eaglebatch.cpu.threads import set_threads
from eaglebatch.errors import JobError
from eaglebatch.graphs import (
    GraphPool,
    StaticMeta,
    bucket_for,
    capture_sizes,
    fill_rows,
    graph_reserve_bytes,
)
from eaglebatch.job.config import EngineConfig, JobConfig
from eaglebatch.job.engine_settings import EngineSettings
from eaglebatch.job.model_files import ModelFiles
from eaglebatch.job.state_budget import StatePlan, check_states_fit, state_plan
from eaglebatch.model.causal_lm import CausalLM
from eaglebatch.model.config import ModelConfig
from eaglebatch.model.recurrent_state import StepContext
from eaglebatch.pooled import pooled_sums
from eaglebatch.sampling.logits_processing import NO_TOKEN, LogitsControls, without_dead_rows
from eaglebatch.sampling.logprobs import (
    distribution,
    prompt_logprobs,
    top_logprobs,
    top_logprobs_on_device,
    wanted,
)
from eaglebatch.sampling.sampler import sample
from eaglebatch.transfer import HostCopy, to_device


def _use_stored(
    model: CausalLM,
    stored: tuple[str, dict[str, QuantizedWeight]],  # cpu/stored.py's load_stored
    threads: int,
    unloaded: frozenset[str],
    int8: bool = False,
) -> str:
    """Swaps the weights read as the checkpoint stores them in (cpu/quantized.py), which must
    replace every weight left `unloaded`; returns what the weights are. int8: the block
    formats' products quantize x to 8 bits (engine.activations)."""
    label, blocks = stored
    names = use_quantized_weights(model, blocks, threads, int8)
    if missing := sorted(unloaded - set(names)):  # the checkpoint changed under this run
        raise RuntimeError(f"weights: nothing replaced the unloaded {missing[:3]}")
    kinds = Counter(blocks[n].type_name for n in names)
    size = sum(blocks[n].blocks.numel() for n in names) / 2**20
    rest = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    kinds_text = ", ".join(f"{c} x {k}" for k, c in sorted(kinds.items()))
    acts = ", int8 activations" if int8 else ""
    return f"{label} ({kinds_text}: {size:.0f} MiB{acts}) + {rest:.0f} MiB float32"


def _weights_line(model: torch.nn.Module) -> str:
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return f"{dtype} ({size:.0f} MiB)"


@dataclass(frozen=True)
class KvBudget:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    sized_by: str = "engine.kv_cache_tokens"  # the rule that sized it (the memory line)
    states: StatePlan | None = None  # a hybrid model's recurrent-state pool, counted first

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size


# The CPU default cache (engine.kv_cache_tokens unset) holds what the job can use at once:
# each of its sequences a prompt of up to PROMPT_ALLOWANCE tokens plus max_new_tokens, and
# PREFIX_ROOM more for the blocks the prefix cache keeps after their rows finished.
PROMPT_ALLOWANCE = 1024
PREFIX_ROOM = 0.25


@dataclass(frozen=True)
class JobKv:
    """What the job can use at once: `sequences` of up to `tokens_each`, `room` more."""

    sequences: int
    tokens_each: int
    room: float

    @property
    def tokens(self) -> int:
        return math.ceil(self.sequences * self.tokens_each * (1 + self.room))

    def describe(self) -> str:
        room = f" + {self.room:.0%}" if self.room else ""
        return f"the job's {self.sequences} sequences x {self.tokens_each} tokens{room}"


def job_kv(job: JobConfig, settings: EngineSettings, requests: int | None) -> JobKv:
    """The CPU default's size: min(max_batch_size, `requests`) sequences (`requests`: samples
    to generate, None when unknown) of min(max_model_len, PROMPT_ALLOWANCE + max_new_tokens)
    tokens plus the speculative lookahead, PREFIX_ROOM more with prefix caching. max_new_tokens
    is max_model_len where a sampling column sets rows' own, 0 for scoring tasks."""
    eng, max_len = job.engine, settings.max_model_len
    if job.task != "generate":
        new = 0
    elif "max_new_tokens" in job.input.sampling_columns:
        new = max_len
    else:
        new = job.sampling.max_new_tokens
    seqs = eng.max_batch_size if requests is None else max(1, min(eng.max_batch_size, requests))
    each = min(max_len, PROMPT_ALLOWANCE + new) + settings.max_draft_tokens
    return JobKv(seqs, each, PREFIX_ROOM if eng.prefix_caching else 0.0)


def plan_kv_budget(
    eng: EngineConfig,
    cfg: ModelConfig,
    max_seq_tokens: int,
    dtype: torch.dtype,
    device,
    extra_kv_layers: int = 0,
    reserve_bytes: int = 0,
    job: JobKv | None = None,
    states: StatePlan | None = None,
) -> KvBudget:
    """Blocks for the KV cache: `kv_cache_tokens` if set, else a fraction of free memory (less
    `reserve_bytes`, the CUDA graph pool), never more than max_batch_size full-length sequences
    can use (`max_seq_tokens`: max_model_len plus the speculative lookahead, the most KV slots
    one sequence holds; the scheduler turns a row that may need more into an error row), and
    on the CPU never more than `job` (what the job can use at once, `job_kv`), though at least
    one full-length sequence. `extra_kv_layers` (a draft head's layers over the same blocks)
    count in the bytes per block. The cache itself gets one block more: the pad block of
    graph steps. A hybrid model's recurrent-state pool (`states`) comes out of the memory
    first: a pool that does not fit is a JobError naming engine.max_batch_size."""
    draft_layer = kv_layer_bytes_per_block(cfg.num_key_value_heads, cfg.head_dim,
                                           eng.block_size, dtype)  # fmt: skip
    per_block = kv_cache_bytes_per_block(cfg, eng.block_size, dtype)
    per_block += draft_layer * extra_kv_layers
    if states is not None:
        usable = int(_free_memory(device) * eng.kv_cache_memory_fraction) - reserve_bytes
        check_states_fit(states, usable, f"engine.kv_cache_memory_fraction "
                                         f"{eng.kv_cache_memory_fraction} of the free memory")
        reserve_bytes += states.nbytes
    if eng.kv_cache_tokens is not None:
        blocks = math.ceil(eng.kv_cache_tokens / eng.block_size)
        if blocks < 1:
            raise JobError("engine.kv_cache_tokens: the KV budget is smaller than one block")
        return KvBudget(blocks, eng.block_size, per_block, states=states)
    blocks, sized_by = _default_blocks(eng, device, per_block, max_seq_tokens, reserve_bytes, job)
    if blocks < 1:
        pool = " beyond the CUDA graph pool" if reserve_bytes else ""
        raise JobError(
            f"engine.kv_cache_memory_fraction: {eng.kv_cache_memory_fraction} of the free "
            f"memory holds less than one KV block ({per_block} bytes{pool}); raise it or set "
            f"engine.kv_cache_tokens"
        )
    return KvBudget(blocks, eng.block_size, per_block, sized_by, states)


def _free_memory(device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def _default_blocks(eng: EngineConfig, device, per_block: int, max_seq_tokens: int,
                    reserve_bytes: int, job: JobKv | None) -> tuple[int, str]:  # fmt: skip
    """engine.kv_cache_tokens unset: (blocks, the rule that bound them), `plan_kv_budget`."""
    usable = int(_free_memory(device) * eng.kv_cache_memory_fraction) - reserve_bytes
    by_memory = usable // per_block
    useful = eng.max_batch_size * math.ceil(max_seq_tokens / eng.block_size)
    rules = [(by_memory, "engine.kv_cache_memory_fraction"),
             (useful, f"max_batch_size x {max_seq_tokens} tokens")]  # fmt: skip
    if job is not None and device.type == "cpu":
        rules.append((math.ceil(job.tokens / eng.block_size), job.describe()))
        if job.tokens < max_seq_tokens:  # one full-length row always fits
            rules[-1] = (math.ceil(max_seq_tokens / eng.block_size),
                         f"one sequence of {max_seq_tokens} tokens, the longest")  # fmt: skip
    return min(rules, key=lambda r: r[0])


def plan_metadata(plan, block_size: int, device: torch.device) -> AttentionMetadata:
    """Attention metadata for the query a scheduler plan spells out."""
    return AttentionMetadata.from_numpy(
        plan.cu_seqlens_q, plan.seq_lens, plan.block_tables, plan.slot_mapping, block_size, device
    )


def check_graph_support(worker, mode: str) -> None:
    """Graphs need a backend that says it can run inside them and a KV cache with a pad block."""
    if mode == "off":
        return
    backend = worker.model.backend
    if not backend.supports_cuda_graphs:
        raise JobError(f"engine.cuda_graph: attention backend {backend.name!r} cannot run "
                       "inside CUDA graphs; set engine.cuda_graph: false")
    if worker.kv_caches[0].shape[1] <= worker.budget.num_blocks:
        raise ValueError("graph steps need a KV cache with one block beyond the budget")


def sampling_tensors(plan, device: torch.device) -> tuple[torch.Tensor, ...]:
    """temperature (float32), top_p (float32), top_k (int32), seeds (int64), num_generated
    (int32) of a plan's rows [B], on `device` (on the CPU the plan's own arrays: no .to())."""
    arrays = (plan.temperature, plan.top_p, plan.top_k, plan.seeds, plan.num_generated)
    return tuple(to_device(a, device) for a in arrays)


def sample_rows(worker, plan, logits: torch.Tensor, sampling: tuple[torch.Tensor, ...],
                on_device: bool = False):
    """One token per row from logits [B, V] after the plan's logits controls (min tokens,
    penalties), and the rows' logprobs when the plan asks for them: (tokens int64 [B], the
    logprobs `Scheduler.commit` takes, or None; `on_device`: those as device tensors)."""
    controls = LogitsControls.from_plan(plan, logits.device)
    processed = dead = None
    if controls is not None:  # [B, V]; a row left with no token reports NO_TOKEN
        processed, dead = without_dead_rows(controls.apply(logits[:, None])[:, 0])
    host = (plan.temperature, plan.top_p, plan.top_k)  # which rows sample, known on the host
    tokens = sample(logits if processed is None else processed, *sampling, host=host)  # [B]
    k = wanted(plan)
    logprobs = None
    if k > 0:
        temperature, top_p, top_k = sampling[:3]
        lp = distribution(logits, processed, temperature, top_k, top_p, worker.logprobs_mode)
        logprobs = (top_logprobs_on_device if on_device else top_logprobs)(lp, tokens, k)
    if dead is not None:
        tokens = torch.where(dead, NO_TOKEN, tokens)
    return tokens, logprobs


@dataclass(frozen=True)
class Launched:
    """A step queued on the device (Worker.launch): its tokens there and on their way up."""

    tokens: torch.Tensor  # int64 [B] on the device
    host: HostCopy  # int32 [B]
    logprobs: tuple[HostCopy, ...] | None  # Scheduler.commit's logprobs, when a row asks
    prompt_logprobs: object | None
    pooled: HostCopy | None = None  # a pooled task's contributions (pooled.py)


def fill_placeholders(ids: torch.Tensor, plan, prev: Launched | None) -> None:
    """Writes into `ids` [>= T] (the plan's input_ids on the device) each placeholder's token:
    row i's last query token is prev.tokens[plan.prev_rows[i]] where prev_rows[i] >= 0. (On
    the CPU `ids` may share the plan's own array, which then holds those tokens too.)"""
    rows = plan.prev_rows
    waiting = rows >= 0
    if not waiting.any():
        return
    if prev is None:
        raise RuntimeError("a plan with placeholders needs the launched step before it")
    at = plan.cu_seqlens_q[1:][waiting] - 1  # [R] each waiting row's last query token
    src = to_device(rows[waiting], ids.device, np.int64)
    ids[to_device(at, ids.device, np.int64)] = prev.tokens.index_select(0, src)


class Worker:
    # What sampling needs of the job (from_job sets it): which distribution logprobs report
    # (logprobs.py). The ids min_new_tokens masks are each row's, in the plan.
    logprobs_mode: str = "raw"
    # plain decoding plans plain steps anyway (`SpecWorker.plain_steps`)
    plain_steps: bool = False
    # what the weights are and the CPU threads (from_job sets them; the run's stats report them)
    weights: str | None = None
    threads: int | None = None
    # a pooled task's head (job/pooling.py PoolSpec; the runner sets it for each job): its
    # steps return pooled contributions and sample nothing
    pool = None

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        budget: KvBudget,
        max_model_len: int,
        graph_reserve_bytes: int = 0,
    ) -> None:
        """graph_reserve_bytes: what the KV budget set aside for CUDA-graph pools (reported)."""
        self.model = model
        self.kv_caches = kv_caches
        self.budget = budget
        self.max_model_len = max_model_len
        self.device = model.device
        self.graph_reserve_bytes = graph_reserve_bytes
        self.graphs: GraphPool | None = None  # enable_graphs
        self._decode: dict[int, tuple] = {}  # padded batch -> (backend state, CapturedStep)

    @property
    def num_blocks(self) -> int:
        return self.budget.num_blocks

    @property
    def pad_block(self) -> int:
        """The block after the scheduler's: padding rows of graph steps write only there."""
        return self.budget.num_blocks

    def graph_stats(self) -> dict | None:
        return None if self.graphs is None else self.graphs.stats.as_dict()

    def draft_stats(self) -> dict | None:
        return None  # plain decoding drafts nothing

    @property
    def state_plan(self):
        """A hybrid model's recurrent-state pool (job/state_budget.py StatePlan), else None."""
        return self.budget.states

    @property
    def target(self) -> Worker:
        """The worker of the target model: this one (a SpecWorker's is the Worker it wraps)."""
        return self

    def bind(self, scheduler) -> None:
        """Takes what the worker needs of the scheduler that plans its steps: plain decoding,
        nothing (a SpecWorker, its grammar hook)."""

    def enable_graphs(self, mode: str, max_batch_size: int) -> None:
        """Captures plain decode (1 token per row) per padded batch size. mode: "cuda" (CUDA
        graphs), "eager" (the same static-buffer steps, run eagerly: CPU tests) or "off"."""
        check_graph_support(self, mode)
        if mode == "off" or self.model.states is not None:
            return  # a hybrid model's steps stay eager (engine_settings.resolve_graph_mode)
        backend = self.model.backend
        sizes = capture_sizes(max_batch_size)
        max_blocks = math.ceil(self.max_model_len / self.budget.block_size)
        self._meta = StaticMeta(max(sizes), 1, max_blocks, self.budget.block_size,
                                self.pad_block, self.device)
        self._ids = torch.zeros(max(sizes), dtype=torch.long, device=self.device)  # [B]
        self._pos = torch.zeros(max(sizes), dtype=torch.long, device=self.device)  # [B]
        self.graphs = GraphPool(mode, sizes, self.device)
        self.graphs.stats.reserved_bytes = self.graph_reserve_bytes
        with torch.inference_mode(), self.graphs as pool:
            for bp in reversed(sizes):  # largest first: smaller graphs reuse its pool memory
                meta = self._meta.view(bp)
                state = backend.make_graph_state(bp, 1, max_blocks, self.device)
                backend.prepare_graph(meta, state)
                self._decode[bp] = (state, pool.capture(lambda bp=bp, m=meta: self._hidden(bp, m)))

    def _hidden(self, bp: int, meta: AttentionMetadata) -> torch.Tensor:  # [bp, H]
        # the graph ends at the hidden states: every graph keeps its output alive, and [bp, V]
        # float32 logits per bucket would add up; the LM head runs eagerly on the real rows
        return self.model(self._ids[:bp], self._pos[:bp], meta, self.kv_caches)

    def _decode_logits(self, plan, prev: Launched | None = None) -> torch.Tensor | None:
        """Logits [B, V] of a decode plan through its graph, or None (not a graph step)."""
        b = plan.num_seqs
        if self.graphs is None or int(plan.cu_seqlens_q[-1]) != b:
            return None
        bp = bucket_for(b, self.graphs.sizes)
        if bp is None:
            self.graphs.stats.eager_steps += 1
            return None
        meta = self._meta.fill(bp, plan.seq_lens, plan.block_tables, plan.slot_mapping)
        fill_rows(self._ids, plan.input_ids.astype(np.int64), bp)
        fill_placeholders(self._ids, plan, prev)
        fill_rows(self._pos, plan.positions.astype(np.int64), bp)
        state, step = self._decode[bp]
        self.model.backend.prepare_graph(meta, state)
        self.graphs.stats.replays += 1
        return self.model.compute_logits(step()[:b])

    @classmethod
    def from_job(
        cls, job: JobConfig, mf: ModelFiles, settings: EngineSettings, extra_kv_layers: int = 0,
        graph_rows: int = 0, graph_q: int = 1, job_tokens: JobKv | None = None,
    ) -> Worker:
        """The job's model on `settings` (PreparedJob.engine). `graph_rows` x `graph_q`:
        sequences x query tokens of the largest CUDA-graph step that will be captured (its pool
        is reserved out of the KV budget); 0 rows = no graphs. `job_tokens`: what the job can
        use of the KV cache at once (`job_kv`; None: the free-memory rule alone)."""
        eng = job.engine
        device, dtype, max_model_len = settings.device, settings.dtype, settings.max_model_len
        if eng.num_threads is None and device.type == "cpu":
            join_workers()  # before the load: workers started together see each other
        if device.type == "cpu":
            keep_freed_memory()  # a step's activations reuse the last step's pages
        try:
            cfg = ModelConfig.from_dir(mf.dir)
        except ValueError as e:
            raise JobError(f"model: {mf.dir}: {e}") from None
        backend = get_backend(settings.attention_backend)
        blocks = settings.quantized
        ck = checkpoint(mf.gguf, cfg) if mf.gguf is not None else None
        # the float32 parameters of weights read as stored are never filled (not resident)
        skip = stored_names(mf.dir, cfg, ck) if blocks else frozenset()
        model = CausalLM.from_pretrained(
            mf.dir, dtype=dtype, device=device, backend=backend, max_positions=max_model_len,
            skip=skip, gguf=ck,
        )
        threads = set_threads(eng.num_threads, device)
        gemm_threads = torch.get_num_threads() if settings.cpu_gemm else 0
        accelerate(model, gemm_threads)  # a float32 CPU run: the CPU fast path
        use_bf16_rows(model, torch.get_num_threads() if settings.bf16_rows else 0)
        if blocks:
            weights = _use_stored(model, load_stored(mf.dir, cfg, ck), gemm_threads, skip,
                                  settings.int8_activations)  # fmt: skip
        else:
            weights = _weights_line(model)
        reserve = 0
        if graph_rows and device.type == "cuda":
            itemsize = torch.empty((), dtype=dtype).element_size()
            reserve = graph_reserve_bytes(cfg, graph_rows, graph_q, max_model_len, itemsize)
        seq_tokens = max_model_len + settings.max_draft_tokens
        budget = plan_kv_budget(eng, cfg, seq_tokens, dtype, device, extra_kv_layers, reserve,
                                job_tokens, state_plan(eng, cfg))  # fmt: skip
        if budget.states is not None:
            model.attach_states(budget.states.slots, budget.states.checkpoints)
        kv = allocate_kv_cache(cfg, budget.num_blocks + 1, budget.block_size, dtype, device)
        worker = cls(model, kv, budget, max_model_len, graph_reserve_bytes=reserve)
        worker.logprobs_mode = job.output.logprobs_mode
        worker.weights = weights
        worker.threads = threads
        return worker

    def step(self, plan) -> tuple:
        """Runs one plan; returns (tokens int32 [B], num_tokens int32 [B]) — one token per row —
        and, when a row asks for logprobs or prompt logprobs, (None, logprobs, prompt logprobs)
        after them (`Scheduler.commit`)."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan, prev: Launched | None = None) -> Launched:
        """Queues one plan's step on the device without waiting for it (CUDA). `prev`: the
        launched step before it, whose sampled tokens fill the plan's placeholders (prev_rows,
        a plan from Scheduler.next_plan_ahead)."""
        dev = self.device
        if self.pool is not None:
            return self._launch_pooled(plan)
        copy_blocks(self.kv_caches, plan.block_copies)  # forked samples' partial blocks
        self.prepare_states(plan)
        prompt = bool(plan.prompt_logprobs.any())  # needs every query position's hidden state
        logits = None if prompt else self._decode_logits(plan, prev)  # [B, V] or None
        prompt_lps = None
        if logits is None:
            meta = plan_metadata(plan, self.budget.block_size, dev)
            self.model.backend.prepare(meta)
            input_ids = to_device(plan.input_ids, dev)  # [T]
            fill_placeholders(input_ids, plan, prev)
            positions = to_device(plan.positions, dev)  # [T]
            hidden = self.model(input_ids, positions, meta, self.kv_caches)  # [T, H]
            last = to_device(plan.cu_seqlens_q[1:] - 1, dev, np.int64)  # [B]
            logits = self.model.compute_logits(hidden.index_select(0, last))  # [B, V]
            if prompt:
                prompt_lps = prompt_logprobs(self.model.compute_logits, hidden, plan)
        sampling = sampling_tensors(plan, dev)
        tokens, logprobs = sample_rows(self, plan, logits, sampling, on_device=True)
        if logprobs is not None:
            logprobs = tuple(HostCopy(t) for t in logprobs)
        # the device's tokens feed the next plan's placeholders: a real id where none was
        # allowed (that row ends at the commit, its placeholder unused)
        return Launched(tokens.clamp(min=0), HostCopy(tokens.to(torch.int32)), logprobs,
                        prompt_lps)  # fmt: skip

    def prepare_states(self, plan, lengths: list[int] | None = None,
                       keep: bool = False) -> StepContext | None:  # fmt: skip
        """A hybrid model's recurrent states before `plan`'s forward: each row's slot restored
        as the plan's `state_from` says, and the step's context (model/recurrent_state.py).
        `lengths`: the query lengths the forward runs where they are not the plan's (a verify
        round narrower than the plan); `keep`: every row in the step form, keeping the state
        after each position (a verify: `keep_accepted` after acceptance). None: no states."""
        states = self.model.states
        if states is None:
            return None
        slots = plan.request_slots.tolist()
        states.restore(slots, plan.state_from.tolist())
        ctx = StepContext.of_plan(plan, states.slots, keep)
        if lengths is not None:
            ctx.lengths, ctx.chunked = list(lengths), [n > 1 and not keep for n in lengths]
        states.context = ctx
        return ctx

    def _launch_pooled(self, plan) -> Launched:
        """A pooled task's step (pooled.py): the rows' contributions, no token sampled (each
        row's token is 0: a pooled row finishes when its prompt is computed)."""
        dev, spec = self.device, self.pool
        copy_blocks(self.kv_caches, plan.block_copies)  # none: pooled rows never fork
        self.prepare_states(plan)  # a hybrid model's recurrent states
        meta = plan_metadata(plan, self.budget.block_size, dev)
        self.model.backend.prepare(meta)
        input_ids = to_device(plan.input_ids, dev)  # [T]
        positions = to_device(plan.positions, dev)  # [T]
        hidden = self.model(input_ids, positions, meta, self.kv_caches)  # [T, H]
        sums = pooled_sums(self.model, hidden, plan, spec.pooling, spec.head_outputs > 0)
        tokens = torch.zeros(plan.num_seqs, dtype=torch.int64, device=dev)
        return Launched(tokens, HostCopy(tokens.to(torch.int32)), None, None, HostCopy(sums))

    @staticmethod
    def collect(launched: Launched) -> tuple:
        """What `Scheduler.commit` takes of a launched step (waits for its tokens)."""
        out = launched.host.numpy()
        ones = np.ones(len(out), dtype=np.int32)
        if launched.pooled is not None:
            return out, ones, None, None, None, launched.pooled.numpy()
        if launched.logprobs is None and launched.prompt_logprobs is None:
            return out, ones
        logprobs = None if launched.logprobs is None else tuple(
            h.numpy() for h in launched.logprobs)
        return out, ones, None, logprobs, launched.prompt_logprobs
