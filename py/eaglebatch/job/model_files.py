"""A model folder on disk: where its weights, tokenizer and chat template are, checked up front.

A model is a builtin name (materialised by `job/builtin.py`), a GGUF file (its config and
tokenizer written once by `gguf_model`, its weights read from the file) or a Hugging Face-style
folder:
config.json, *.safetensors (or model.safetensors.index.json shards), tokenizer.json, and a chat
template in chat_template.jinja or tokenizer_config.json.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from eaglebatch.errors import JobError
from eaglebatch.job import builtin
from eaglebatch.job.gguf_model import cache_dir, gguf_model_dir, is_gguf_path, weights_in_gguf
from eaglebatch.storage import is_remote, location
from eaglebatch.storage.download import cached_copy


@dataclass(frozen=True)
class ModelFiles:
    dir: Path
    tokenizer_file: Path
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    max_token_id: int  # the tokenizer's largest id (vocabulary and added tokens)
    gguf: Path | None = None  # the GGUF file the folder was written from: its weights


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # older tokenizer_config format: {"content": "...", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or not UTF-8
        raise JobError(f"model: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise JobError(f"model: {path} must hold a JSON object")
    return data


def _load_tokenizer(path: Path):
    """tokenizer.json parsed the way the run will parse it (the tokenizers library)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on any parse error
        raise JobError(f"model: {path} is not a usable tokenizer: {str(e)[:300]}") from None


def _chat_template(d: Path, tok_cfg: dict) -> str | None:
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, ValueError) as e:
            raise JobError(f"model: cannot read {jinja}: {e}") from None
    tmpl = tok_cfg.get("chat_template")
    if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
    return tmpl if isinstance(tmpl, str) else None


def resolve_model_dir(model: str, storage=None) -> Path:
    """The folder of `model`: a builtin name, a GGUF file (converted once, gguf_model.py) or a
    Hugging Face-style folder; an object-store URL of either is copied into the cache first
    (storage/download.py; `storage`: the job's section)."""
    if builtin.is_builtin_model(model):
        return builtin.builtin_model_dir(model)
    model = local_model(model, storage)

    if is_gguf_path(model):
        return gguf_model_dir(model)
    d = Path(model)
    if not d.is_dir():
        raise JobError(
            f"model: '{model}' is neither a folder, a .gguf file nor a builtin model "
            f"(builtin: {', '.join(builtin.BUILTIN_MODELS)})"
        )
    return d


def check_model_dir(d: Path) -> ModelFiles:
    """Checks the folder has everything a run needs; raises JobError naming what is missing."""
    if not (d / "config.json").is_file():
        raise JobError(f"model: {d} has no config.json")
    weights = any(d.glob("*.safetensors")) or (d / "model.safetensors.index.json").is_file()
    if not (weights or weights_in_gguf(d)):
        raise JobError(f"model: {d} has no *.safetensors weights")
    tokenizer_file = d / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise JobError(f"model: {d} has no tokenizer.json")
    cfg = _read_json(d / "config.json")
    tok_cfg_path = d / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    gen_cfg = (
        _read_json(d / "generation_config.json")
        if (d / "generation_config.json").is_file()
        else {}
    )
    bos, eos = _token_text(tok_cfg.get("bos_token")), _token_text(tok_cfg.get("eos_token"))
    eos_ids = _ids(gen_cfg.get("eos_token_id")) or _ids(cfg.get("eos_token_id"))
    tokenizer = _load_tokenizer(tokenizer_file)
    max_token_id = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if eos is not None:
        added = tokenizer.get_added_tokens_decoder()  # {id: AddedToken}
        eos_ids += [i for i, t in added.items() if t.content == eos]
    return ModelFiles(
        dir=d,
        tokenizer_file=tokenizer_file,
        chat_template=_chat_template(d, tok_cfg),
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=tuple(sorted(set(eos_ids))),
        max_token_id=max_token_id,
    )


def source_gguf(model: str) -> Path | None:
    """The GGUF file `model` is converted from (a builtin's or the given file), else None."""
    if builtin.is_builtin_model(model):
        return builtin.builtin_gguf(model)

    return Path(model) if is_gguf_path(model) else None


def local_model(model: str, storage=None) -> str:
    """`model`, or for an object-store URL its local copy in the cache (storage/download.py)."""
    if not is_remote(model):
        return model
    return str(cached_copy(location(model, storage), cache_dir() / "remote-models"))


def model_files(model: str, storage=None) -> ModelFiles:
    model = local_model(model, storage)
    mf = dataclasses.replace(check_model_dir(resolve_model_dir(model)), gguf=source_gguf(model))
    if mf.gguf is None and weights_in_gguf(mf.dir):
        raise JobError(f"model: {mf.dir} is eaglebatch's cache of a GGUF file's config and "
                       f"tokenizer, without weights: name the .gguf file as model")  # fmt: skip
    return mf


def resolve_draft_dir(draft: str, key: str = "draft", model_dir: Path | None = None) -> Path:
    """A draft head folder (config.json + weights), or a builtin draft name; `mtp` (the
    model's own MTP layer): `model_dir`, the model's checkpoint folder (None where `key` takes
    a head only). Errors name `key`, the job key that gave `draft`."""
    if draft == builtin.MTP_DRAFT:
        if model_dir is None:
            raise JobError(f"{key}: mtp names a model's own MTP layer (the job's `draft: mtp`), "
                           "not a draft head folder")  # fmt: skip
        return model_dir
    d = builtin.builtin_draft_dir(draft)
    if d is None:
        d = Path(draft)
        if not d.is_dir():
            raise JobError(
                f"{key}: '{draft}' is neither a folder nor a builtin draft "
                f"(builtin: {', '.join(builtin.BUILTIN_DRAFTS) or 'none'})"
            )
    if not (d / "config.json").is_file():
        raise JobError(f"{key}: {d} has no config.json")
    if not (any(d.glob("*.safetensors")) or any(d.glob("*.bin"))):
        raise JobError(f"{key}: {d} has no *.safetensors or pytorch_model.bin weights")
    return d
