"""A GGUF file as `model:`: its config, tokenizer and chat template are written once into a
small cached folder (a few MB); the weights are read from the file itself at every start
(model/gguf_checkpoint.py: a memory map, no float32 copy).

Invariants:
- the cache is keyed by the file's content (sha256), so a moved or renamed file is not
  converted again and an edited one is; the hash of a (path, size, mtime) seen before is
  remembered in `gguf-hashes.json` next to the folders, so a start does not reread gigabytes;
- a folder is published by an atomic rename once complete (a crash leaves none behind);
- a folder's `eaglebatch_source.json` says its weights are the GGUF file's and holds that
  file's sha256 (so the run's identity changes with the weights);
- a file that is not GGUF, or whose architecture the loader cannot convert, is a JobError
  naming the file and the architecture, before any work.

`gguf_reference_dir` is the other kind: the whole model dequantized to float32 safetensors by
transformers' GGUF loader, for the tests and benchmarks that compare with transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

from eaglebatch.errors import JobError
from eaglebatch.model.gguf_config import gguf_config
from eaglebatch.model.registry import GGUF_ARCHITECTURES, family_of_gguf
from eaglebatch.temp_file import new_temp_file

MAGIC = b"GGUF"
FORMAT_VERSION = "2"  # the folder of config + tokenizer (weights read from the GGUF file)
REFERENCE_VERSION = "1"  # the float32 folder of gguf_reference_dir
SOURCE_FILE = "eaglebatch_source.json"


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLEBATCH_CACHE", Path.home() / ".cache" / "eaglebatch"))


def publish(tmp: Path, final: Path) -> None:
    """Atomically moves a finished temporary folder/file into place (first writer wins)."""
    try:
        os.replace(tmp, final)
    except OSError:
        # Another process published first (a non-empty target directory cannot be replaced).
        shutil.rmtree(tmp, ignore_errors=True)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _tokenizer(gguf: Path):
    """The file's tokenizer by transformers' GGUF tokenizer conversion (keyed by
    `tokenizer.ggml.model`, whatever the architecture)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    arch, tokens, settings = get_gguf_tokenizer(str(gguf))
    backend, extra = convert_gguf_tokenizer(arch, tokens)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**settings, **extra})


def _config_and_tokenizer(gguf: Path):
    """The file's config and tokenizer: from its header by the family's mapping
    (model/gguf_config.py) where the family declares one, else by transformers' GGUF loader."""
    from transformers import AutoConfig, AutoTokenizer

    # lazy: numpy (the header reader), only for a GGUF model
    from eaglebatch.model.gguf_file import GgufFile

    reader = GgufFile(gguf)
    arch = reader.architecture
    family = family_of_gguf(arch, bool(reader.meta.get(f"{arch}.expert_count")))
    if family is None or family.gguf_config is None:
        return (AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name),
                AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
    raw = gguf_config(reader.meta, reader.tensors, family)
    return AutoConfig.for_model(raw.pop("model_type"), **raw), _tokenizer(gguf)


def convert_gguf(gguf: Path, out: Path, digest: str) -> None:
    """GGUF -> config.json + generation_config.json + tokenizer.json + chat template (read
    from the header; no tensor is read)."""
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    _quiet_transformers()
    config, tokenizer = _config_and_tokenizer(gguf)
    try:
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__]
    except KeyError:
        raise ValueError(f"no causal LM for config {type(config).__name__}") from None
    config.dtype = "float32"  # the dequantized values' type
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    source = {"converted_from": gguf.name, "format_version": FORMAT_VERSION,
              "weights": "gguf", "gguf_sha256": digest}  # fmt: skip
    (out / SOURCE_FILE).write_text(json.dumps(source) + "\n")


def convert_gguf_float32(gguf: Path, out: Path, digest: str) -> None:
    """GGUF -> a whole float32 checkpoint folder (transformers' loader dequantizes every
    tensor in memory: about 8 bytes per parameter at its peak)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    source = {"converted_from": gguf.name, "format_version": REFERENCE_VERSION,
              "weights": "float32", "gguf_sha256": digest}  # fmt: skip
    (out / SOURCE_FILE).write_text(json.dumps(source) + "\n")


def weights_in_gguf(d: Path) -> bool:
    """Whether folder `d` is a GGUF model's folder whose weights are read from the file."""
    try:
        return json.loads((d / SOURCE_FILE).read_text(encoding="utf-8")).get("weights") == "gguf"
    except (OSError, ValueError, AttributeError):
        return False


def is_gguf_path(model: str) -> bool:
    return model.lower().endswith(".gguf")


def _architecture(path: Path) -> str:
    """`general.architecture` from the file's header."""
    # lazy: numpy (the header reader's views), only for a GGUF model
    from eaglebatch.model.gguf_file import GgufFile

    try:
        return GgufFile(path).architecture
    except (ValueError, OSError, struct.error) as e:
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
    fd, tmp = new_temp_file(index)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(known, indent=0, sort_keys=True))
        os.replace(tmp, index)  # last writer wins: every entry it drops is recomputed, never wrong
    finally:
        tmp.unlink(missing_ok=True)
    return digest


def _converted(model: str, kind: str, convert, runnable: bool) -> Path:
    """The cached folder `kind` of GGUF file `model`, made by convert(path, tmp, digest) on
    first use; `runnable`: refuse an architecture eaglebatch does not run."""
    path = Path(model)
    if not path.is_file():
        raise JobError(f"model: GGUF file {model} not found")
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise JobError(f"model: {path} does not start with the GGUF magic: not a GGUF file")
    arch = _architecture(path)
    if runnable and arch not in GGUF_ARCHITECTURES:
        raise JobError(f"model: {model}: cannot run a GGUF file of architecture {arch!r} "
                       f"(eaglebatch runs {', '.join(GGUF_ARCHITECTURES)})")  # fmt: skip
    root = cache_dir() / "models"
    root.mkdir(parents=True, exist_ok=True)
    digest = _content_hash(path, root / "gguf-hashes.json")
    final = root / f"gguf-{digest[:24]}-{kind}"
    if (final / "config.json").is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    try:
        try:
            convert(path, tmp, digest)
        except (ValueError, KeyError, NotImplementedError, RuntimeError) as e:
            raise JobError(
                f"model: {path}: cannot convert a GGUF file of architecture {arch!r} "
                f"(conversion of its header: {str(e)[:200]})"
            ) from None
        publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def gguf_model_dir(model: str) -> Path:
    """The folder (config, tokenizer, template) of GGUF file `model`, written on first use."""
    return _converted(model, f"v{FORMAT_VERSION}", convert_gguf, runnable=True)


def gguf_reference_dir(model: str) -> Path:
    """GGUF file `model` as a float32 checkpoint folder by transformers' loader (the reference
    of the tests and benchmarks), converted on first use."""
    return _converted(model, f"f32-v{REFERENCE_VERSION}", convert_gguf_float32, runnable=False)
