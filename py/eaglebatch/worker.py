"""The worker: owns the weights, the paged KV cache and sampling; turns a StepPlan into tokens.

It keeps no per-request state of its own (plain decoding); everything about requests lives in
the Rust scheduler. Inputs arrive as numpy arrays and are moved to the device once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionMetadata, allocate_kv_cache, get_backend, kv_cache_bytes_per_block
from .config import EngineConfig, JobConfig, JobError
from .model.config import ModelConfig
from .model.llama import LlamaForCausalLM
from .model_files import ModelFiles
from .sampling import sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise JobError("engine.device: 'cuda' requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "torch"  # flashinfer joins the registry in its own module (GPU issue)
    if name == "flashinfer" and device.type != "cuda":
        raise JobError("engine.attention_backend: 'flashinfer' needs engine.device cuda")
    return name


@dataclass(frozen=True)
class KvBudget:
    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_kv_budget(
    eng: EngineConfig,
    cfg: ModelConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device,
    extra_kv_layers: int = 0,
) -> KvBudget:
    """Blocks for the KV cache: `kv_cache_tokens` if set, else a fraction of free memory, never
    more than max_batch_size full-length sequences can use. `extra_kv_layers` (a draft head's
    layers over the same blocks) count in the bytes per block."""
    per_layer = kv_cache_bytes_per_block(cfg, eng.block_size, dtype) // cfg.num_hidden_layers
    per_block = per_layer * (cfg.num_hidden_layers + extra_kv_layers)
    useful = eng.max_batch_size * math.ceil(max_model_len / eng.block_size)
    if eng.kv_cache_tokens is not None:
        blocks = math.ceil(eng.kv_cache_tokens / eng.block_size)
    else:
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            import psutil

            free = psutil.virtual_memory().available
        blocks = min(int(free * eng.kv_cache_memory_fraction) // per_block, useful)
    if blocks < 1:
        raise JobError("engine.kv_cache_tokens: the KV budget is smaller than one block")
    return KvBudget(num_blocks=blocks, block_size=eng.block_size, bytes_per_block=per_block)


class Worker:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        budget: KvBudget,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.budget = budget
        self.max_model_len = max_model_len
        self.device = model.device

    @property
    def num_blocks(self) -> int:
        return self.budget.num_blocks

    @classmethod
    def from_job(cls, job: JobConfig, mf: ModelFiles, extra_kv_layers: int = 0) -> Worker:
        eng = job.engine
        if eng.num_threads is not None:
            torch.set_num_threads(eng.num_threads)
        device = resolve_device(eng.device)
        dtype = resolve_dtype(eng.dtype, device)
        try:
            cfg = ModelConfig.from_dir(mf.dir)
        except ValueError as e:
            raise JobError(f"model: {mf.dir}: {e}") from None
        max_model_len = eng.max_model_len or cfg.max_model_len
        if max_model_len > cfg.max_model_len:
            raise JobError(
                f"engine.max_model_len: {max_model_len} exceeds the model's "
                f"{cfg.max_model_len} positions"
            )
        backend = get_backend(resolve_backend(eng.attention_backend, device))
        model = LlamaForCausalLM.from_pretrained(
            mf.dir, dtype=dtype, device=device, backend=backend, max_positions=max_model_len
        )
        budget = plan_kv_budget(eng, cfg, max_model_len, dtype, device, extra_kv_layers)
        kv = allocate_kv_cache(cfg, budget.num_blocks, budget.block_size, dtype, device)
        return cls(model, kv, budget, max_model_len)

    @torch.inference_mode()
    def step(self, plan) -> tuple[np.ndarray, np.ndarray]:
        """Runs one plan; returns (tokens int32 [B], num_tokens int32 [B]) — one token per row."""
        dev = self.device
        meta = AttentionMetadata.from_numpy(
            plan.cu_seqlens_q,
            plan.seq_lens,
            plan.block_tables,
            plan.slot_mapping,
            self.budget.block_size,
            dev,
        )
        self.model.backend.prepare(meta)
        input_ids = torch.from_numpy(plan.input_ids).to(dev)  # [T]
        positions = torch.from_numpy(plan.positions).to(dev)  # [T]
        hidden = self.model(input_ids, positions, meta, self.kv_caches)  # [T, H]
        last = torch.from_numpy(plan.cu_seqlens_q[1:].astype(np.int64) - 1).to(dev)  # [B]
        logits = self.model.compute_logits(hidden.index_select(0, last))  # [B, V]
        tokens = sample(
            logits,
            torch.from_numpy(plan.temperature).to(dev),
            torch.from_numpy(plan.top_p).to(dev),
            torch.from_numpy(plan.top_k).to(dev),
            torch.from_numpy(plan.seeds).to(dev),
            torch.from_numpy(plan.num_generated).to(dev),
        )
        out = tokens.to(torch.int32).cpu().numpy()
        return out, np.ones(len(out), dtype=np.int32)
