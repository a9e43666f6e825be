"""Real model shapes on one GPU: plain decode TPOT against the weight-streaming bound, whole runs
with engine.overlap on and off, speculative round costs and the speedup curve, transformers.

    python benchmarks/gpu_shapes.py --out gpu_shapes.json                        # on the GPU
    python benchmarks/gpu_shapes.py --shapes tiny --device cpu --out x.json ...  # CPU rehearsal

No checkpoint travels to the device machine: each target (Llama-3.1-8B, Qwen3-8B shaped) is
built on the device with random weights (norms ~1, projections N(0, 1.5^2 / fan_in)), its EAGLE-3
head likewise (random heads accept nothing: the round's cost against a plain step gives the
speedup as a function of acceptance length, not a speedup). Whole runs go through the engine
(Rust scheduler, paged KV, the step loop) with the device model as the worker; the job's
`model:` folder holds a one-layer stand-in with the same word-level tokenizer ("w0".."wN"),
which only the job checks read. Sections, the JSON rewritten after each:

  * ceilings: the device's copy bandwidth (the weight-streaming bound: a step's weight and KV
    bytes over it) and bf16 matmul throughput;
  * steps: graph-replayed plain decode step per batch size, with the bound and their ratio
    (goal at batch 1: within 1.25x), and a speculative round (draft loop, verify, draft extend)
    at k = 1..K, with the speedup curve over acceptance lengths;
  * runs: output tok/s and TPOT of whole greedy runs, overlap off and on, whether both gave
    the same tokens (all rows start in one wave: the same batches either way), and how many
    synchronising calls each made (torch.cuda.set_sync_debug_mode("warn"));
  * transformers: `generate` on the same weights (eager, bf16), tok/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import (  # noqa: E402
    _time_round,
    device_ceilings,
    report_file,
    timer,
    write_prompts,
)

SHAPES = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, vocab_size=128256, rope_theta=500000.0),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, rope_theta=1000000.0),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                 rope_theta=10000.0),
}
ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ACCEPT_LENGTHS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)


def write_config(out: Path, shape: dict, dtype: str, max_len: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": [ARCH[shape["model_type"]]], "hidden_act": "silu",
           "max_position_embeddings": max_len, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": dtype, **shape}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def write_stand_in(out: Path, vocab: int, max_len: int) -> Path:
    """The job's model folder: one tiny layer over the target's vocabulary, a word-level
    tokenizer; checked by the job, never run."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from eaglebatch.model.causal_lm import CausalLM
    from eaglebatch.model.config import ModelConfig

    small = dict(SHAPES["tiny"], vocab_size=vocab, num_hidden_layers=1)
    write_config(out, small, "float32", max_len)
    model = CausalLM(ModelConfig.from_dir(out))
    save_file({k: v.contiguous() for k, v in model.named_parameters()},
              str(out / "model.safetensors"))
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text("{}")
    return out


@torch.no_grad()
def build_target(config_dir: Path, device: torch.device, dtype: torch.dtype, backend: str,
                 max_len: int):
    """The target model, allocated and randomly initialised on `device` (no host copy)."""
    from eaglebatch.attention import get_backend
    from eaglebatch.model import CausalLM
    from eaglebatch.model.config import ModelConfig

    cfg = ModelConfig.from_dir(config_dir)
    with torch.device("meta"):
        model = CausalLM(cfg, backend=get_backend(backend), dtype=dtype,
                                 max_positions=max_len)
    model.to_empty(device=device)
    for rotary in model.rotaries():
        rotary.rebuild()
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(1.0, 0.1, generator=gen)
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0, generator=gen)
        else:
            p.normal_(0.0, 1.5 / p.shape[1] ** 0.5, generator=gen)
    return model.eval()


def build_workers(model, draft_dir: Path, graphs: str, max_batch: int, seq_tokens: int, k: int):
    """(plain Worker, SpecWorker around it) over one paged KV cache for max_batch rows of
    seq_tokens, their steps captured (graphs "cuda" | "eager")."""
    from eaglebatch.attention import allocate_kv_cache
    from eaglebatch.speculative.eagle import load_draft
    from eaglebatch.speculative.worker import SpecWorker
    from eaglebatch.worker import KvBudget, Worker

    bs, dev, dt = 16, model.device, model.dtype
    num_blocks = max_batch * math.ceil((seq_tokens + k + 1) / bs)
    kv = allocate_kv_cache(model.config, num_blocks + 1, bs, dt, dev)
    w = Worker(model, kv, KvBudget(num_blocks, bs, 0), seq_tokens)
    w.enable_graphs(graphs, max_batch)
    draft = load_draft(draft_dir, model.config, model, dtype=dt, device=dev,
                       max_positions=seq_tokens + 2 * k + 2)
    sw = SpecWorker(w, draft, num_steps=k, max_batch_size=max_batch, adaptive=False,
                    draft_kv_cache=draft.allocate_kv_cache(num_blocks + 1, bs))
    sw.enable_graphs(graphs, max_batch)
    return w, sw


def step_rows(w, sw, batches, context: int, k_max: int, iters: int, ceilings: dict) -> dict:
    """Per batch size: plain decode ms against the weight-streaming bound; round costs at
    k = 1..k_max and the speedup each acceptance length would give."""
    measure, rng = timer(w.device, iters), np.random.default_rng(0)
    weight_bytes = sum(p.numel() * p.element_size() for p in w.model.parameters())
    cfg, item = w.model.config, w.model.dtype.itemsize
    kv_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * item * context
    per_seq = math.ceil((context + k_max + 1) / 16)  # blocks per row
    out = {}
    for b in batches:
        tables = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)
        start = np.full(b, context, dtype=np.int64)
        first = torch.from_numpy(rng.integers(0, cfg.vocab_size, b)).to(w.device)
        rounds = {}
        for k in range(1, k_max + 1):
            pos = start[:, None] + np.arange(k + 1)
            slots = (tables[np.arange(b)[:, None], pos // 16] * 16 + pos % 16).astype(np.int64)
            rounds[k] = _time_round(measure, w, sw.graphs, b, k, start, tables, slots, first,
                                    sw.draft.config.hidden_size, rng)
        plain = float(np.median([r["plain_decode_ms"] for r in rounds.values()]))
        row = {"plain_decode_ms": round(plain, 4), "rounds": {str(k): r for k, r in
                                                               rounds.items()}}
        if ceilings:
            bound = (weight_bytes + b * kv_row) / (ceilings["copy_TB_s"] * 1e12) * 1e3
            row.update(bound_ms=round(bound, 4), of_bound=round(plain / bound, 3))
        row["speedup_by_accept_length"] = {
            str(a): round(max(min(a, k + 1) * plain / r["spec_round_ms"]
                              for k, r in rounds.items()), 3) for a in ACCEPT_LENGTHS}
        out[str(b)] = row
    return out


def run_engine(tmp: Path, stand_in: Path, worker, prompts: Path, name: str, *, batch: int,
               max_new: int, device: str, overlap: bool, max_len: int) -> dict:
    """A whole greedy run through the engine with `worker` doing the steps."""
    import pyarrow.parquet as pq

    from eaglebatch.job.config import load_job
    from eaglebatch.prepare import prepare
    from eaglebatch.runner import run_prepared

    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: {stand_in}\ninput:\n  path: {prompts}\noutput:\n  path: {tmp / name}\n"
        f"  include_token_ids: true\nsampling:\n  max_new_tokens: {max_new}\n"
        f"  ignore_eos: true\nengine:\n  device: {device}\n  max_batch_size: {batch}\n"
        f"  max_model_len: {max_len}\n  overlap: {str(overlap).lower()}\n"
        "  max_num_batched_tokens: 16384\n")
    prep = prepare(load_job(job))
    with warnings.catch_warnings(record=True) as syncs:
        warnings.simplefilter("always")
        if device == "cuda":  # every synchronising call the run makes, counted
            torch.cuda.set_sync_debug_mode("warn")
        try:
            res = run_prepared(prep, worker=worker, restart=True)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    tokens = pq.read_table(tmp / name).sort_by("row_index").column("output_token_ids")
    st = res.stats
    where = Counter(str(w.message).split("\n")[0][:120] for w in syncs
                    if "synchroniz" in str(w.message))
    return {"tokens": tokens.to_pylist(), "output_tok_s": round(res.output_tok_s, 1),
            "wall_s": round(res.wall_s, 3), "tpot_p50_ms": round(1e3 * st["tpot_p50"], 3),
            "decode_s": round(st["step_seconds"].get("decode", 0.0), 3),
            "syncs": sum(where.values()), "sync_kinds": dict(where.most_common(5))}


def hf_generate(model, config_dir: Path, batches, max_new: int, context: int) -> dict:
    """transformers' `generate` (eager, greedy) on the target's weights, ms per token."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(config_dir)
    with torch.device(model.device):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=model.dtype)
    missing, _ = hf.load_state_dict(model.state_dict(), strict=False)
    if [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"weights transformers lacks: {missing[:3]}")
    hf.eval()
    out, rng = {}, np.random.default_rng(1)
    for b in batches:
        ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, (b, context))).to(model.device)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        out[str(b)] = {"wall_s": round(wall, 3), "output_tok_s": round(b * max_new / wall, 1)}
    del hf
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="llama-3.1-8b,qwen3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--run-batches", default="1,8,64,256", help="whole runs, overlap off and on")
    ap.add_argument("--hf-batches", default="1,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "flashinfer"],
                    help="attention backend (auto: flashinfer on CUDA when installed); torch "
                    "skips flashinfer's first JIT build")
    ap.add_argument("--skip", default="", help="comma list of: steps,runs,transformers")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
              "python": platform.python_version(), "args": vars(args), "errors": [],
              "device": torch.cuda.get_device_name(dev) if cuda else platform.processor(),
              "shapes": {}}
    save, section = report_file(Path(args.out), report)

    section("ceilings", lambda: report.update(ceilings=device_ceilings(dev)))
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            _one_shape(Path(tmp) / shape, shape, args, report, section)
            gc.collect()  # captured steps hold their worker in reference cycles
            if cuda:
                torch.cuda.empty_cache()
    failed = [f"{s}:runs:{b}" for s, r in report["shapes"].items()
              for b, row in r.get("runs", {}).items() if not row["identical"]]
    report["failed"] = failed
    save()
    print(json.dumps({"failed": failed, "errors": [e["error"] for e in report["errors"]]}))
    return 1 if failed or report["errors"] else 0


def _one_shape(tmp: Path, shape: str, args, report: dict, section) -> None:
    """Builds the shape's target, head and workers, then runs its sections."""
    from eaglebatch.job.engine_settings import flashinfer_importable
    from eaglebatch.model.config import ModelConfig
    from eaglebatch.speculative import init_random_draft

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    backend = args.backend
    if backend == "auto":
        backend = "flashinfer" if cuda and flashinfer_importable() else "torch"
    batches = [int(b) for b in args.batches.split(",")]
    run_batches = [int(b) for b in args.run_batches.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    max_len = args.context + args.max_new + 64
    s = SHAPES[shape]
    config_dir = write_config(tmp / "target", s, dtype, max_len)
    n = s["num_hidden_layers"]
    draft_dir = init_random_draft(tmp / "draft", ModelConfig.from_dir(config_dir), kind="eagle3",
                                  draft_vocab_size=min(32000, s["vocab_size"]), seed=1,
                                  aux_layer_ids=(1, n // 2, n - 1))
    model = build_target(config_dir, dev, getattr(torch, dtype), backend, max_len + 2 * args.k + 2)
    w, sw = build_workers(model, draft_dir, "cuda" if cuda else "eager",
                          max(batches + run_batches), max_len, args.k)
    res = report["shapes"][shape] = {"dtype": dtype, "backend": backend,
                                     "weight_GB": round(sum(p.numel() * p.element_size() for p
                                                            in model.parameters()) / 1e9, 3)}
    if "steps" not in skip:
        section(f"{shape}:steps", lambda: res.update(steps=step_rows(
            w, sw, batches, args.context, args.k, args.iters, report.get("ceilings") or {})))
    if "runs" not in skip:
        section(f"{shape}:runs", lambda: res.update(runs=_runs(
            tmp, w, run_batches, args, s["vocab_size"], max_len)))
    if "transformers" not in skip:
        section(f"{shape}:transformers", lambda: res.update(transformers=hf_generate(
            model, config_dir, [int(b) for b in args.hf_batches.split(",")], args.max_new,
            args.context)))


def _runs(tmp: Path, w, batches, args, vocab: int, max_len: int) -> dict:
    """Whole runs at each batch size (one wave of rows), overlap off then on."""
    stand_in = write_stand_in(tmp / "stand-in", vocab, max_len)
    warm = write_prompts(tmp / "warm.parquet", 2, vocab, 8, 16, 0)  # first-run costs
    run_engine(tmp, stand_in, w, warm, "warm-up", batch=2, max_new=4, device=args.device,
               overlap=False, max_len=max_len)
    out = {}
    for b in batches:
        prompts = write_prompts(tmp / f"p{b}.parquet", b, vocab, args.context // 2,
                                args.context, b)
        kw = dict(batch=b, max_new=args.max_new, device=args.device, max_len=max_len)
        off = run_engine(tmp, stand_in, w, prompts, f"off-{b}", overlap=False, **kw)
        on = run_engine(tmp, stand_in, w, prompts, f"on-{b}", overlap=True, **kw)
        out[str(b)] = {"identical": off.pop("tokens") == on.pop("tokens"), "overlap_off": off,
                       "overlap_on": on,
                       "overlap_speedup": round(on["output_tok_s"] / off["output_tok_s"], 3)}
    return out


if __name__ == "__main__":
    sys.exit(main())
