"""Model definitions: config parsing, the Llama-family decoder and checkpoint loading."""

from eaglebatch.model.config import ModelConfig, RopeScaling
from eaglebatch.model.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "ModelConfig", "RopeScaling"]
