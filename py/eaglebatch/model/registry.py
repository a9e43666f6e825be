"""The one table from a checkpoint's `model_type` to its family (one file each under model/).
Adding a family: write its file (family.py says what it declares) and list it here."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.family import Family
from eaglebatch.model.gemma3 import GEMMA3
from eaglebatch.model.gemma4 import GEMMA4
from eaglebatch.model.gpt_oss import GPT_OSS
from eaglebatch.model.granite import GRANITE
from eaglebatch.model.llama import LLAMA
from eaglebatch.model.ministral import MINISTRAL
from eaglebatch.model.ministral3 import MINISTRAL3
from eaglebatch.model.mistral import MISTRAL
from eaglebatch.model.mixtral import MIXTRAL
from eaglebatch.model.olmo2 import OLMO2
from eaglebatch.model.olmo3 import OLMO3
from eaglebatch.model.phi3 import PHI3
from eaglebatch.model.qwen2 import QWEN2
from eaglebatch.model.qwen2_moe import QWEN2_MOE
from eaglebatch.model.qwen3 import QWEN3
from eaglebatch.model.qwen3_5 import QWEN3_5
from eaglebatch.model.qwen3_5_moe import QWEN3_5_MOE
from eaglebatch.model.qwen3_moe import QWEN3_MOE
from eaglebatch.model.qwen3_next import QWEN3_NEXT
from eaglebatch.model.smollm3 import SMOLLM3

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        LLAMA,
        MISTRAL,
        QWEN2,
        QWEN3,
        GEMMA3,
        GEMMA4,
        OLMO2,
        OLMO3,
        SMOLLM3,
        GRANITE,
        MINISTRAL3,
        MINISTRAL,
        PHI3,
        QWEN3_MOE,
        QWEN2_MOE,
        MIXTRAL,
        GPT_OSS,
        QWEN3_5,
        QWEN3_5_MOE,
        QWEN3_NEXT,
    )
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_of(model_type: Any) -> Family:
    """The family of `model_type`; a ValueError listing the supported ones otherwise."""
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(f"unsupported model_type {model_type!r}; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")  # fmt: skip
    return family


def family_of_gguf(architecture: str, experts: bool = False) -> Family | None:
    """The family whose GGUF files say `general.architecture` = `architecture`; where several
    do, the one whose `gguf_experts` is `experts` (the header states `{arch}.expert_count`)."""
    found = [f for f in FAMILIES.values() if architecture in f.gguf_architectures]
    if len(found) > 1:
        found = [f for f in found if f.gguf_experts == experts]
    return found[0] if found else None


GGUF_ARCHITECTURES = tuple(dict.fromkeys(a for f in FAMILIES.values()
                                         for a in f.gguf_architectures))  # fmt: skip


def text_model_config(raw: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A multimodal config as its text model's (the top level's keys, then text_config's,
    with the text family's model_type and architecture), and whether it was one."""
    family = next((f for f in FAMILIES.values() if raw.get("model_type") in f.text_tower_of),
                  None)  # fmt: skip
    if family is None:
        return raw, False
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"model config: a {raw['model_type']} config needs a text_config")
    towers = ("text_config", "vision_config", "audio_config")
    top = {k: v for k, v in raw.items() if k not in towers}
    return {**top, **text, "model_type": family.model_type,
            "architectures": [family.architecture]}, True  # fmt: skip
