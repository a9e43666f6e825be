"""Small-row GEMM cost on this CPU: why a K = 3 verify round (4 rows per sequence at batch 1)
costs ~2 plain decode steps here, and what a compiled GEMM would change.

For 1..5 rows it times the target's weights as SmolLM2-135M has them (30 layers of q, k, v, o,
gate, up and down projections, and the 49152 x 576 LM head: 540 MB in float32), once with
eager `F.linear` (MKL; the engine's path with `engine.cpu_gemm: torch`) and once compiled by
torch.compile with inductor's frozen-weight CPP GEMM templates (max-autotune; compile time
printed). Random weights: only
the shapes matter. Prints one line per row count:

    python benchmarks/cpu_small_gemm.py [--rows 1 2 3 4 5] [--threads N] [--no-compile]
"""

from __future__ import annotations

import argparse
import time

import torch

HIDDEN, INTER, VOCAB, LAYERS, HEAD_DIM, KV_HEADS = 576, 1536, 49152, 30, 64, 3


class Weights(torch.nn.Module):
    """The target's linear layers, applied each to its own input rows (no model in between:
    only the GEMMs are timed)."""

    def __init__(self) -> None:
        super().__init__()
        kv = KV_HEADS * HEAD_DIM
        shapes = [(HIDDEN, HIDDEN), (kv, HIDDEN), (kv, HIDDEN), (HIDDEN, HIDDEN),
                  (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(i, o, bias=False) for o, i in shapes
        )

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [layer(x) for layer, x in zip(self.layers, xs, strict=True)]


def timed(fn, xs, iters: int) -> float:
    """Mean ms per call after 3 warm-up calls."""
    for _ in range(3):
        fn(xs)
    t = time.perf_counter()
    for _ in range(iters):
        fn(xs)
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor

    inductor.freezing = True  # weights become constants the CPP GEMM template can pre-pack
    inductor.max_autotune_gemm_backends = "CPP,ATEN"
    model = Weights().eval()
    mb = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {len(model.layers)} "
          f"matrices, {mb:.0f} MiB float32")
    base = None
    with torch.no_grad():
        for rows in args.rows:
            xs = [torch.randn(rows, layer.in_features) for layer in model.layers]
            eager = timed(model, xs, args.iters)
            base = base or eager
            line = f"rows {rows}: eager F.linear {eager:6.1f} ms ({eager / base:.2f}x of 1 row)"
            if not args.no_compile:
                compiled = torch.compile(model, mode="max-autotune-no-cudagraphs", dynamic=False)
                t = time.perf_counter()
                compiled(xs)
                compile_s = time.perf_counter() - t
                ms = timed(compiled, xs, args.iters)
                line += f", compiled {ms:6.1f} ms ({ms / base:.2f}x; compiled in {compile_s:.0f} s)"
                torch._dynamo.reset()
            print(line, flush=True)


if __name__ == "__main__":
    main()
