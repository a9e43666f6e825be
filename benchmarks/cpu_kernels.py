"""The extension's CPU kernels against torch, on SmolLM2-135M's shapes (random values: only the
shapes matter). Prints one line per case, each measured twice in alternation (this shared VM
drifts), so the figures of one line come from the same minutes:

  * GEMM: the target's 210 layer matrices (30 layers of q, k, v, o, gate, up, down) for m rows,
    `F.linear` (MKL, `engine.cpu_gemm: torch`) vs the native kernel (`model/linear.py`, the
    widest copy this CPU runs: AVX-512F or AVX2+FMA), ms per pass over all 210;
  * attention: one layer (9 query heads over 3 KV heads of 64) of paged attention for q query
    rows over a context of n tokens, native kernel, µs per call.

    python benchmarks/cpu_kernels.py [--rows 1 4 9 16 64 128] [--context 100 600] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from eaglebatch import _native
from eaglebatch.cpu.gemm import SMALL_GEMM_AVAILABLE, linear

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 30, 9, 3, 64


def median_seconds(fn, reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gemm_line(weights: list[torch.Tensor], m: int, threads: int, reps: int) -> str:
    xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}

    def run(native: bool):
        for w in weights:
            x = xs[w.shape[1]]
            linear(x, w, None, threads) if native else F.linear(x, w)

    got = {"F.linear": [], "native": []}
    for _ in range(2):
        got["F.linear"].append(median_seconds(lambda: run(False), reps) * 1e3)
        if SMALL_GEMM_AVAILABLE:
            got["native"].append(median_seconds(lambda: run(True), reps) * 1e3)
    cells = [f"{k} {' / '.join(f'{v:.1f}' for v in vs)} ms" for k, vs in got.items() if vs]
    return f"GEMM, {m:3d} rows: " + ", ".join(cells)


def attention_line(context: int, q_rows: int, threads: int, reps: int, block: int = 16) -> str:
    blocks = context // block + 2
    kv = torch.randn(2, blocks, block, KV_HEADS, HEAD_DIM)
    q = torch.randn(q_rows, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    cu = np.array([0, q_rows], np.int32)
    lens = np.array([context], np.int32)
    table = np.arange(blocks, dtype=np.int32)[None, :].copy()

    def call():
        # by address: q, kv and out are live contiguous float32 CPU tensors
        _native.paged_attention(
            q.data_ptr(), kv.data_ptr(), out.data_ptr(), q_rows, cu, lens, table,
            HEADS, KV_HEADS, HEAD_DIM, block, blocks, HEAD_DIM**-0.5, threads,
        )  # fmt: skip

    us = [median_seconds(call, reps) * 1e6 for _ in range(2)]
    return f"attention, {q_rows} query rows, {context} tokens: {us[0]:.0f} / {us[1]:.0f} us"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 9, 16, 32, 64, 128])
    ap.add_argument("--context", type=int, nargs="+", default=[100, 300, 600])
    ap.add_argument("--query-rows", type=int, nargs="+", default=[1, 4, 9])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kv = KV_HEADS * HEAD_DIM
    shapes = [(HIDDEN, HIDDEN), (kv, HIDDEN), (kv, HIDDEN), (HIDDEN, HIDDEN),
              (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS  # fmt: skip
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    print(f"{args.threads} threads, native kernel available: {SMALL_GEMM_AVAILABLE}")
    for m in args.rows:
        print(gemm_line(weights, m, args.threads, args.reps), flush=True)
    for context in args.context:
        for q_rows in args.query_rows:
            print(attention_line(context, q_rows, args.threads, args.reps * 10), flush=True)


if __name__ == "__main__":
    main()
