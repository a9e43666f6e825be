"""Model definitions: config parsing, the Llama-family and Gemma 3 decoders, checkpoint loading."""

from eaglebatch.model.config import ModelConfig, RopeScaling
from eaglebatch.model.gemma3 import Gemma3ForCausalLM
from eaglebatch.model.llama import LlamaForCausalLM

__all__ = ["Gemma3ForCausalLM", "LlamaForCausalLM", "ModelConfig", "RopeScaling", "model_class"]


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The module class of a config's family (Gemma3ForCausalLM subclasses LlamaForCausalLM)."""
    return Gemma3ForCausalLM if cfg.family == "gemma3" else LlamaForCausalLM
