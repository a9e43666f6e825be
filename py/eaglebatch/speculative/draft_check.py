"""A draft head folder checked against its target before any work: config.json, the tensors'
names and shapes (safetensors headers; a pytorch_model.bin is read, heads are small) and the
vocabulary map d2t. Every mismatch is one ValueError naming the key or tensor and both values;
`load_draft` runs the same checks on what it loads."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from eaglebatch.model.config import ModelConfig
from eaglebatch.model.weights import checkpoint_shapes
from eaglebatch.speculative.assistant_config import (
    AssistantConfig,
    check_assistant_shapes,
    is_assistant,
    parse_assistant_config,
)
from eaglebatch.speculative.checkpoint import read_draft_tensors
from eaglebatch.speculative.draft_config import (
    EAGLE1,
    DraftConfig,
    detect_kind,
    parse_draft_config,
    read_raw_config,
)
from eaglebatch.speculative.mtp import check_mtp_dir
from eaglebatch.speculative.mtp_config import MtpConfig, states_mtp


def check_draft_dir(
    path: str | os.PathLike[str], target: ModelConfig
) -> DraftConfig | AssistantConfig | MtpConfig:
    """The draft's config when the head in `path` fits `target`; ValueError naming the
    mismatch otherwise (FileNotFoundError when the folder, config or weights are missing)."""
    raw = read_raw_config(path)
    if is_assistant(raw):
        return _check_assistant_dir(path, raw, target)
    if states_mtp(raw):  # a model checkpoint: its own MTP layer (speculative/mtp.py)
        return check_mtp_dir(path, raw, target)
    if any(n.endswith(".safetensors") for n in os.listdir(path)):
        shapes = checkpoint_shapes(path)
        d2t = _read_tensor(path, "d2t") if "d2t" in shapes else None
    else:
        tensors = read_draft_tensors(path)
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        d2t = tensors.get("d2t")
    cfg = parse_draft_config(raw, detect_kind(set(shapes), raw), target, set(shapes))
    check_head_shapes(cfg, shapes, target)
    if d2t is not None:
        check_d2t(d2t, cfg)
    return cfg


def _check_assistant_dir(
    path: str | os.PathLike[str], raw: dict, target: ModelConfig
) -> AssistantConfig:
    """A gemma4_assistant folder (speculative/assistant_config.py)."""
    cfg = parse_assistant_config(raw, target)
    if any(n.endswith(".safetensors") for n in os.listdir(path)):
        shapes = checkpoint_shapes(path)
    else:
        shapes = {k: tuple(v.shape) for k, v in read_draft_tensors(path).items()}
    check_assistant_shapes(cfg, shapes)
    return cfg


def _read_tensor(path: str | os.PathLike[str], name: str) -> torch.Tensor:
    """One tensor of a safetensors checkpoint (from the file that holds it)."""
    from safetensors import safe_open

    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), framework="pt") as f:
                if name in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                    return f.get_tensor(name)
    raise FileNotFoundError(f"tensor {name} not found in {os.fspath(path)}")


def check_head_shapes(
    cfg: DraftConfig, shapes: Mapping[str, tuple[int, ...]], target: ModelConfig
) -> None:
    """The tensors that tie the head to its target: fc's input width (n aux layers x the
    target's hidden size; EAGLE-1: 2h), the layer's attention input (EAGLE-3: 2h), the
    lm_head's rows (the draft vocabulary), a shipped embedding (the target's)."""
    h = cfg.hidden_size
    fc = shapes.get("fc.weight")
    if fc is not None and cfg.kind == EAGLE1 and tuple(fc) != (h, 2 * h):
        raise ValueError(f"fc.weight has shape {tuple(fc)}; an EAGLE-1 head of the target's "
                         f"hidden_size {h} needs {(h, 2 * h)}")  # fmt: skip
    if fc is not None and cfg.kind != EAGLE1:
        _check_fc(cfg, tuple(fc))
    q = shapes.get(f"{cfg.layer_prefix}self_attn.q_proj.weight")
    want = 2 * h if cfg.kind != EAGLE1 else h
    if q is not None and len(q) == 2 and q[1] != want:
        raise ValueError(f"{cfg.layer_prefix}self_attn.q_proj.weight reads {q[1]} features; the "
                         f"draft's hidden_size {h} needs {want}")  # fmt: skip
    head = shapes.get("lm_head.weight")
    if head is not None and cfg.kind != EAGLE1 and tuple(head) != (cfg.draft_vocab_size, h):
        raise ValueError(f"lm_head.weight has shape {tuple(head)}; draft_vocab_size "
                         f"{cfg.draft_vocab_size} and hidden_size {h} need "
                         f"{(cfg.draft_vocab_size, h)}")  # fmt: skip
    emb = shapes.get("embed_tokens.weight")
    if emb is not None and tuple(emb) != (target.vocab_size, target.hidden_size):
        raise ValueError(f"embed_tokens.weight has shape {tuple(emb)}, the target's embedding "
                         f"is {(target.vocab_size, target.hidden_size)}")  # fmt: skip
    d2t = shapes.get("d2t")
    if d2t is not None and cfg.kind != EAGLE1 and tuple(d2t) != (cfg.draft_vocab_size,):
        raise ValueError(f"d2t has shape {tuple(d2t)}; draft_vocab_size "
                         f"{cfg.draft_vocab_size} needs ({cfg.draft_vocab_size},)")  # fmt: skip


def _check_fc(cfg: DraftConfig, fc: tuple[int, ...]) -> None:
    """EAGLE-3's fc reads n aux states of the target's hidden size."""
    h, ht, n = cfg.hidden_size, cfg.target_hidden_size, len(cfg.aux_layer_ids)
    if len(fc) == 2 and fc[1] != n * ht:
        trained = f" (a head for {fc[1] // ht} target layers)" if fc[1] % ht == 0 else ""
        raise ValueError(
            f"fc.weight reads {fc[1]} features{trained}, but {n} aux layers "
            f"{list(cfg.aux_layer_ids)} of the target's hidden_size {ht} give {n * ht}; set "
            "eagle_aux_hidden_state_layer_ids (or eagle_config's) to the layers it was trained on"
        )
    if fc[0] != h:
        raise ValueError(f"fc.weight has {fc[0]} outputs; the draft's hidden_size is {h}")


def check_d2t(d2t: torch.Tensor, cfg: DraftConfig) -> torch.Tensor:
    """d2t's target ids (int64 [Vd]: draft id i is target id i + d2t[i]), all inside the
    target's vocabulary."""
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    if tuple(d2t.shape) != (vd,):
        raise ValueError(f"d2t has shape {tuple(d2t.shape)}; draft_vocab_size {vd} needs "
                         f"({vd},)")  # fmt: skip
    target_ids = d2t.long() + torch.arange(vd)
    low, high = int(target_ids.min()), int(target_ids.max())
    if low < 0 or high >= v:
        raise ValueError(f"d2t maps draft ids to target ids in [{low}, {high}], outside the "
                         f"target's vocabulary [0, {v})")  # fmt: skip
    return target_ids
