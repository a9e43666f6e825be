"""eaglebatch: offline batch LLM generation with EAGLE speculative decoding.

Parquet in, Parquet out. The Rust extension (`eaglebatch._native`) schedules; torch computes.
Importing the package is cheap: torch and the extension load only when a job runs.
"""

__version__ = "0.1.0"
