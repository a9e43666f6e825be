"""The job file: YAML -> validated, frozen `JobConfig`. Config flows one way from here.

Every key is documented in docs/job-file.md. Unknown keys are errors (typo protection); every
error names the key path (`sampling.temperature`) so a user can fix the file without a
traceback.

Reading is strict, as a job runs for hours on what it says: the file is UTF-8 text of at most
1 MiB; YAML is loaded safely (no tag ever runs code) with the YAML 1.2 core schema's scalars
(`yes`, `on`, `2024-01-01` and `010` stay text or decimal; `1e-4` is a number); duplicate keys,
keys that are not text and nesting deeper than 64 levels are errors; what the file expands to
through aliases is bounded; and every value must have its key's type (no `true` for 1, no "0.5"
for 0.5, no 256.0 for an integer; an integer is accepted where a number is).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from eaglebatch.errors import JobError, echo
from eaglebatch.job.builtin import BUILTIN_DRAFTS, BUILTIN_MODELS, MTP_DRAFT
from eaglebatch.job.loading import load_yaml, read_job_text
from eaglebatch.job.secrets import masked_storage
from eaglebatch.storage.paths import SCHEMES as REMOTE_SCHEMES

_M = TypeVar("_M", bound=BaseModel)

_MAX_ERRORS = 10  # problems listed in one message
I32_MAX = 2**31 - 1
I64_MAX = 2**63 - 1
MAX_THREADS = 1024  # engine.num_threads, train.num_threads


# ---------------------------------------------------------------------------------------------
# Schema


def _list_to_tuple(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


# A YAML list for a tuple field (strict mode takes only a real tuple otherwise).
LIST_OK = BeforeValidator(_list_to_tuple)


def _no_nul(v: str) -> str:
    if "\0" in v:
        raise ValueError("a path or name must not contain a NUL character (\\0)")
    return v


# A file, folder or model reference: non-empty text without NUL.
PathStr = Annotated[str, StringConstraints(min_length=1), AfterValidator(_no_nul)]


class _Section(BaseModel):
    # strict: YAML's own types only (no bool for an int, no text for a number, no float for an
    # int); allow_inf_nan=False: every number finite (.inf and .nan are refused)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _native_rule(key: str, v: Any) -> Any:
    # lazy: the extension, loaded once a job sets a ranged key
    from eaglebatch._native import sampling_rule

    broken = sampling_rule(key, v)
    if broken is not None:
        raise ValueError(broken)
    return v


def sampling_rule(key: str) -> AfterValidator:
    """The range of sampling key `key` (and a float's f32 form), as the extension states it
    for the job, its rows' columns and batch lines alike (rust/src/sampling_params.rs RANGES)."""
    return AfterValidator(lambda v: _native_rule(key, v))


class InputConfig(_Section):
    path: PathStr = Field(description="Parquet file, directory, glob, or builtin:sharegpt")
    prompt_column: str | None = None
    messages_column: str | None = None
    id_column: str | None = None
    limit: int | None = Field(default=None, ge=0, le=I64_MAX)
    # Wrap each `prompt_column` text as one user message and render the model's chat template.
    apply_chat_template: bool = False
    # reasoning models: the chat template's `enable_thinking` variable (Qwen 3's switch);
    # unset: the template's own default
    enable_thinking: bool | None = None
    # Per-row sampling: sampling key -> input column; a row's non-null value overrides the job's
    # (the keys and each one's column types: checked with the files, rust/src/reader/columns.rs).
    sampling_columns: dict[str, str] = Field(default_factory=dict)
    # parquet, or openai-batch (JSONL request lines); auto: openai-batch for a .jsonl path
    format: Literal["auto", "parquet", "openai-batch"] = "auto"
    # raw prompts (and scoring contexts) are encoded with the tokenizer's special tokens (BOS)
    add_special_tokens: bool = True
    # task score: a string column of continuations scored after each prompt, or a
    # list<string> column of choices (exactly one of the two)
    continuation_column: str | None = None
    choices_column: str | None = None

    @property
    def openai_batch(self) -> bool:
        return self.format == "openai-batch" or (
            self.format == "auto" and self.path.endswith(".jsonl")
        )

    @model_validator(mode="after")
    def _batch_lines_bring_their_own(self) -> InputConfig:
        if not self.openai_batch:
            return self
        keys = {"prompt_column": self.prompt_column, "messages_column": self.messages_column,
                "id_column": self.id_column, "sampling_columns": self.sampling_columns,
                "apply_chat_template": self.apply_chat_template}  # fmt: skip
        bad = [k for k, v in keys.items() if v]
        if bad:
            raise ValueError(
                f"input.{bad[0]}: an openai-batch input's lines carry their prompt, id "
                "(custom_id) and sampling; leave it unset"
            )
        return self

    @model_validator(mode="after")
    def _named_sampling_columns(self) -> InputConfig:
        if any(c == "" for c in self.sampling_columns.values()):
            raise ValueError("input.sampling_columns: a column name must not be empty")
        return self

    @model_validator(mode="after")
    def _one_prompt_source(self) -> InputConfig:
        if self.prompt_column is not None and self.messages_column is not None:
            raise ValueError("set only one of input.prompt_column and input.messages_column")
        if self.messages_column is not None and self.apply_chat_template:
            raise ValueError("input.apply_chat_template applies to input.prompt_column only")
        return self

    @property
    def renders_chat(self) -> bool:
        """Prompts are messages rendered with the chat template (a messages column, or
        apply_chat_template; an openai-batch input decides by its endpoint instead)."""
        return self.messages_column is not None or self.apply_chat_template

    @property
    def text_column(self) -> str | None:
        """The prompt column, `prompt` unless messages (or batch lines) are used."""
        if self.messages_column is not None or self.openai_batch:
            return None
        return self.prompt_column or "prompt"


class OutputConfig(_Section):
    path: PathStr
    part_rows: int = Field(default=1024, ge=1, le=I32_MAX)
    # Also close a part once its oldest row has waited this long: bounds the work a crash loses.
    # At most 1e9 s (~32 years): the writer's deadline (a Rust Duration past now) must exist.
    flush_interval_s: float = Field(default=30.0, gt=0.0, le=1e9)
    include_token_ids: bool = False
    # a `logprobs` column: per output token its log-probability and the top K alternatives
    logprobs: Annotated[int, sampling_rule("logprobs")] = 0
    # raw: the model's own distribution (log_softmax of its logits); processed: the one the
    # token was drawn from (after penalties, min_new_tokens, temperature, top-k and top-p)
    logprobs_mode: Literal["raw", "processed"] = "raw"
    # a `prompt_logprobs` column: per prompt token after the first, its log-probability given
    # the tokens before it and the top K alternatives (raw); such prompts skip the prefix cache
    prompt_logprobs: Annotated[int, sampling_rule("logprobs")] = 0
    # openai-batch: also write the OpenAI Batch results file (JSONL) once every row is done
    format: Literal["parquet", "openai-batch"] = "parquet"
    # default: output.path/_results.jsonl (results_file.py: where it may go, who owns it)
    results_path: PathStr | None = None
    # input columns copied into each output row with their types, after the output's own
    # columns: a list of names, or "*" for every input column (but an id column named `id`,
    # which is the output's `id`); resolved against the files by inputs.kept_columns
    keep_columns: Annotated[tuple[str, ...], LIST_OK] | Literal["*"] = ()
    # reasoning models (docs/structured-output.md#reasoning): "think" splits the text between
    # reasoning_tags (each one token of the model's tokenizer) into a `reasoning_text` column,
    # keeps the answer after it in output_text, and applies a response_format to the answer only
    reasoning: Literal["think"] | None = None
    reasoning_tags: Annotated[tuple[str, str], LIST_OK] = ("<think>", "</think>")

    @field_validator("keep_columns")
    @classmethod
    def _named_once(cls, v):
        if v == "*":
            return v
        if any(c == "" for c in v):
            raise ValueError("a column name must not be empty")
        twice = sorted({c for c in v if v.count(c) > 1})
        if twice:
            raise ValueError(f"column '{twice[0]}' is named twice")
        return v

    @property
    def results_file(self) -> Path | None:
        if self.format != "openai-batch":
            return None
        return Path(self.results_path) if self.results_path else Path(self.path) / "_results.jsonl"

    @model_validator(mode="after")
    def _results_file_local(self) -> OutputConfig:
        paths = ("path", "results_path")
        remote = [k for k in paths if str(getattr(self, k)).startswith(REMOTE_SCHEMES)]
        if self.format == "openai-batch" and remote:
            raise ValueError(f"output.{remote[0]}: the OpenAI Batch results file is written to "
                             "local or shared disk only; write the job's output there and copy "
                             "it")  # fmt: skip
        return self


class SamplingConfig(_Section):
    # Ranges: the extension's (`sampling_rule`: one statement for the job, its rows' columns
    # and batch lines); other bounds: what the Rust scheduler's types hold (i32, i64).
    max_new_tokens: Annotated[int, sampling_rule("max_new_tokens")] = 256
    # 0 = greedy, else in [1e-5, 1e6]
    temperature: Annotated[float, sampling_rule("temperature")] = 0.0
    top_p: Annotated[float, sampling_rule("top_p")] = 1.0
    top_k: Annotated[int, sampling_rule("top_k")] = 0
    seed: int = Field(default=0, ge=0, le=I64_MAX)
    stop: Annotated[tuple[str, ...], LIST_OK] = ()
    # token ids that end a request like EOS (counted as an output token, not in the text)
    stop_token_ids: Annotated[tuple[Annotated[int, Field(ge=0, le=I32_MAX)], ...], LIST_OK] = ()
    # do not stop at the model's EOS tokens (stop_token_ids still stop)
    ignore_eos: bool = False
    # min-p sampling (vLLM's): keep the tokens whose probability, after temperature, is at
    # least min_p times the most likely one's (0 = off; greedy rows are never filtered)
    min_p: Annotated[float, sampling_rule("min_p")] = 0.0
    # the output text keeps the stop string that ended it
    include_stop_str_in_output: bool = False
    # false: special tokens (other than an ending EOS or stop token id) appear in output_text
    skip_special_tokens: bool = True
    # EOS and stop_token_ids are masked (stop strings unchecked) before this many output tokens
    min_new_tokens: int = Field(default=0, ge=0, le=I32_MAX)
    # vLLM's penalties: repetition over prompt and output tokens (> 1 discourages repeats;
    # 1 = off), frequency (by count) and presence (once) over output tokens (0 = off)
    repetition_penalty: Annotated[float, sampling_rule("repetition_penalty")] = 1.0
    frequency_penalty: Annotated[float, sampling_rule("frequency_penalty")] = 0.0
    presence_penalty: Annotated[float, sampling_rule("presence_penalty")] = 0.0
    # samples per input row: n output rows (sample_index 0..n-1) sharing the prompt's KV
    n: Annotated[int, sampling_rule("n")] = 1
    # structured output (docs/structured-output.md): what every row's output must match, as
    # OpenAI spells it ({type: json_schema, json_schema: {name, schema}}, {type: json_object})
    # or {type: regex, pattern}, {type: grammar, lark}, {type: choice, choices}; checked and
    # compiled by the extension before the model loads
    response_format: dict[str, Any] | None = None

    def end_token_ids(self, eos_token_ids) -> list[int]:
        """The ids that end a request: the model's EOS (unless ignore_eos) and stop_token_ids."""
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return sorted(set(eos) | set(self.stop_token_ids))

    @model_validator(mode="after")
    def _non_empty_stops(self) -> SamplingConfig:
        if any(s == "" for s in self.stop):
            raise ValueError("sampling.stop: stop strings must not be empty")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"sampling.min_new_tokens: {self.min_new_tokens} is more than "
                f"sampling.max_new_tokens ({self.max_new_tokens})"
            )
        if self.n > 1 and self.temperature == 0:
            raise ValueError(
                f"sampling.n: {self.n} samples per row need sampling.temperature > 0 (greedy "
                "decoding gives every sample the same tokens)"
            )
        return self


class EngineConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch_size: int = Field(default=64, ge=1, le=4096)
    # KV budget: an explicit token count, else this fraction of free (device or host) memory.
    kv_cache_tokens: int | None = Field(default=None, ge=1, le=I32_MAX)
    kv_cache_memory_fraction: float = Field(default=0.3, gt=0.0, le=0.95)
    block_size: int = Field(default=16, ge=1, le=1024)
    max_num_batched_tokens: int = Field(default=2048, ge=1, le=I32_MAX)
    # automatic prefix caching: requests whose tokens start alike share those full KV blocks
    prefix_caching: bool = True
    # chunked prefill: prompts computed max_num_batched_tokens per step, in the running
    # requests' decode steps (speculative: alternating with verify rounds)
    chunked_prefill: bool = True
    max_model_len: int | None = Field(default=None, ge=2, le=I32_MAX)
    # auto: cpu on the CPU (torch's backend with the extension's kernel for decode and verify
    # steps, cpu/attention.py); on CUDA flashinfer when installed, else torch.
    attention_backend: Literal["auto", "torch", "cpu", "flashinfer"] = "auto"
    # CUDA graphs for decode / speculative rounds; unset = on when running on CUDA.
    cuda_graph: bool | None = None
    # Plan and launch step t+1 before step t's tokens reach the host, hiding the host's time
    # per step behind the device's (plain decoding; outputs unchanged, docs/overlap.md); unset =
    # on when plain decoding runs on CUDA.
    overlap: bool | None = None
    num_threads: int | None = Field(default=None, ge=1, le=MAX_THREADS)
    # CPU steps of up to SMALL_GEMM_MAX_ROWS (128) rows (decode and verify): "native" = the
    # extension's GEMM (model/linear.py; AVX-512F, or AVX2 with FMA) and, with the cpu
    # attention backend, whole layers (cpu/decoder.py); "torch" = torch's layers and
    # F.linear (MKL); auto = native on a float32 CPU run when the CPU has AVX-512F or AVX2+FMA.
    # A bfloat16 CPU run's RMSNorms and RoPE run the extension's bfloat16 kernels
    # (cpu/bf16_rows.py) unless this is "torch".
    cpu_gemm: Literal["auto", "native", "torch"] = "auto"
    # A GGUF or bf16/fp16 model's weights on the CPU: "quantized" = as the checkpoint stores
    # them (GGUF blocks, 16-bit floats), widened in registers to the exact float32 values (the
    # same outputs from ~7x / 2x fewer bytes, cpu/quantized.py); "dequantized" = float32
    # parameters; auto = quantized on a float32 CPU run with the native kernels when the
    # model has GGUF blocks or 16-bit matrices.
    weights: Literal["auto", "quantized", "dequantized"] = "auto"
    # How products with a GGUF model's quantized blocks take their input on the CPU: "float32"
    # = exactly (the dequantized model's outputs); "int8" = each row quantized to 8-bit blocks
    # of 32 and multiplied in integers, as llama.cpp does (faster, no longer the float32
    # model's outputs; rust/src/cpu/int8_gemm.rs). int8 needs weights read as blocks.
    activations: Literal["float32", "int8"] = "float32"
    # local: this process; ray: engine actors on a Ray cluster (the job's `ray` section).
    executor: Literal["local", "ray"] = "local"


class SpeculativeConfig(_Section):
    num_steps: int = Field(default=3, ge=1, le=16)  # K: most draft tokens per verify round
    topk: int = Field(default=1, ge=1, le=I32_MAX)
    # Pick the number of draft steps (0..num_steps) per step from measured costs and acceptance.
    adaptive: bool = True
    # Prompt lookup (speculative/ngram.py): a sequence whose last n tokens (n = prompt_lookup_max
    # down to prompt_lookup_min) occurred earlier in it drafts the k tokens that followed there
    # instead of the head's; when every sequence does, the head does not run and a sequence
    # drafts up to prompt_lookup_tokens copied tokens (at least num_steps; the adaptive policy
    # picks how many from measured verify costs). 0 = off.
    prompt_lookup_min: int = Field(default=3, ge=0, le=I32_MAX)
    prompt_lookup_max: int = Field(default=5, ge=1, le=I32_MAX)
    prompt_lookup_tokens: int = Field(default=8, ge=1, le=32)
    # structured output: the tokens a row's grammar forces next are its first drafts
    forced_drafts: bool = True

    @model_validator(mode="after")
    def _chain_only(self) -> SpeculativeConfig:
        if self.topk != 1:
            raise ValueError(
                "speculative.topk > 1 (tree drafting) is not supported; use topk: 1 (chain)"
            )
        if 0 < self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative.prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                f"speculative.prompt_lookup_min ({self.prompt_lookup_min})"
            )
        return self

    @property
    def prompt_lookup(self) -> tuple[int, int] | None:
        """(min_n, max_n) for SpecWorker, None when off."""
        if self.prompt_lookup_min == 0:
            return None
        return self.prompt_lookup_min, self.prompt_lookup_max


# Structured output: a round of forced drafts is up to this wide (a JSON key with its quotes and
# separators is about 4-8 tokens), where rows may have a response_format.
FORCED_DRAFT_TOKENS = 8


def widest_round(num_steps: int, lookup_tokens: int | None, forced_tokens: int | None = None
                 ) -> int:  # fmt: skip
    """W, the most draft tokens of one round: K (num_steps), or prompt lookup's width when it is
    on (`lookup_tokens` not None), or forced drafts' (`forced_tokens` not None), the largest.
    The one rule for the job, scheduler and worker."""
    return max(num_steps, lookup_tokens or 0, forced_tokens or 0)


class RayConfig(_Section):
    """How a Ray run (`run --ray`, or engine.executor: ray) spreads the job (ray_executor.py)."""

    # None: a Ray instance of this machine; "auto": the cluster this machine belongs to;
    # HOST:PORT: that cluster's head (checked before any model is loaded).
    address: str | None = None
    # Engine actors; default one per GPU of the cluster (device cuda) or, on the CPU, as many
    # as leave one CPU for Ray itself with cpus_per_actor each (at least one).
    actors: int | None = Field(default=None, ge=1, le=100_000)
    # CPUs reserved by each actor, and its torch threads on the CPU (default engine.num_threads
    # or 1 on the CPU; 1 beside a GPU).
    cpus_per_actor: int | None = Field(default=None, ge=1, le=MAX_THREADS)
    # Rows per unit (the work an actor takes at a time); default: the remaining rows cut into
    # about four units per actor, each between 4 and 64 batches of engine.max_batch_size.
    unit_rows: int | None = Field(default=None, ge=1, le=I64_MAX)
    # Attempts of one unit (an actor that dies is restarted and the unit retried) before the
    # run stops with the unit's last error.
    max_attempts: int = Field(default=4, ge=1, le=1000)


class EmbedConfig(_Section):
    """`task: embed` (docs/embeddings.md): how a row's hidden states become its embedding.
    Unset keys follow the checkpoint's sentence-transformers files (modules.json,
    1_Pooling/config.json, config_sentence_transformers.json)."""

    # last (token), mean (over the prompt's tokens) or cls (the first token)
    pooling: Literal["last", "mean", "cls"] | None = None
    # L2-normalise (default: a Normalize module in modules.json)
    normalize: bool | None = None
    # Matryoshka: keep the first `dimensions` values (then normalise); default all
    dimensions: int | None = Field(default=None, ge=1, le=1_000_000)
    # one of config_sentence_transformers.json's `prompts` put before each raw prompt
    # (default: its default_prompt_name, if any)
    prompt_name: str | None = Field(default=None, min_length=1)
    # an input longer than max_model_len: cut its end (sentence-transformers' rule) or its
    # start, or make it an error row; default: end for embed, error for classify and reward
    # (a cut conversation would be scored without its end)
    truncate: Literal["start", "end", "error"] | None = None


POOLED_TASKS = ("embed", "classify", "reward")


class StorageConfig(_Section):
    """How `s3://`, `gs://` and `az://` paths are reached (docs/scale-out.md "Object
    storage"). Credentials come from each cloud's standard environment variables; options
    hold the `object_store` crate's keys (`aws_region`, `google_service_account`, ...)."""

    # an S3-compatible store or an emulator, e.g. http://minio:9000 (http:// allows plain HTTP)
    endpoint: str | None = Field(default=None, min_length=1)
    options: dict[str, str] = {}
    # a store that ignores create-only writes: parts and the lease become plain writes, and
    # two runs over one output can overwrite each other (no exactly-once guarantee)
    unsafe_no_conditional_writes: bool = False
    # the run's lease on its output: renewed every third of this, taken over once expired
    lease_ttl_s: float = Field(default=60.0, ge=2.0, le=86400.0)


class JobConfig(_Section):
    model: PathStr
    # A Jinja chat template file used instead of the model's (a model without one, e.g. a base
    # model's GGUF, or one whose template is wrong).
    model_chat_template: PathStr | None = None
    input: InputConfig
    output: OutputConfig
    sampling: SamplingConfig = SamplingConfig()
    engine: EngineConfig = EngineConfig()
    # An EAGLE draft head (folder or builtin name), or `mtp` (the model's own MTP layer);
    # unset = plain decoding.
    draft: PathStr | None = None
    speculative: SpeculativeConfig = SpeculativeConfig()
    ray: RayConfig = RayConfig()
    storage: StorageConfig = StorageConfig()
    # generate (default); score: log-probabilities of input.continuation_column (or each of
    # input.choices_column) after the prompt; perplexity: each prompt's rolling log-probability
    # embed: each row's embedding; classify: its label and probabilities from the model's
    # sequence-classification head; reward: that head's single score (docs/embeddings.md)
    task: Literal["generate", "score", "perplexity", "embed", "classify", "reward"] = "generate"
    embed: EmbedConfig = EmbedConfig()

    @model_validator(mode="after")
    def _scoring_columns(self) -> JobConfig:
        inp = self.input
        named = [k for k in ("continuation_column", "choices_column") if getattr(inp, k)]
        if self.task == "score" and len(named) != 1:
            raise ValueError("task: score needs exactly one of input.continuation_column and "
                             "input.choices_column")  # fmt: skip
        if self.task != "score" and named:
            raise ValueError(f"input.{named[0]}: only for task: score")
        if self.task == "generate":
            return self
        if self.task in POOLED_TASKS:
            return self._pooled_task()
        if self.sampling.n > 1 or self.output.prompt_logprobs or inp.openai_batch:
            raise ValueError(f"task: {self.task} scores given text: sampling.n, output."
                             "prompt_logprobs and openai-batch input do not apply")  # fmt: skip
        if self.sampling.response_format is not None or self.output.reasoning is not None:
            raise ValueError(f"task: {self.task}: sampling.response_format and "
                             "output.reasoning are for generation")  # fmt: skip
        return self

    def _pooled_task(self) -> JobConfig:
        """embed / classify / reward: one prefill per row, no decoding."""
        if self.sampling.n > 1 or self.output.prompt_logprobs:
            raise ValueError(f"task: {self.task} computes one value per row: sampling.n and "
                             "output.prompt_logprobs do not apply")  # fmt: skip
        if self.draft is not None:
            raise ValueError(f"draft: task: {self.task} decodes nothing; leave it unset")
        if self.input.openai_batch and self.task != "embed":
            raise ValueError(f"task: {self.task}: openai-batch input is for generation and "
                             "embeddings (/v1/embeddings)")  # fmt: skip
        if self.sampling.response_format is not None or self.output.reasoning is not None:
            raise ValueError(f"task: {self.task}: sampling.response_format and "
                             "output.reasoning are for generation")  # fmt: skip
        return self

    @property
    def pooled(self) -> bool:
        """A task whose rows end in a head over their hidden states (embed, classify,
        reward)."""
        return self.task in POOLED_TASKS

    @model_validator(mode="after")
    def _embed_keys_for_embed(self) -> JobConfig:
        given = self.embed.model_dump(exclude_defaults=True)
        allowed = {"embed": given.keys(), "classify": {"truncate"}, "reward": {"truncate"}}
        bad = sorted(given.keys() - allowed.get(self.task, set()))
        if bad:
            raise ValueError(f"embed.{bad[0]}: not for task: {self.task}")
        return self

    @property
    def scoring(self) -> bool:
        """The rows are not generated (task score, perplexity, embed, classify, reward)."""
        return self.task != "generate"

    @model_validator(mode="after")
    def _prompt_logprobs_once_per_row(self) -> JobConfig:
        if self.output.prompt_logprobs and self.sampling.n > 1:
            raise ValueError("output.prompt_logprobs: not supported with sampling.n > 1")
        return self

    @model_validator(mode="after")
    def _kept_columns_need_columns(self) -> JobConfig:
        if self.output.keep_columns and self.input.openai_batch:
            raise ValueError(
                "output.keep_columns: an openai-batch input has no columns to keep (a line's "
                "custom_id is the output's id)"
            )
        return self

    @property
    def max_draft_tokens(self) -> int:
        """The most draft tokens of one round (the scheduler's lookahead); 0 without a draft."""
        if self.draft is None:
            return 0
        spec = self.speculative
        lookup = spec.prompt_lookup_tokens if spec.prompt_lookup is not None else None
        return widest_round(spec.num_steps, lookup, self.forced_draft_tokens)

    @property
    def may_be_structured(self) -> bool:
        """Whether a row may have a response_format: the job's, a column's or a batch line's."""
        return (self.sampling.response_format is not None
                or "response_format" in self.input.sampling_columns or self.input.openai_batch)

    @property
    def forced_draft_tokens(self) -> int | None:
        """How wide a round of forced drafts may be (None: no such rounds)."""
        forced = self.draft is not None and self.speculative.forced_drafts
        return FORCED_DRAFT_TOKENS if forced and self.may_be_structured else None

    def resolved(self, base_dir: Path) -> JobConfig:
        """Relative paths in the job file are relative to the job file's directory."""

        return self.model_copy(
            update={
                "model": resolve_model_ref(self.model, base_dir),
                "model_chat_template": None if self.model_chat_template is None
                else resolve_path(self.model_chat_template, base_dir),
                "draft": self.draft if self.draft == MTP_DRAFT  # a keyword, not a folder
                else resolve_model_ref(self.draft, base_dir),
                "input": self.input.model_copy(
                    update={"path": resolve_path(self.input.path, base_dir)}
                ),
                "output": self.output.model_copy(
                    update={
                        "path": resolve_path(self.output.path, base_dir),
                        "results_path": None if self.output.results_path is None
                        else resolve_path(self.output.results_path, base_dir),
                    }
                ),
            }
        )


def expand_home(p: str) -> str:
    """`~` and `~user` at the start of a path expanded like a shell does (an unknown user's
    `~name` stays as written)."""
    return os.path.expanduser(p) if p.startswith("~") else p


def resolve_path(p: str, base_dir: Path) -> str:
    """A job-file path: builtin names as they are; `~` expanded; absolute paths as they are,
    others under base_dir."""
    if p.startswith(("builtin:", *REMOTE_SCHEMES)):
        return p
    p = expand_home(p)
    if Path(p).is_absolute():
        return p
    return str((base_dir / p).resolve())


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except (OSError, ValueError):  # e.g. a name too long for the file system
        return False


def resolve_model_ref(m: str | None, base_dir: Path) -> str | None:
    """A model / draft reference: a builtin name, also spelt `builtin:NAME` as inputs are (one
    spelling kept: NAME); a path when it looks like one (has a `/`, starts with `.` or `~`) or
    exists; else left as it is (a builtin name, or an error later naming it)."""

    if m is not None and m.startswith("builtin:"):
        name = m.removeprefix("builtin:")
        return name if name in BUILTIN_MODELS or name in BUILTIN_DRAFTS else m
    if m is not None and ("/" in m or m.startswith((".", "~")) or _exists(base_dir / m)):
        return resolve_path(m, base_dir)
    return m


_FRIENDLY = {
    "model_type": "expected a section (a mapping of keys)",
    "dict_type": "expected a mapping of keys",
    "tuple_type": "expected a list",
    "list_type": "expected a list",
}
def _key_path(loc: tuple) -> str:
    """`sampling.temperature`, each part cut to 60 characters (a key can be long)."""
    parts = [str(p) if len(str(p)) <= 60 else str(p)[:60] + "...(cut)" for p in loc]
    return ".".join(parts) or "(top level)"


def _format_error(err: ValidationError, source: str) -> str:
    errors = err.errors(include_url=False)
    lines = []
    for e in errors[:_MAX_ERRORS]:
        key = _key_path(e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key '{key}'")
        elif e["type"] == "missing":
            lines.append(f"{source}: missing required key '{key}'")
        else:
            msg = _FRIENDLY.get(e["type"]) or e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            hint = ""
            if e["type"] == "string_type" and type(got) in (int, float):
                hint = f'; quote it to make it text: "{got}"'
            lines.append(f"{source}: {key}: {msg} (got {echo(got)}{hint})")
    if len(errors) > _MAX_ERRORS:
        lines.append(f"{source}: ... and {len(errors) - _MAX_ERRORS:,} more problems")
    return "\n".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`engine.max_batch_size=32` -> (["engine", "max_batch_size"], 32). Values are YAML, read
    like the job file (so `=32` is an integer, `=0` an integer a number key accepts, `='"32"'`
    text)."""
    if "=" not in item:
        raise JobError(f"--set {echo(item)}: expected key.path=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise JobError(f"--set {echo(item)}: bad key path")
    key = _key_path(tuple(parts))
    value = load_yaml(raw, f"--set {key}") if raw.strip() else ""
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, p in enumerate(parts[:-1]):
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise JobError(
                    f"--set {_key_path(tuple(parts))}: '{_key_path(tuple(parts[: i + 1]))}' "
                    "is not a section"
                )
            node = child
        node[parts[-1]] = value
    return data


def load_validated(path: Path, overrides: list[str], cls: type[_M]) -> _M:
    """Reads a YAML job file, applies `--set` overrides and validates it as `cls`. Raises
    JobError naming the file and key on any problem."""
    data = load_yaml(read_job_text(path), str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a single value ({echo(data)})"
        raise JobError(
            f"{path}: the job must be a mapping of keys (model, input, output, ...), not {kind}"
        )
    return validated(data, overrides, cls, str(path))


def validated(data: dict, overrides: list[str], cls: type[_M], source: str) -> _M:
    """`data` (a job as a mapping) with `--set` overrides applied, validated as `cls`; JobError
    naming `source` and the key on any problem."""
    data = apply_overrides(data, list(overrides))
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise JobError(_format_error(e, source)) from None


def load_job(path: str | Path, overrides: list[str] = ()) -> JobConfig:
    """Reads, overrides, validates and resolves a job file. Raises JobError on any problem."""
    path = Path(path)
    return load_validated(path, list(overrides), JobConfig).resolved(path.parent.resolve())


def job_from_dict(
    data: dict, overrides: list[str] = (), base_dir: Path | None = None
) -> JobConfig:
    """A job given as a mapping (the Python API): validated like a job file's, relative paths
    against `base_dir` (default: the working directory). Raises JobError on any problem."""
    if not isinstance(data, dict):
        raise JobError(f"the job must be a mapping of keys (model, input, output, ...), not "
                       f"{type(data).__name__}")  # fmt: skip
    job = validated(copy.deepcopy(data), list(overrides), JobConfig, "job")
    return job.resolved((base_dir or Path.cwd()).resolve())


def job_to_dict(job: JobConfig) -> dict:
    """The job as JSON-ready values, for output metadata and reports: without credentials
    (`storage.options` values and the endpoint's user information masked: job/secrets.py)."""
    out = job.model_dump(mode="json")
    out["storage"] = masked_storage(out["storage"])
    return out
