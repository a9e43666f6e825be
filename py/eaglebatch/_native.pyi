"""Typed surface of the Rust extension (`rust/`). The contract between the two sides.

Rust owns everything that is not tensor math: reading Parquet, rendering chat templates,
tokenizing, admission, batching, the paged-KV block manager, stop conditions, incremental
detokenization, timing and writing Parquet. Every method below releases the GIL while it works.

Invariants:
- Request slots are small stable integers in [0, max_batch_size): a running request keeps its slot
  until it finishes or is preempted, so the worker may keep per-slot state.
- KV slot index = block_id * block_size + offset_in_block; block ids are in [0, num_blocks).
- A plan's rows are in a fixed order; `commit` takes results in that same order.
"""

from collections.abc import Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt

from .job.scheduler_config import SchedulerConfig

# Every native class is final (PyO3: no subclassing); its constructor is `__new__` (PyO3's
# #[new]). scripts/native_stub.sh checks this file against the built
# extension: a name missing here or here only, or a signature that differs, fails CI.

__version__: str

class NativeError(Exception):
    """Any error raised by the Rust side (bad input file, missing column, tokenizer, I/O)."""

class UserInputError(NativeError):
    """An error the user can fix (missing file / column, wrong column type): message names it."""

class StorageConflict(NativeError):
    """A compare-and-swap on an object store lost: another writer changed the object first."""

@final
class StepPlan:
    """One forward step. B = num_seqs, T = num_tokens (sum of query lengths)."""

    # "prefill": each row's query is its sequence after what the cache holds (prefix-cached
    #   blocks, a forked sample's prompt, earlier chunks; often nothing: from position 0), or
    #   with chunked prefill the next chunk of it;
    # "decode" with chunked prefill may also hold such prefill chunks (plain decoding);
    # "decode": the tokens not yet in the KV cache (normally one);
    # "verify" (W = max_draft_tokens > 0; K = speculative.num_steps <= W is the head's chain):
    #   the last committed token at position L-1 then W placeholders (0) at L..L+W-1 that the
    #   worker overwrites with draft tokens; seq_lens = L+W and slot_mapping / block_tables
    #   cover all W+1 positions.
    kind: str
    num_seqs: int
    num_tokens: int
    request_slots: npt.NDArray[np.int32]  # [B] request slots
    input_ids: npt.NDArray[np.int64]  # [T]
    positions: npt.NDArray[np.int64]  # [T] absolute positions
    cu_seqlens_q: npt.NDArray[np.int32]  # [B+1] query offsets into input_ids
    seq_lens: npt.NDArray[np.int32]  # [B] kv length after this step (context incl. query)
    block_tables: npt.NDArray[np.int32]  # [B, M] block ids; entries past a row's need are 0
    slot_mapping: npt.NDArray[np.int64]  # [T] kv slot each query token's K/V is written to
    temperature: npt.NDArray[np.float32]  # [B] 0 = greedy
    top_p: npt.NDArray[np.float32]  # [B] 1.0 = off
    top_k: npt.NDArray[np.int32]  # [B] 0 = off
    # per-row sampling parameters: the job's, or the row's sampling columns'
    seeds: npt.NDArray[np.int64]  # [B] per-request seed (the row's, or job seed x row index)
    num_generated: npt.NDArray[np.int32]  # [B] output tokens committed so far (sampling key)
    min_tokens: npt.NDArray[np.int32]  # [B] end ids masked while num_generated (+ j) is below
    # rows below their min_tokens: their end ids (EOS unless the row ignores it, then its
    # stop_token_ids), row i's are end_ids[cu_end_ids[i]:cu_end_ids[i+1]]; none for other rows
    end_ids: npt.NDArray[np.int64]  # [E]
    cu_end_ids: npt.NDArray[np.int32]  # [B+1]
    min_p: npt.NDArray[np.float32]  # [B] 0 = off
    repetition_penalty: npt.NDArray[np.float32]  # [B] 1 = off
    frequency_penalty: npt.NDArray[np.float32]  # [B] 0 = off
    presence_penalty: npt.NDArray[np.float32]  # [B] 0 = off
    logprobs: npt.NDArray[np.int32]  # [B] alternatives to report per token (0 = none)
    # [B] top alternatives per prompt token while the row still lacks some of its prompt
    # logprobs (0 otherwise), and each row's prompt length
    prompt_logprobs: npt.NDArray[np.int32]
    prompt_lens: npt.NDArray[np.int32]
    # [B] the first query position whose prompt logprob is wanted (0, or a scored part's first
    # scored token - 1); earlier positions' logits are not needed
    prompt_logprobs_from: npt.NDArray[np.int32]
    # rows with a penalty on: their known tokens, prompt first; row i's are
    # penalty_ids[cu_penalty[i]:cu_penalty[i+1]], the first penalty_prompt_lens[i] the prompt's
    penalty_ids: npt.NDArray[np.int64]  # [N]
    cu_penalty: npt.NDArray[np.int32]  # [B+1]
    penalty_prompt_lens: npt.NDArray[np.int32]  # [B]
    # rows computing their known tokens (a prefill, or a chunk of one): row i's tokens before
    # its query (K/V cached) are prefix_ids[cu_prefix[i]:cu_prefix[i+1]]; none for decode and
    # verify rows
    prefix_ids: npt.NDArray[np.int64]  # [P]
    cu_prefix: npt.NDArray[np.int32]  # [B+1]
    # [C, 2] (src, dst) KV blocks to copy in every cache (target layers and draft) before the
    # step: a sample forked from its sibling takes a copy of the prompt's partial last block
    block_copies: npt.NDArray[np.int32]
    # [B] the token after each row's query; -1 where the step samples it (a chunked prefill
    # row that stops before its end: its sampled token is dropped at commit)
    next_ids: npt.NDArray[np.int64]
    # [B] overlap (next_plan_ahead): the row of the pending plan whose sampled token is this
    # row's last query token, whose input_ids entry is -1 until the worker fills it in on the
    # device; -1 for every other row (always, in plans from next_plan)
    prev_rows: npt.NDArray[np.int32]
    # Structured output (docs/structured-output.md). [B] prefill and decode plans: the row's
    # mask in token_masks, -1 for a row without one (free, or a chunk that samples nothing);
    # verify plans: its index in draft_masks' rows, -1 for a free row
    mask_rows: npt.NDArray[np.int32]
    # [M, words] packed allowed tokens (bit t % 32 of word t // 32), one per masked row
    token_masks: npt.NDArray[np.uint32]
    # verify plans: each constrained row's forced tokens (at most W), row i's
    # forced_ids[cu_forced[i]:cu_forced[i + 1]]
    forced_ids: npt.NDArray[np.int64]
    cu_forced: npt.NDArray[np.int32]
    # Hybrid models (policy.state_checkpoint_interval > 0; docs/prefix-caching.md). [B] where
    # the row's recurrent state comes from before its query: STATE_CONTINUE (-1: its request
    # slot holds it: decode, verify, a later chunk), STATE_ZERO (-2: the query starts at 0) or
    # c >= 0 (copy checkpoint c in first: a prefix-cache hit starting at the block end it was
    # saved at). A verify row's slot must end its step at its last accepted token's state.
    state_from: npt.NDArray[np.int32]
    # [S, 3] (row, query offset j, checkpoint c): after the step checkpoint c holds the row's
    # state after its query token j. Every restore of a step comes before its saves.
    state_saves: npt.NDArray[np.int32]
    max_seqlen_q: int
    max_seqlen_k: int

@final
class Scheduler:
    def __new__(cls, config: SchedulerConfig) -> Scheduler:
        """Validates the input (files exist, are Parquet, columns exist with usable types) and
        starts the reader/tokenizer and writer threads. Raises UserInputError naming the file or
        column. Rows are not all loaded: memory is bounded by `input.queue_rows`.

        `config` (job/scheduler_config.py) is read section by section: `task`, `input` (files,
        columns, chat, limits, resume), `sampling` (every row's defaults), `output` (the
        writer's), `storage` (object stores) and `policy` (the scheduling policy's); the names
        below are fields of those sections.
        `skip_rows`: row indices an earlier run of the same job already wrote (resume); they are
        read but never tokenized, scheduled or written, and not counted in requests_total.
        `flush_interval_s`: also close a part file once its oldest row has waited this long.
        Part numbering continues after the highest existing `part-N.parquet`.
        With `id_column`, a null id or an id equal to an earlier row's (compared by 64-bit hash,
        skipped rows included) makes an error row."""

    def next_plan(self) -> StepPlan | None:
        """The next step, or None when every input row has been written. Blocks (GIL released)
        while waiting for input. Error rows never reach a plan: they are written with
        finish_reason = "error", a specific `error` message and the prompt's token count when it
        was tokenized (else 0). They are: a null / empty prompt; a prompt >= max_model_len; a
        request whose worst case, min(prompt + max_new_tokens, max_model_len) +
        max_draft_tokens tokens, exceeds the KV cache (num_blocks * block_size); so a
        request that runs is never cut short by the cache, and finish_reason "length" means
        max_new_tokens or max_model_len. A text that certainly cannot fit max_model_len (more
        than 4 x the tokenizer's longest token in characters x max_model_len: a prompt, the
        messages' contents, the rendered chat) is refused before it is tokenized; a chat
        template whose output exceeds that many bytes or that runs too long, template and
        tokenizer failures. An input file that turns out unreadable (a corrupt page) raises
        UserInputError naming the file and row group, once every row read before it has been
        generated and written, and on every later call."""

    def commit(
        self,
        tokens: npt.NDArray[np.int32],
        num_tokens: npt.NDArray[np.int32],
        num_accepted: npt.NDArray[np.int32] | None = None,
        logprobs: tuple[npt.NDArray[np.float32], npt.NDArray[np.int32],
                        npt.NDArray[np.float32]] | None = None,
        prompt_logprobs: tuple[npt.NDArray[np.int32], npt.NDArray[np.int32],
                               npt.NDArray[np.float32], npt.NDArray[np.int32],
                               npt.NDArray[np.float32]] | None = None,
        pooled: npt.NDArray[np.float32] | None = None,
    ) -> None:
        """Results of the last plan, rows in plan order: row i produced
        tokens[sum(num_tokens[:i]) : sum(num_tokens[:i+1])]. The scheduler truncates at EOS,
        stop strings, max_new_tokens and max_model_len, frees finished requests' blocks and hands
        finished rows to the writer. A verify row yields 1..W+1 tokens (accepted drafts, then
        the target's token); its K/V is then valid for every appended token but the last.
        `num_accepted` (accepted drafts per row) is accumulated for verify rows. `logprobs`
        (chosen float32 [T], top ids int32 [T, N], top logprobs float32 [T, N], aligned with
        `tokens`) is required when a row of the plan asks for logprobs, with N at least the
        most any row asks; each row keeps those of the tokens it appends (its own N).
        `prompt_logprobs` (rows whose plan.prompt_logprobs > 0): (row_counts int32 [B],
        positions int32 [P], then chosen, top ids and top logprobs as `logprobs` has them over
        the P entries). `pooled` (a pooled task: embed, classify, reward; required there):
        float32 [B, W], each plan row's contribution to its row's pooled sum (pooled.py)."""

    def next_plan_ahead(self) -> StepPlan | None:
        """With config.overlap (plain decoding), while exactly one plan is pending: the plan
        after it, built before it is committed (rows it samples for decode a placeholder:
        prev_rows), or None when that cannot be done now (rows with penalties or a
        response_format, or nothing to
        run but rows the pending plan ends): then commit and call next_plan. Commits stay in
        plan order; a row that finishes at the pending plan's commit drops what the plan after
        it computed for it (scheduler/overlap.rs)."""

    def draft_masks(
        self, drafts: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.uint32]]:
        """Structured output, for the pending verify plan and the worker's drafts [B, k]:
        (rows [R] the constrained plan rows ascending, valid [R] how many leading drafts each
        one's grammar accepts, masks [R, k + 1, words] the allowed tokens at each verify
        position, position j's after drafts 1..j; positions past valid allow everything). The
        rows' grammars stand where the last commit left them afterwards."""

    def draft_step_masks(
        self, tokens: npt.NDArray[np.int64] | None = None
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.uint32]]:
        """Structured output, masked drafting: `tokens` None starts a session over the pending
        verify plan, else int64 [B] the drafts just chosen; returns (rows int32 [R], masks
        uint32 [R, words]), the constrained rows' allowed tokens at the next draft position."""

    def set_plain_steps(self, on: bool) -> None:
        """Speculative decoding: while on, decode steps are planned as plain decoding plans them
        ("decode" plans, no placeholders; with chunked prefill they carry prompt chunks) instead
        of verify rounds, from the next plan on. The worker asks for them where drafting cannot
        pay (`SpecWorker.plain_steps`). Admission still reserves max_draft_tokens slots."""

    def progress(self) -> dict[str, int]:
        """requests_total (from Parquet footers, capped by limit, less skipped rows),
        requests_skipped, requests_done, requests_error, requests_read (requests read from the
        input, error rows included), prompt_tokens_read (the prompt tokens of those queued to
        run), requests_stopped (rows ended by a stop), finished_output_tokens (the output tokens
        of rows finished without error), running, waiting, prompt_tokens, output_tokens,
        preemptions, cached_tokens (prompt tokens served from the prefix cache), prefill_tokens
        (tokens computed by prefill rows), free_blocks (free or evictable)."""

    def finish(self) -> dict[str, object]:
        """Waits for the writer, checks no KV block leaked (raises NativeError if one did) and
        returns the summary: requests, errors, skipped, prompt_tokens, output_tokens, preemptions,
        cached_tokens, prefill_tokens, evictions (cached blocks evicted), prefix_hit_rate
        (cached_tokens / prompt_tokens, None without prompts), spec_steps, accepted_tokens,
        spec_tokens (tokens produced by verify rounds),
        latency_p50/p90/p99, ttft_p50/p99, tpot_p50/p99 (seconds), writer_seconds (the writer
        thread's time decoding finished rows' texts and building and writing parts; errors
        include rows whose text failed to decode there), part_files. A complete run
        leaves at least one part file (an empty one when nothing else is there). Called before
        next_plan returned None, or after the input failed, it closes the writer like abort()
        and raises (the input's UserInputError again, if that was the failure)."""

    def abort(self) -> dict[str, object]:
        """Stops early (an interrupt, or after next_plan / commit raised): stops reading, drops
        the pending plan and every waiting or running request unwritten, closes the writer (the
        rows already finished go into a last complete part file; none, not an empty one, when
        there are none) and returns {"rows_written": int, "writer_seconds": float,
        "part_files": list[str]} for this run.
        No leak check; the scheduler cannot be used afterwards. A scheduler dropped without
        finish() or abort() closes its writer the same way."""

def render_chat_template(
    template: str,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
) -> str:
    """Renders a Hugging Face chat template (minijinja); exposed for parity tests. A template
    that runs too long (minijinja fuel: 10^6 instructions plus 10^4 per message and 4 per byte
    of message text) raises NativeError."""

def check_chat_template(template: str) -> None:
    """Compiles a chat template as the input reader does (renders nothing); raises ValueError
    with minijinja's message when it does not compile."""

def check_response_format(
    format: dict | str | None, tokenizer_file: str, vocab_size: int, eos_token_ids: list[int]
) -> None:
    """Parses and compiles a job's response_format (a mapping, JSON text, or None: nothing to
    check) for the tokenizer, read as SchedulerConfig.sampling.response_format is; raises
    UserInputError naming what is wrong."""

def output_columns(config: SchedulerConfig) -> list[str]:
    """The names of the columns a job's output has before its kept input columns (`config`: a
    SchedulerConfig or any object with its attributes), as the writer will write them:
    `output.keep_columns` may take any other name."""

# (url, size, e_tag, version)
_Entry = tuple[str, int, str | None, str | None]

@final
class ObjectStore:
    """Object stores through the reader's and writer's storage layer (rust/src/storage): every
    method takes a full URL and releases the GIL while it waits on the network. Errors: not
    found -> FileNotFoundError, a create-only name taken -> FileExistsError, a compare-and-swap
    that lost -> StorageConflict, 403/401 -> PermissionError, an operation the store lacks ->
    NotImplementedError, anything else (after the retries) -> OSError; messages name the URL
    and no credential."""

    def __new__(
        cls, endpoint: str | None = None, options: dict[str, str] = ..., unconditional: bool = False
    ) -> ObjectStore: ...
    def list(self, url: str) -> list[_Entry]:
        """Every object under the folder `url` (recursively), sorted by URL."""
    def head(self, url: str) -> _Entry: ...
    def get(self, url: str) -> tuple[bytes, str | None, str | None]:
        """The whole object: (bytes, e_tag, version)."""
    def get_range(self, url: str, start: int, end: int) -> bytes:
        """Bytes [start, end) (clipped to the object's end)."""
    def put(
        self,
        url: str,
        data: bytes,
        mode: str,
        e_tag: str | None = None,
        version: str | None = None,
    ) -> tuple[str | None, str | None]:
        """One PUT of `data`. `mode`: "overwrite", "create" (FileExistsError if the name is
        taken) or "replace" (StorageConflict unless the object is still `e_tag` / `version`).
        Returns the new (e_tag, version)."""
    def delete(self, url: str) -> None: ...
    def open_file(self, url: str) -> RemoteFile:
        """`url`'s size (one HEAD) and a reader of its ranges through the reader's block
        cache."""

@final
class RemoteFile:
    """A remote object opened for ranged reads (ObjectStore.open_file), as pyarrow's file-like
    wrapper (storage/remote_file.py) needs it."""

    def size(self) -> int: ...
    def read_at(self, start: int, length: int) -> bytes: ...

def is_secret_name(name: str) -> bool:
    """Whether a storage option's (or a cloud variable's) name names a credential, whose value
    messages redact: it holds KEY, SECRET, TOKEN, PASSWORD, SAS or CREDENTIAL in any case."""

def check_inputs(config: SchedulerConfig, keep_all: bool = False) -> dict[str, Any]:
    """The input rules, the one copy (rust/src/reader/validate.rs), applied before any model
    loads: `config` is a job/scheduler_config.py SchedulerConfig (any object with its sections
    and their attributes) whose `input.input_files` are resolved; `keep_all`:
    output.keep_columns is "*" (every column of the first file but an id column named `id`).
    Checks every file as the reader reads it: Parquet with each column the job reads present
    once, of a type its key takes (one type across files), compressed with a codec the reader
    decodes, the sampling_columns' keys known, the kept columns named as no output column;
    OpenAI Batch lines with at least one request to a served endpoint. Raises UserInputError
    naming the key, column and file. Returns {"total_rows": int (capped by limit), "kept":
    list[str] (the kept columns resolved), "first_url": str | None (OpenAI Batch: the first
    line's served url), "chat": bool (OpenAI Batch: a line is a chat request)}."""

def sampling_rule(key: str, value: int | float) -> str | None:
    """How `value` breaks the range of sampling key `key` (temperature, top_p, top_k,
    min_p, repetition_penalty, frequency_penalty, presence_penalty, max_new_tokens,
    logprobs, n), or a float's nonzero value lost as an f32, in words without the key; None
    when it keeps it (or `key` has no range). The one statement of these ranges: the job's
    keys, its rows' sampling columns and OpenAI Batch lines are held to it."""

# JSON whitespace between tokens unless a schema's x-guidance sets its own
JSON_WHITESPACE: str
# the most alternatives one point of a response_format may offer
MOST_ALTERNATIVES: int
OUTPUT_COLUMNS: list[str]
"""Every column name an output part may have (whatever the settings): kept input columns
(`output.keep_columns`) may take none of them."""

SCHEDULER_CONFIG_FIELDS: list[str]
"""The Rust RunConfig's settings, each read by name from the config object: `task`, and
`section.field` for each field of its sections `input`, `sampling` (read as one
SamplingParams value, every row's defaults), `output`, `storage` and `policy`; the settings
job/scheduler_config.py's SchedulerConfig and its section dataclasses must have (a test holds
the two sets equal)."""

# StepPlan.state_from's: the row's slot holds its state / it starts from a zero state
STATE_CONTINUE: int
STATE_ZERO: int

SMALL_GEMM_AVAILABLE: bool
"""Whether this CPU can run `small_gemm` (x86-64 with AVX-512F, or AVX2 and FMA)."""

SMALL_GEMM_MAX_ROWS: int
"""The most rows of x one `small_gemm` call takes (128)."""

def small_gemm(
    x: int,
    w: int,
    out: int,
    m: int,
    n: int,
    k: int,
    threads: int,
    weight_type: int = 0,
    int8_activations: bool = False,
) -> None:
    """out = x @ w.T in float32 by raw addresses (tensor.data_ptr()): x [m, k], w [n, k],
    out [m, n], all C-contiguous CPU buffers that stay alive for the call, out not overlapping
    the others; 1 <= m <= SMALL_GEMM_MAX_ROWS. `weight_type` is w's format as a GGML type
    number: 0 float32, 30 bfloat16 bits, or a GGUF block type (2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1,
    8 Q8_0, 12 Q4_K, 14 Q6_K, 39 MXFP4; w then n rows of whole blocks), expanded exactly, so the
    result is bit for bit that of w's float32 values. Runs on up to `threads` threads of the OpenMP
    team torch uses. Each output is computed in the same order whatever m and the thread
    count. `int8_activations` (block formats only; `engine.activations: int8`): x is quantized
    to 8-bit blocks of 32 and multiplied in integers (rust/src/cpu/int8_gemm.rs defines the
    result), not the float32 product. Unsafe by contract: `cpu/gemm.py::linear` and
    `cpu/quantized.py` are the callers;
    they take every address through `cpu/tensors.py::native_ptr`, which checks it."""

def gather_rows(
    w: int, weight_type: int, rows: int, k: int, ids: npt.NDArray[np.int64], out: int
) -> None:
    """out[i] = row ids[i] of w [rows, k] (format `weight_type` as in `small_gemm`) as float32:
    an embedding lookup from GGUF blocks. out [len(ids), k]; every id is checked (ValueError).
    Unsafe by contract: `cpu/quantized.py` is the caller."""

def moe_experts(
    x: int,
    out: int,
    hidden: int,
    inner: int,
    experts: npt.NDArray[np.int64],
    weights: npt.NDArray[np.float32],
    matrices: npt.NDArray[np.uint64],
    types: npt.NDArray[np.uint32],
    biases: npt.NDArray[np.uint64],
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    threads: int = 1,
    int8_activations: bool = False,
    column_block: int = 0,
) -> None:
    """out = one mixture-of-experts layer's routed MLP of x (rust/src/cpu/moe.rs): x and out
    [T, hidden] float32 by raw address; `experts` int64 and `weights` float32 [T, k], the
    router's choice; per expert (rows of [E, 3]: gate, up, down) the weights' addresses
    (`matrices`; gate and up [inner, hidden], down [hidden, inner], each n rows of whole blocks
    of its GGML type in `types`, as `small_gemm`'s `weight_type`) and float32 bias addresses
    (`biases`, 0: none). Each token's row is the sum, from zero and in ascending expert order,
    of weight * (down(act(gate x + b, up x + b)) + b) over its slots, on `small_gemm`'s
    products (int8 ones where `int8_activations` and a block format); a row's result does not
    depend on the other rows. `activation`: "silu", "gelu_tanh" (gelu_tanh(gate) * up) or
    "clamped_swiglu" (gpt-oss: g = min(gate, limit), u = clamp(up, -limit, limit),
    g * sigmoid(alpha g) * (u + 1)). `column_block`: output columns per parallel task (0: chosen
    per call, at most 256). Every size, type and expert id is checked (ValueError); the GIL is
    released. Unsafe by contract: `cpu/moe.py` is the caller; it takes x and out through
    `cpu/tensors.py::native_ptr` and keeps the weights alive."""

def rms_norm(x: int, weight: int, out: int, rows: int, h: int, eps: float) -> None:
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight in float32 by raw addresses, row by row
    (a row's result does not depend on the others): x and out [rows, h], weight [h], all live
    C-contiguous float32 CPU buffers, out not overlapping x. Unsafe by contract:
    `cpu/norm.py` is the caller (addresses through `cpu/tensors.py::native_ptr`)."""

def rms_norm_bf16(
    x: int, weight: int, out: int, rows: int, h: int, eps: float, threads: int
) -> None:
    """out[r] = bf16(weight * bf16(x[r] / sqrt(mean(x[r]^2) + eps))) over bfloat16 rows by raw
    addresses (the mean in float32; transformers' rounding), on up to `threads` of torch's
    OpenMP threads: x and out [rows, h], weight [h], all live C-contiguous bfloat16 CPU
    buffers, out not overlapping x. Unsafe by contract: `cpu/bf16_rows.py` is the caller."""

def rotary_bf16(
    x: int, cos: int, sin: int, out: int, tokens: int, heads: int, d: int, threads: int
) -> None:
    """out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)) over bfloat16 values by raw
    addresses (torch's rounding of RoPE), on up to `threads` of torch's OpenMP threads: x and
    out [tokens, heads, d] (d even), cos and sin [tokens, d], all live C-contiguous bfloat16
    CPU buffers, out not overlapping x. Unsafe by contract: `cpu/bf16_rows.py` is the
    caller."""

def delta_rule_steps(
    addrs: Sequence[int], lengths: Sequence[int], heads: int, dk: int, dv: int
) -> None:
    """The gated delta rule's recurrent form (model/delta_rule.py's `stepwise_delta_rule`) by
    raw addresses `addrs` = [q, k, v, g, beta, states, o, after]: float32 C-contiguous CPU
    buffers q, k [T, heads, dk], v [T, heads, dv], g, beta [T, heads], states [B, heads, dk,
    dv] (read), o [T, heads, dv] and after [T, heads, dk, dv] (written: the state of token t's
    row after token t), T = sum(lengths), B = len(lengths). Unsafe by contract: `cpu/deltanet.py`
    is the caller (addresses through `cpu/tensors.py::native_ptr`); sizes that do not fit, a
    null address or an empty row raise ValueError."""

def paged_attention(
    q: int,
    kv_cache: int,
    out: int,
    num_tokens: int,
    cu_seqlens_q: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    block_tables: npt.NDArray[np.int32],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    scale: float,
    threads: int,
) -> None:
    """Paged attention of a decode or verify step, in float32, straight from the cache: q and
    out [num_tokens, num_heads, head_dim], kv_cache [2, num_blocks, block_size, num_kv_heads,
    head_dim], given by raw address (tensor.data_ptr()) as live C-contiguous float32 CPU
    buffers, out not overlapping the others; cu_seqlens_q [B+1], seq_lens [B] and block_tables
    [B, M] as C-contiguous int32 arrays. Query row j of sequence i attends to keys
    0..=seq_lens[i] - q_i + j. Every index is checked first (ValueError). Unsafe by contract:
    `cpu/attention.py` is the caller (addresses through `cpu/tensors.py::native_ptr`)."""

@final
class CpuDecoder:
    """A model's decoder layers for few-row CPU steps (rust/src/cpu/decoder_layer.rs), held as raw
    addresses: per layer [input_norm (0: the layer is given its input), q, k, v, o, post_norm,
    gate, up, down, then the q, k, v, o, gate, up, down biases (0: none), then the per-head
    q_norm and k_norm weights [D] (0: none)], the seven weights' formats (GGML type numbers,
    as `small_gemm`'s `weight_type`) and the q/k/v input width; RoPE tables [max_positions,
    head_dim]. `int8_activations`: the block-format projections take x as `small_gemm`'s flag
    says. Unsafe by contract:
    `cpu/decoder.py::NativeDecoder` takes every address through `cpu/tensors.py::native_ptr`
    and keeps every tensor alive."""

    def __new__(
        cls,
        layers: list[list[int]],
        weight_types: list[list[int]],
        in_features: list[int],
        hidden: int,
        intermediate: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        cos: int,
        sin: int,
        max_positions: int,
        int8_activations: bool = False,
    ) -> CpuDecoder: ...
    def forward(
        self,
        x: int,
        input: int,
        first: int,
        last: int,
        positions: npt.NDArray[np.int64],
        slot_mapping: npt.NDArray[np.int64],
        cu_seqlens_q: npt.NDArray[np.int32],
        seq_lens: npt.NDArray[np.int32],
        block_tables: npt.NDArray[np.int32],
        kv_caches: list[int],
        num_blocks: int,
        block_size: int,
        threads: int,
    ) -> None:
        """Runs layers first..last over x [T, hidden] (float32, in place, T <= 128), writing
        each row's K/V at its slot; `input` [T, in_features[first]] replaces layer first's
        RMSNorm(x) (0: none). Sizes and indices are checked first (ValueError)."""
