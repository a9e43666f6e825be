"""The engine section resolved once per process into `EngineSettings` (prepare.py): the
device, dtype, attention backend, graph mode, overlap, the CPU kernels and the weights the worker
will use, and W. Each `resolve_*` turns one `engine.*` key into what runs, or a JobError naming
the key where it cannot; nothing else re-resolves them (the worker, the scheduler's settings,
the step loop and Ray's actor placement read `PreparedJob.engine`)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eaglebatch.cpu import SMALL_GEMM_AVAILABLE
from eaglebatch.cpu.stored import has_stored_weights
from eaglebatch.errors import JobError
from eaglebatch.job.config import JobConfig
from eaglebatch.job.model_files import ModelFiles
from eaglebatch.model.config import ModelConfig


@dataclass(frozen=True)
class EngineSettings:
    device: torch.device
    dtype: torch.dtype
    attention_backend: str  # "cpu" | "torch" | "flashinfer"
    graph_mode: str  # "cuda" | "off"
    overlap: bool  # the step loop plans a step while one is in flight
    cpu_gemm: bool  # the native small GEMM runs the linears (threads: the worker's process's)
    bf16_rows: bool  # a bfloat16 CPU model's RMSNorms and RoPE run natively (cpu/bf16_rows.py)
    quantized: bool  # the CPU steps read the model's GGUF blocks
    int8_activations: bool  # ... and their products quantize x to 8 bits (engine.activations)
    max_model_len: int
    # W, the widest verify round (0 without a draft): K = speculative.num_steps, or prompt
    # lookup's width when larger (JobConfig.max_draft_tokens, the one rule)
    max_draft_tokens: int

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelWeights:
    """What the engine section's checks need of the model: where it is (for messages), whether
    it is a GGUF file, and whether its weights can be read as stored (asked only when the
    native kernels run: it reads safetensors headers)."""

    where: str
    gguf: bool
    stored: Callable[[], bool]
    uniform_heads: bool = True  # every layer has one (Hq, Hkv, D): flashinfer can serve it
    attention_sinks: bool = False  # flashinfer cannot serve attention sinks (gpt-oss)

    @classmethod
    def of(cls, mf: ModelFiles, cfg: ModelConfig) -> ModelWeights:
        """`cfg`: the model's config.json, parsed (its layers' head shapes)."""

        def stored() -> bool:
            try:
                return has_stored_weights(mf.dir, mf.gguf)
            except (OSError, ValueError):  # an unreadable checkpoint: its own check names it
                return False

        return cls(str(mf.dir), mf.gguf is not None, stored, uniform_heads(cfg),
                   cfg.attention_sinks)

    @classmethod
    def builtin(cls, name: str) -> ModelWeights:
        """A builtin model, unconverted: every builtin is a GGUF file (read as its blocks)."""
        return cls(f"{name} (builtin)", True, lambda: True)


def uniform_heads(cfg: ModelConfig) -> bool:
    """Whether every layer of the model has the same (Hq, Hkv, D)."""
    return len(set(map(cfg.heads_of, range(cfg.num_hidden_layers)))) == 1


def resolve_engine(job: JobConfig, mf: ModelFiles, cfg: ModelConfig) -> EngineSettings:
    """The job's engine section for this process's machine (cfg: the model's config.json,
    parsed once by the caller)."""
    section = _section(job, ModelWeights.of(mf, cfg))
    if cfg.linear_layers:  # a hybrid model's steps run eagerly
        section["graph_mode"] = hybrid_graph_mode(job.engine.cuda_graph)
    return EngineSettings(**section,
                          max_model_len=resolve_max_model_len(job.engine.max_model_len,
                                                              cfg.max_model_len))  # fmt: skip


def hybrid_graph_mode(flag: bool | None) -> str:
    """A hybrid (linear-attention) model has no graph steps: its recurrent states take a
    per-row form (chunked or recurrent) the captured steps do not; `cuda_graph: true` is
    refused, unset means off."""
    if flag:
        raise JobError("engine.cuda_graph: true is not supported for hybrid linear-attention "
                       "models (their steps run eagerly); leave it unset or false")
    return "off"


def check_engine(job: JobConfig, weights: ModelWeights) -> None:
    """Every check of `resolve_engine` but max_model_len's (which needs config.json), for a
    model that is not materialised (`validate` of a builtin): the same rules, run the same way."""
    _section(job, weights)


def _section(job: JobConfig, weights: ModelWeights) -> dict:
    """EngineSettings' fields but max_model_len: each engine key resolved, or JobError."""
    eng = job.engine
    device = resolve_device(eng.device)
    dtype = resolve_dtype(eng.dtype, device)
    threads = resolve_small_gemm(eng.cpu_gemm, device, dtype)
    quantized = resolve_weights(eng.weights, threads, weights)
    return dict(
        device=device,
        dtype=dtype,
        attention_backend=resolve_backend(eng.attention_backend, device,
                                          weights.uniform_heads, weights.attention_sinks),
        graph_mode=resolve_graph_mode(eng.cuda_graph, device),
        overlap=resolve_overlap(eng.overlap, device, job.draft is not None),
        cpu_gemm=threads > 0,
        bf16_rows=device.type == "cpu" and dtype == torch.bfloat16 and eng.cpu_gemm != "torch",
        quantized=quantized,
        int8_activations=resolve_activations(eng.activations, quantized, weights,
                                             _why_not_blocks(job, device, dtype, threads)),
        max_draft_tokens=job.max_draft_tokens,
    )  # fmt: skip


def _why_not_blocks(job: JobConfig, device: torch.device, dtype: torch.dtype,
                    threads: int) -> str:  # fmt: skip
    """Why a GGUF model's blocks are not what the CPU steps read (for int8's message)."""
    if device.type != "cpu":
        return f"the run is on {device.type}; blocks are read on the CPU"
    if dtype != torch.float32:
        return f"engine.dtype is {str(dtype).removeprefix('torch.')}; blocks are read in float32"
    if job.engine.cpu_gemm == "torch":
        return "engine.cpu_gemm is torch; blocks are read by the native kernels"
    if threads <= 0:
        return "this CPU lacks AVX-512F or AVX2+FMA, which the native kernels need"
    return "engine.weights is dequantized"


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, key: str = "engine.device") -> torch.device:
    """auto = CUDA when there is one; 'cuda' without one is a JobError naming `key`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise JobError(f"{key}: 'cuda' requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def resolve_small_gemm(name: str, device: torch.device, dtype: torch.dtype) -> int:
    """Threads for the native small GEMM (0 = off, F.linear everywhere): see engine.cpu_gemm.
    'native' where the kernel cannot run is a JobError naming the key."""
    fits = device.type == "cpu" and dtype == torch.float32
    if name == "native":
        if not fits:
            raise JobError("engine.cpu_gemm: 'native' needs engine.device cpu and float32")
        if not SMALL_GEMM_AVAILABLE:
            raise JobError(
                "engine.cpu_gemm: 'native' needs a CPU with AVX-512F or AVX2 and FMA; use 'torch'"
            )
    if name == "torch" or not fits or not SMALL_GEMM_AVAILABLE:
        return 0
    return torch.get_num_threads()


def resolve_weights(name: str, gemm_threads: int, weights: ModelWeights) -> bool:
    """Whether the CPU steps read the model's weights as its checkpoint stores them
    (engine.weights): a GGUF file's blocks, a bf16/fp16 folder's 16-bit floats; 'quantized'
    where they cannot is a JobError naming the key."""
    if name == "dequantized":
        return False
    if name == "quantized" and gemm_threads <= 0:
        raise JobError(
            "engine.weights: 'quantized' needs the native CPU kernels: engine.device cpu, "
            "float32 and engine.cpu_gemm auto or native on a CPU with AVX-512F or AVX2+FMA"
        )
    stored = gemm_threads > 0 and weights.stored()
    if name == "quantized" and not stored:
        raise JobError(
            f"engine.weights: 'quantized' needs a GGUF model or bf16/fp16 weights (model: "
            f"{weights.where} holds float32 safetensors)"
        )
    return stored


def resolve_activations(name: str, quantized: bool, weights: ModelWeights, why: str) -> bool:
    """Whether block products quantize x to 8 bits (engine.activations): 'int8' needs a GGUF
    model whose blocks the CPU steps read, else a JobError naming the key and `why` not (the
    setting that keeps the blocks from being read)."""
    if name == "float32":
        return False
    if not weights.gguf or not quantized:
        what = "holds no GGUF file" if not weights.gguf else f"is not read as its blocks: {why}"
        raise JobError(
            f"engine.activations: 'int8' needs a GGUF model read as its blocks (model: "
            f"{weights.where} {what}; it needs engine.weights auto or quantized, device cpu, "
            "dtype float32, the native kernels)"
        )
    return True


def flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def resolve_backend(name: str, device: torch.device, uniform_heads: bool = True,
                    sinks: bool = False) -> str:  # fmt: skip
    """auto: cpu on the CPU; on CUDA flashinfer when it is installed, the model's layers
    have one head shape (`uniform_heads`; Gemma 4's do not) and no attention sinks (`sinks`;
    gpt-oss), else torch. flashinfer is never imported on CPU, and asking for a backend where
    it cannot run is an error naming the key."""
    if name == "auto":
        if device.type == "cpu":
            return "cpu"
        usable = device.type == "cuda" and uniform_heads and not sinks
        return "flashinfer" if usable and flashinfer_importable() else "torch"
    if name == "flashinfer" and not uniform_heads:
        raise JobError("engine.attention_backend: 'flashinfer' plans one head shape for every "
                       "layer and this model's layers have several; use 'torch' or 'auto'")
    if name == "flashinfer" and sinks:
        raise JobError("engine.attention_backend: 'flashinfer' does not attend with attention "
                       "sinks, which this model's layers have; use 'torch' or 'auto'")
    if name == "cpu" and device.type != "cpu":
        raise JobError("engine.attention_backend: 'cpu' needs engine.device cpu")
    if name == "flashinfer":
        if device.type != "cuda":
            raise JobError("engine.attention_backend: 'flashinfer' needs engine.device cuda")
        if not flashinfer_importable():
            raise JobError(
                "engine.attention_backend: 'flashinfer' is not installed "
                "(pip install 'eaglebatch[flashinfer]'), or use 'auto' / 'torch'"
            )
    return name


def resolve_graph_mode(flag: bool | None, device: torch.device) -> str:
    """engine.cuda_graph -> "cuda" | "off" (default: on when running on CUDA)."""
    if flag is None:
        return "cuda" if device.type == "cuda" else "off"
    if flag and device.type != "cuda":
        raise JobError("engine.cuda_graph: true needs engine.device cuda (graphs are CUDA-only)")
    return "cuda" if flag else "off"


def resolve_overlap(flag: bool | None, device: torch.device, speculative: bool) -> bool:
    """engine.overlap (default: on for plain decoding on CUDA); true with a draft head is a
    JobError naming the key (a verify round's token counts are known only at its commit)."""
    if flag and speculative:
        raise JobError(
            "engine.overlap: true needs plain decoding (no draft): a verify round's accepted "
            "tokens are known only when it is committed; unset it or set it to false"
        )
    if flag is None:
        return device.type == "cuda" and not speculative
    return flag


# The longest default max_model_len: the RoPE table and the KV budget are sized by it, and a
# config.json claiming more positions (1e11) would allocate terabytes.
DEFAULT_MAX_MODEL_LEN_CAP = 1 << 20


def resolve_max_model_len(asked: int | None, model_len: int) -> int:
    """engine.max_model_len, or the model's when unset (within DEFAULT_MAX_MODEL_LEN_CAP)."""
    if asked is not None and asked > model_len:
        raise JobError(
            f"engine.max_model_len: {asked} exceeds the model's {model_len} positions"
        )
    if asked is None and model_len > DEFAULT_MAX_MODEL_LEN_CAP:
        raise JobError(
            f"engine.max_model_len: the model claims {model_len} positions (config.json), more "
            f"than eaglebatch sizes by default ({DEFAULT_MAX_MODEL_LEN_CAP}); set "
            f"engine.max_model_len to the longest sequence you need"
        )
    return asked or model_len
