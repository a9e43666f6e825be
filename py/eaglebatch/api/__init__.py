"""The Python API: `Engine` (a model loaded once: generate, generate_stream, score,
score_rolling) and `run` (a job as the CLI runs it). docs/python-api.md."""

from eaglebatch.api.engine import Engine
from eaglebatch.api.run import run

__all__ = ["Engine", "run"]
