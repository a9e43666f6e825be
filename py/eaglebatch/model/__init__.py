"""Model definitions: config parsing, the family registry, the shared decoder, checkpoint
loading. `CausalLM` is imported on first use (it pulls torch), so the config and the registry
stay light for the job checks."""

from eaglebatch.model.config import ModelConfig, RopeScaling

__all__ = ["CausalLM", "ModelConfig", "RopeScaling"]


def __getattr__(name: str):
    if name == "CausalLM":
        # lazy: torch, which the config and the registry never need
        from eaglebatch.model.causal_lm import CausalLM

        return CausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
