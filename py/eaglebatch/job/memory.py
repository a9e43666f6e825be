"""The memory a CPU run will take, said before the model loads and refused (JobError, exit 2)
when it cannot fit, instead of the kernel killing the process mid-run.

Three parts, from headers and the job alone (nothing is loaded):
- the model: every checkpoint tensor at the run's dtype, but those read as stored
  (engine.weights: quantized: GGUF blocks, bf16/fp16 floats), which count their bytes;
- the KV cache: engine.kv_cache_tokens at the run's dtype; unset, what the worker will take
  (worker.plan_kv_budget): kv_cache_memory_fraction of the available memory, at most
  max_batch_size whole sequences and, on the CPU, at most what the job can use at once;
- a hybrid model's recurrent states (job/state_budget.py): a fixed pool per request slot and
  prefix-cache checkpoint, counted before the KV cache;
- working buffers: one step's activations (max_num_batched_tokens rows through the widest
  layer, a few copies) and logits (max_batch_size rows x vocab, float32, x2 for sampling).
Available: the system's available memory, capped by the cgroup memory limit less its usage.
The estimate leaves out the interpreter and libraries (a few hundred MB), said in the line.

A mixture-of-experts model's experts read as stored are pages of the file's memory map: the
line states them apart from the weights every step reads, with what one token reads of them
(its top k of each layer's experts); they still count in the model's figure, since a run
routes tokens to every expert sooner or later and pages evicted under pressure would be read
from disk again at every step that needs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from eaglebatch.errors import JobError
from eaglebatch.job.state_budget import StatePlan
from eaglebatch.model.expert_layout import EXPERT_PARAMETER

GIB = 1 << 30


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class MemoryPlan:
    model_bytes: int
    kv_bytes: int
    kv_key: str  # the rule that sized the cache (KvBudget.sized_by)
    buffer_bytes: int
    available_bytes: int
    experts: MappedExperts | None = None  # an MoE model's experts read as stored
    states: StatePlan | None = None  # a hybrid model's recurrent states (job/state_budget.py)

    @property
    def state_bytes(self) -> int:
        return 0 if self.states is None else self.states.nbytes

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.kv_bytes + self.state_bytes + self.buffer_bytes

    def _model(self) -> str:
        if self.experts is None:
            return _gib(self.model_bytes)
        rest = _gib(self.model_bytes - self.experts.nbytes)
        return f"{_gib(self.model_bytes)} ({rest} read every step + {self.experts.describe()})"

    def describe(self) -> str:
        kv = f"{_gib(self.kv_bytes)} ({self.kv_key})"
        if self.states is not None:
            kv += f" + {self.states.describe()}"
        return (f"model {self._model()} + KV cache {kv} + buffers "
                f"{_gib(self.buffer_bytes)} of {_gib(self.available_bytes)} available "
                f"(plus the runtime's few hundred MB)")  # fmt: skip


@dataclass(frozen=True)
class MappedExperts:
    """The experts' weights read as stored (mapped file pages): `nbytes` over `per_layer`
    experts per sparse layer, of which a token reads `top_k`."""

    nbytes: int
    per_layer: int
    top_k: int

    def describe(self) -> str:
        token = self.nbytes * self.top_k // self.per_layer
        return (f"experts {_gib(self.nbytes)} as mapped file pages, of which a token reads its "
                f"{self.top_k} of {self.per_layer} per layer, {_gib(token)}")  # fmt: skip


def mapped_experts(blocks: dict[str, int], cfg) -> MappedExperts | None:
    """The experts among `blocks` (name -> bytes of a weight read as stored); None when the
    model has none read as stored."""
    nbytes = sum(b for n, b in blocks.items() if EXPERT_PARAMETER.match(n))
    if not nbytes:
        return None
    return MappedExperts(nbytes, cfg.num_experts, cfg.num_experts_per_tok)


def _cgroup_memory_left(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """A cgroup memory limit less its usage (v2 memory.max, v1 memory.limit_in_bytes); None
    when unlimited or unreadable."""
    files = [("memory.max", "memory.current"),
             ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")]  # fmt: skip
    for limit, usage in files:
        try:
            cap = int((root / limit).read_text().strip())
            used = int((root / usage).read_text().strip())
        except (OSError, ValueError):
            continue
        if cap < 1 << 60:  # v1 writes a huge number for "no limit"
            return max(0, cap - used)
    return None


def available_memory() -> int:
    import psutil

    free = psutil.virtual_memory().available
    left = _cgroup_memory_left()
    return free if left is None else min(free, left)


def model_bytes(shapes: dict[str, tuple[int, ...]], itemsize: int,
                blocks: dict[str, int]) -> int:  # fmt: skip
    """Bytes of the checkpoint `shapes` at `itemsize`, but `blocks` (name -> bytes of a weight
    read as stored: GGUF blocks, 16-bit floats) counted as stored."""
    total = sum(blocks.values())
    return total + sum(math.prod(s) * itemsize for n, s in shapes.items() if n not in blocks)


def buffer_bytes(cfg, max_tokens: int, max_batch: int, itemsize: int) -> int:
    """One step's activations and logits (module doc)."""
    layers = (cfg.heads_of(i) for i in range(cfg.num_hidden_layers))
    qkv = max((hq + 2 * hkv) * d for hq, hkv, d in layers)
    widest = max(cfg.hidden_size * 4, cfg.intermediate_size * 3, qkv)
    return max_tokens * widest * itemsize * 2 + max_batch * cfg.vocab_size * 4 * 2


def check(plan: MemoryPlan, kv_tokens: int | None, model: str) -> None:
    """Raises JobError naming the model or engine.kv_cache_tokens when `plan` cannot fit."""
    avail = plan.available_bytes
    if plan.model_bytes + plan.buffer_bytes > avail:
        experts = "" if plan.experts is None else (
            f" ({_gib(plan.experts.nbytes)} of them experts, mapped file pages that a run "
            "reads all of as it routes tokens)")  # fmt: skip
        raise JobError(
            f"model: {model} needs {_gib(plan.model_bytes)} of weights{experts} and "
            f"{_gib(plan.buffer_bytes)} of working buffers, and this machine has "
            f"{_gib(avail)} available: it cannot run here (a smaller or more quantized file "
            f"would; engine.max_num_batched_tokens and max_batch_size size the buffers)"
        )
    if plan.model_bytes + plan.buffer_bytes + plan.state_bytes > avail:
        raise JobError(
            f"engine.max_batch_size: with the model ({_gib(plan.model_bytes)}) and buffers "
            f"({_gib(plan.buffer_bytes)}), {plan.states.describe()} are more than the "
            f"{_gib(avail)} available; lower engine.max_batch_size"
        )
    if plan.total_bytes > avail and kv_tokens is not None and plan.kv_bytes:
        per_token = plan.kv_bytes / kv_tokens
        fits = int((avail - plan.model_bytes - plan.buffer_bytes) / per_token)
        raise JobError(
            f"engine.kv_cache_tokens: {kv_tokens} tokens take {_gib(plan.kv_bytes)}; with the "
            f"model ({_gib(plan.model_bytes)}) and buffers ({_gib(plan.buffer_bytes)}) that is "
            f"more than the {_gib(avail)} available: at most {fits} tokens fit (or leave it "
            f"unset to size the cache to the job and free memory)"
        )
