"""One mixture-of-experts layer's routed MLP on the CPU: the Python loop over active experts
(model/moe.py `SparseMoeBlock._grouped`, three native GEMM calls per expert) beside the one
native call (cpu/moe.py, rust/src/cpu/moe.rs), from the same GGUF blocks, at a few step sizes;
and the native call's work split (`column_block`): whole matrices per task (across experts)
or blocks of columns (across columns within each expert).

Default shape: Qwen3-30B-A3B's (hidden 2048, expert intermediate 768, 128 experts, top 8), the
experts' blocks random (valid scales), the routing a random top 8 per token. Prints ms per
layer call (best of --iters):

    python benchmarks/cpu_moe_kernel.py [--types 2 8 12] [--tokens 1 32] [--threads 2]

`int8` is the native call with x quantized to 8 bits (`engine.activations: int8`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_gguf_gemm import timed  # noqa: E402


def random_blocks(ggml_type: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [n, row_bytes]: random blocks whose fp16 scales are small and finite."""
    from eaglebatch.cpu.quantized import BLOCK_TYPES

    _, elems, nbytes = BLOCK_TYPES[ggml_type]
    blocks = rng.integers(0, 256, (n * k // elems, nbytes), dtype=np.uint8)
    halves = {2: (0,), 8: (0,), 12: (0, 2), 3: (0, 2), 14: (208,)}.get(ggml_type, ())
    for at in halves:
        h = rng.integers(0x1000, 0x2000, blocks.shape[0], dtype=np.uint16)  # ~1e-4 .. 1e-3
        blocks[:, at : at + 2] = h.reshape(-1, 1).view(np.uint8)
    if ggml_type == 39:
        blocks[:, 0] = rng.integers(115, 125, blocks.shape[0], dtype=np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def layer(ggml_type: int, hidden: int, inner: int, experts: int, top_k: int, threads: int):
    """A SparseMoeBlock whose experts are QuantizedLinear over random blocks."""
    from eaglebatch.cpu.gemm import use_small_gemm
    from eaglebatch.cpu.quantized import QuantizedWeight, use_quantized_weights
    from eaglebatch.model.moe import SparseMoeBlock

    cfg = SimpleNamespace(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                          moe_intermediate_size=inner, norm_topk_prob=True,
                          router_weights_float32=False, router_scoring="softmax",
                          router_bias=False, router_input_scale=False,
                          router_expert_scale=False, expert_bias=False,
                          expert_activation="gated", shared_expert_intermediate_size=0)  # fmt: skip
    block = SparseMoeBlock(cfg, F.silu, device="meta")
    block.gate = torch.nn.Linear(hidden, experts, bias=False)
    rng = np.random.default_rng(0)
    weights = {}
    for e in range(experts):
        for name, (n, k) in (("gate_proj", (inner, hidden)), ("up_proj", (inner, hidden)),
                             ("down_proj", (hidden, inner))):  # fmt: skip
            blocks = random_blocks(ggml_type, n, k, rng)
            weights[f"experts.{e}.{name}.weight"] = QuantizedWeight(blocks, ggml_type, (n, k))
    use_small_gemm(block, threads)
    use_quantized_weights(block, weights, threads)
    return block


def compare(block, tokens: int, threads: int, iters: int, blocks: list[int]) -> str:
    """One line: the Python loop, the native call (auto split), then each `column_block`."""
    from eaglebatch import _native
    from eaglebatch.cpu.moe import expert_table, use_native_moe
    from eaglebatch.model.moe import route

    x = torch.randn(tokens, block.gate.in_features)
    weights, experts = route(block.gate(x), block.top_k, True, False)
    use_native_moe(block, 0)
    plain = timed(lambda: block._grouped(x, weights, experts), iters, best=True)
    use_native_moe(block, threads)
    got, want = block._grouped(x, weights, experts), None
    use_native_moe(block, 0)
    want = block._grouped(x, weights, experts)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    table = expert_table(block)
    native = timed(lambda: table.forward(x, weights, experts, threads), iters, best=True)
    ids = np.ascontiguousarray(experts.numpy(), dtype=np.int64)
    w = np.ascontiguousarray(weights.numpy(), dtype=np.float32)
    out = torch.empty_like(x)

    def split(cb: int, int8: bool = False) -> float:
        return timed(lambda: _native.moe_experts(
            x.data_ptr(), out.data_ptr(), table.hidden, table.inner, ids, w, table.matrices,
            table.types, table.biases, "silu", 0.0, 0.0, threads, int8, cb), iters,
            best=True)  # fmt: skip

    active = len(torch.unique(experts))
    splits = "  ".join(f"block {cb or 'whole'}: {split(cb or 1 << 30):6.2f}" for cb in blocks)
    return (f"T {tokens:3d} ({active:3d} experts): python loop {plain:7.2f} ms   native "
            f"{native:6.2f} ms ({plain / native:4.1f}x)   int8 {split(0, True):6.2f} ms   "
            f"{splits}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", type=int, nargs="+", default=[2, 8, 12])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--shape", type=int, nargs=4, default=[2048, 768, 128, 8],
                    metavar=("HIDDEN", "INNER", "EXPERTS", "TOP_K"))  # fmt: skip
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--blocks", type=int, nargs="+", default=[0, 64, 128, 256],
                    help="column blocks to time (0: whole matrices)")  # fmt: skip
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    from eaglebatch.cpu.quantized import BLOCK_TYPES

    print(f"shape {args.shape}, {args.threads} threads")
    for ty in args.types:
        block = layer(ty, *args.shape, args.threads)
        print(BLOCK_TYPES[ty][0])
        for t in args.tokens:
            print("  " + compare(block, t, args.threads, args.iters, args.blocks))
        del block


if __name__ == "__main__":
    main()
