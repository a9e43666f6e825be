"""One pass over a GGUF model's weight matrices on the native small GEMM, from the float32
dequantized weights and from the GGUF blocks (engine.weights: dequantized vs quantized), at a
few row counts: what reading ~7x fewer bytes buys a decode step, and what expanding the blocks
costs where a step is compute-bound.

Every quantized matrix of the file (the embedded SmolLM2-135M-Instruct Q4_1 by default: 210
Q4_1 layer matrices and the Q8_0 embedding, which is also its LM head) is multiplied by its
own random input rows; both variants compute the same values bit for bit (checked here on the
first matrix). Prints one line per row count:

    python benchmarks/cpu_gguf_gemm.py [--gguf FILE] [--rows 1 4 16 64 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def matrices(path: str) -> list[tuple[object, torch.Tensor]]:
    """(QuantizedWeight, float32 weight) for every readable quantized tensor of the file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from eaglebatch.cpu.quantized import BLOCK_TYPES, QuantizedWeight

    out = []
    for t in GGUFReader(path).tensors:
        if int(t.tensor_type) not in BLOCK_TYPES:
            continue
        blocks = np.array(t.data)
        n, k = blocks.shape[0], int(t.shape[0])
        qw = QuantizedWeight(torch.from_numpy(blocks), int(t.tensor_type), (n, k))
        out.append((qw, torch.from_numpy(dequantize(blocks, t.tensor_type).reshape(n, k))))
    return out


def timed(fn, iters: int, best: bool = False) -> float:
    """Median ms per call after 2 warm-up calls (`best`: the fastest call, the least
    disturbed on a shared CPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return (min(times) if best else float(np.median(times))) * 1e3


def main() -> None:
    from eaglebatch.cpu.gemm import linear
    from eaglebatch.job import builtin

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    path = args.gguf or str(builtin.builtin_gguf())
    mats = matrices(path)
    f32_mb = sum(w.numel() * 4 for _, w in mats) / 1e6
    q_mb = sum(q.blocks.numel() for q, _ in mats) / 1e6
    print(f"{path}: {len(mats)} matrices, {f32_mb:.0f} MB float32, {q_mb:.0f} MB of blocks, "
          f"{args.threads} threads")  # fmt: skip
    torch.set_grad_enabled(False)
    for m in args.rows:
        xs = [torch.randn(m, w.shape[1]) for _, w in mats]
        q0, w0 = mats[0]
        same = torch.equal(q0.linear(xs[0], args.threads), linear(xs[0], w0, threads=args.threads))
        assert same
        f = timed(lambda xs=xs: [linear(x, w, threads=args.threads) for x, (_, w) in zip(xs, mats)],
                  args.iters)  # fmt: skip
        q = timed(lambda xs=xs: [qw.linear(x, args.threads) for x, (qw, _) in zip(xs, mats)],
                  args.iters)  # fmt: skip
        print(f"rows {m:4d}: float32 {f:7.2f} ms ({f32_mb / f:5.1f} GB/s)   blocks {q:7.2f} ms "
              f"({q_mb / q:5.1f} GB/s)   {f / q:4.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
