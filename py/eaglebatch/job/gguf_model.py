"""A GGUF file as `model:`: converted once into a cached Hugging Face-style folder, then loaded
like any folder.

The conversion (`convert_gguf`, also the embedded defaults': transformers' GGUF loader and
the `gguf` package dequantize; nothing hand-written) and its cache live here. Invariants:
- the cache is keyed by the file's content (sha256), so a moved or renamed file is not
  converted again and an edited one is; the hash of a (path, size, mtime) seen before is
  remembered in `gguf-hashes.json` next to the folders, so a start does not reread gigabytes;
- a folder is published by an atomic rename once complete (a crash leaves none behind);
- a file that is not GGUF, or whose architecture the loader cannot convert, is a JobError
  naming the file and the architecture, before any work.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from eaglebatch.errors import JobError

MAGIC = b"GGUF"
FORMAT_VERSION = "1"  # the converted model folder


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLEBATCH_CACHE", Path.home() / ".cache" / "eaglebatch"))


def publish(tmp: Path, final: Path) -> None:
    """Atomically moves a finished temporary folder/file into place (first writer wins)."""
    try:
        os.replace(tmp, final)
    except OSError:
        # Another process published first (a non-empty target directory cannot be replaced).
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> config.json + model.safetensors (fp32, dequantised by transformers' GGUF loader)
    + tokenizer.json + chat template. The model is then loaded like any other checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "eaglebatch_source.json").write_text(
        json.dumps({"converted_from": gguf.name, "format_version": FORMAT_VERSION}) + "\n"
    )




def is_gguf_path(model: str) -> bool:
    return model.lower().endswith(".gguf")


def _architecture(path: Path) -> str:
    """`general.architecture` from the file's header (the `gguf` package's reader)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    except (KeyError, IndexError, ValueError, OSError) as e:
        raise JobError(f"model: {path} is not a readable GGUF file ({e})") from None


def _content_hash(path: Path, index: Path) -> str:
    """sha256 of the file, remembered per (resolved path, size, mtime)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        known = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(key), str):
        return known[key]
    # lazy: pyarrow (via fingerprint), only when a GGUF file is converted
    from eaglebatch.job.fingerprint import sha256_file

    digest = sha256_file(path)
    known[key] = digest
    tmp = index.with_name(f".{index.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=0, sort_keys=True), encoding="utf-8")
    os.replace(tmp, index)  # last writer wins: every entry it drops is recomputed, never wrong
    return digest


def gguf_model_dir(model: str) -> Path:
    """The converted folder of GGUF file `model`, converting it on first use."""
    path = Path(model)
    if not path.is_file():
        raise JobError(f"model: GGUF file {model} not found")
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise JobError(f"model: {path} does not start with the GGUF magic: not a GGUF file")
    arch = _architecture(path)
    root = cache_dir() / "models"
    root.mkdir(parents=True, exist_ok=True)
    digest = _content_hash(path, root / "gguf-hashes.json")
    final = root / f"gguf-{digest[:24]}-v{FORMAT_VERSION}"
    if (final / "config.json").is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    try:
        try:
            convert_gguf(path, tmp)
        except (ValueError, KeyError, NotImplementedError, RuntimeError) as e:
            raise JobError(
                f"model: {path}: cannot convert a GGUF file of architecture {arch!r} "
                f"(transformers' GGUF loader: {str(e)[:200]})"
            ) from None
        publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

