"""eaglebatch: offline batch LLM generation with EAGLE speculative decoding.

Parquet in, Parquet out. The Rust extension (`eaglebatch._native`) schedules; torch computes.
Importing the package is cheap: torch and the extension load only when a job runs, and the
Python API's names (`Engine`, `run`, docs/python-api.md) when first used.
"""

import os as _os
from typing import Any

__version__ = "0.1.0"

# torch's OpenMP runtime (libgomp, whose team the native kernels join, cpu/omp.rs) reads this
# once, when torch loads it: an idle thread then spins 10k iterations (tens of microseconds)
# before it sleeps instead of 300k (milliseconds), so processes sharing cores stop burning each
# other's time (two quickstart shards at 2 threads each: 1.57x -> 1.05x their sequential time,
# the same alone; docs/performance.md). A value set by the user wins.
_os.environ.setdefault("GOMP_SPINCOUNT", "10000")

_API = {"Engine": "eaglebatch.api.engine", "run": "eaglebatch.api.run",
        "JobError": "eaglebatch.errors",
        "RunSummary": "eaglebatch.runner", "RunFailed": "eaglebatch.runner",
        "Interrupted": "eaglebatch.interrupt"}  # fmt: skip

__all__ = ["Engine", "Interrupted", "JobError", "RunFailed", "RunSummary", "run",
           "__version__"]  # fmt: skip


def __getattr__(name: str) -> Any:
    """The API's names, imported when first used (they pull pyarrow and the engine)."""
    if name not in _API:
        raise AttributeError(f"module 'eaglebatch' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value
