"""The GPU device check: correctness of the CUDA path, then step timings, into one JSON file.

    python benchmarks/gpu_check.py --out gpu_check.json             # on the GPU (SmolLM2 shape)
    python benchmarks/gpu_check.py --shape tiny --device cpu ...    # the CPU test of this script

The real weights do not travel to the device machine, so the target is SmolLM2-135M-shaped
(30 layers, 576 wide, 9/3 heads, 49,152 tokens, tied) with random unit-scale weights (peaky
logits: float32 greedy ties are rare, but bf16 rounding moves logits by several units), the
draft a random EAGLE-3 head, and the tokenizer a word-level one over the whole vocabulary
("w0".."w49151"); prompts are random words.

Checks:
  * speculative == plain greedy, and CUDA graphs == eager: float32, torch backend, exact tokens,
    at every batch size, each through the whole engine (Rust scheduler, paged KV, the worker);
  * bf16 kernels (torch, and flashinfer when present) against the float32 reference, teacher
    forced (the float32 run's tokens fed back through prefill, decode and 4-token steps) at the
    first two batch sizes: flashinfer passes if it picks the reference's greedy token within 0.02
    as often as torch's own bf16 path does. Free-running bf16 runs are not compared token for
    token: one rounding flip parts them for good (on this random model, torch bf16 against
    torch float32 keeps ~3% of tokens); whole flashinfer runs report throughput and that
    divergence for information.
Timings (bfloat16, the torch backend, then flashinfer when present; context --context tokens per
row), per batch size, eager (the same static step functions, uncaptured) against graph replay:
a plain decode step; a speculative round's draft loop, verify and draft-extend. Plus output
tok/s of whole runs (plain vs speculative, graphs on), transformers `generate` on the same
model (eager) as the baseline, and the device's measured copy bandwidth and bf16 matmul
throughput, with each step's bytes and FLOPs so the JSON says which steps are launch-,
bandwidth- or compute-bound.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
}


# ---- the synthetic model, draft and prompts ----------------------------------------------------


def make_model_dir(out: Path, shape: str, seed: int = 0) -> Path:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from eaglebatch.model.causal_lm import CausalLM
    from eaglebatch.model.config import ModelConfig

    out.mkdir(parents=True, exist_ok=True)
    s = SHAPES[shape]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "head_dim": s["hidden_size"] // s["num_attention_heads"], "max_position_embeddings":
           8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
           "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32", **s}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_dir(out))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(mean=1.0, std=0.1)
            elif "embed_tokens" in name:
                p.normal_(std=1.0)
            else:
                p.normal_(std=1.5 / p.shape[1] ** 0.5)
    save_file({k: v.contiguous() for k, v in model.named_parameters()},
              str(out / "model.safetensors"))
    vocab = {f"w{i}": i for i in range(s["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({}))
    return out


def make_draft_dir(out: Path, model_dir: Path) -> Path:
    from eaglebatch.model.config import ModelConfig
    from eaglebatch.speculative import init_random_draft

    n = ModelConfig.from_dir(model_dir).num_hidden_layers
    return init_random_draft(out, model_dir, kind="eagle3", seed=1,
                             draft_vocab_size=min(8192, ModelConfig.from_dir(model_dir).vocab_size),
                             aux_layer_ids=(1, n // 2, n - 1))


def write_prompts(path: Path, n: int, vocab: int, lo: int, hi: int, seed: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = [" ".join(f"w{rng.randrange(vocab)}" for _ in range(rng.randint(lo, hi)))
            for _ in range(n)]
    pq.write_table(pa.table({"prompt": rows}), path)
    return path


def read_prompt_ids(path: Path) -> list[list[int]]:
    """The token ids of write_prompts' prompts (word "w<i>" is token i)."""
    import pyarrow.parquet as pq

    return [[int(w[1:]) for w in p.split()]
            for p in pq.read_table(path).column("prompt").to_pylist()]


# ---- whole runs through the engine ------------------------------------------------------------


def run_job(tmp: Path, model_dir: Path, prompts: Path, name: str, *, batch: int, max_new: int,
            dtype: str, backend: str, device: str, graphs: str, draft: Path | None = None,
            k: int = 3) -> dict:
    import pyarrow.parquet as pq

    from eaglebatch.job.config import load_job
    from eaglebatch.prepare import prepare
    from eaglebatch.runner import build_worker, run_prepared

    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: {model_dir}\ninput:\n  path: {prompts}\noutput:\n  path: {tmp / name}\n"
        f"  include_token_ids: true\nsampling:\n  max_new_tokens: {max_new}\n"
        f"engine:\n  device: {device}\n  dtype: {dtype}\n  attention_backend: {backend}\n"
        f"  max_batch_size: {batch}\n  max_model_len: 1024\n  kv_cache_tokens: "
        f"{max(batch, 8) * 1100}\n"
        + (f"draft: {draft}\nspeculative:\n  num_steps: {k}\n  adaptive: false\n" if draft
           else "")
    )
    prep = prepare(load_job(job))
    worker = build_worker(prep, graph_mode=graphs)
    res = run_prepared(prep, worker=worker, restart=True)
    rows = pq.read_table(tmp / name).sort_by("row_index").column("output_token_ids").to_pylist()
    st = res.stats
    return {"tokens": rows, "output_tok_s": round(res.output_tok_s, 1),
            "wall_s": round(res.wall_s, 3), "output_tokens": st["output_tokens"],
            "accept_length": (round(st["spec_tokens"] / st["spec_steps"], 3)
                              if st.get("spec_steps") else None),
            "cuda_graphs": st.get("cuda_graphs")}


def compare(a: list, b: list) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    total = sum(len(x) for x in a)
    match = sum(sum(p == q for p, q in zip(x, y)) for x, y in zip(a, b))
    first = next(({"row": i, "position": next((j for j, (p, q) in enumerate(zip(x, y))
                                               if p != q), min(len(x), len(y)))}
                  for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return {"identical_rows": same, "rows": len(a), "token_match_rate":
            round(match / max(total, 1), 4), "first_divergence": first}


def teacher_forced(model_dir: Path, prompts: list[list[int]], outputs: list[list[int]], *,
                   dtype: str, backend: str, device: str, block_size: int = 16,
                   chunks: tuple[int, ...] = (1, 4)) -> tuple[torch.Tensor, list]:
    """(float32 logits [N, V], [(sequence, position)] * N) at every fed position from each
    prompt's last token on, with the input fixed: one prefill of all prompts, then their given
    continuations fed in uniform steps of `chunks` tokens per sequence in turn (1: decode
    kernels, 4: verify-shaped steps on top of a prefix). Free-running bf16 generations part at
    the first rounding flip (and a random model's do at once), so kernels are compared here, on
    the same inputs, position by position."""
    from eaglebatch.attention import allocate_kv_cache, get_backend
    from eaglebatch.attention.base import AttentionMetadata
    from eaglebatch.model.causal_lm import CausalLM

    dt = getattr(torch, dtype)
    model = CausalLM.from_pretrained(model_dir, dtype=dt, device=device,
                                             backend=get_backend(backend))
    seqs = [p + o for p, o in zip(prompts, outputs)]
    need = [-(-len(s) // block_size) for s in seqs]
    perm = np.random.default_rng(0).permutation(sum(need)).astype(np.int32)  # scattered blocks
    tables = np.zeros((len(seqs), max(need)), dtype=np.int32)
    for i, start in enumerate(np.cumsum([0] + need[:-1])):
        tables[i, : need[i]] = perm[start : start + need[i]]
    kv = allocate_kv_cache(model.config, sum(need), block_size, dt, device)
    done = [0] * len(seqs)  # tokens of each sequence already in the cache
    logits, where, step = [], [], 0
    with torch.no_grad():
        while any(d < len(s) for d, s in zip(done, seqs)):
            first = step == 0  # the prefill of every prompt
            rows = [i for i, s in enumerate(seqs) if done[i] < len(s)]
            n = {i: len(prompts[i]) if first else min(chunks[(step - 1) % len(chunks)],
                                                       len(seqs[i]) - done[i]) for i in rows}
            step += 1
            ids, pos, slots, cu, lens = [], [], [], [0], []
            for i in rows:
                for p in range(done[i], done[i] + n[i]):
                    ids.append(seqs[i][p])
                    pos.append(p)
                    slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
                cu.append(cu[-1] + n[i])
                lens.append(done[i] + n[i])
            meta = AttentionMetadata.from_numpy(np.array(cu), np.array(lens), tables[rows],
                                                np.array(slots), block_size, device)
            model.backend.prepare(meta)
            hidden = model(torch.tensor(ids, device=device), torch.tensor(pos, device=device),
                           meta, kv)
            keep = [cu[j + 1] - 1 for j in range(len(rows))] if first else list(range(len(ids)))
            logits.append(model.compute_logits(hidden[keep]).cpu())
            where += [(i, done[i] + n[i] - 1) for i in rows] if first else [
                (i, p) for i in rows for p in range(done[i], done[i] + n[i])]
            for i in rows:
                done[i] += n[i]
    return torch.cat(logits), where


def agreement(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    """How far `logits` [N, V] are from the reference's: greedy-choice agreement, logit error."""
    err = (logits - ref).abs()
    return {"argmax_agree": round((logits.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
            "max_abs_logit_err": round(err.max().item(), 4),
            "mean_abs_logit_err": round(err.mean().item(), 5),
            "finite": bool(torch.isfinite(logits).all())}


# ---- step timings ------------------------------------------------------------------------------


def timer(device: torch.device, iters: int):
    def measure(fn) -> float:
        """Median milliseconds of fn() over `iters` calls after 3 warm-ups."""
        for _ in range(3):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return round(float(np.median(times)), 4)

    return measure


def step_timings(model_dir: Path, draft_dir: Path, device: str, dtype: str, backend: str,
                 batches: list[int], context: int, k: int, iters: int) -> dict:
    """Per batch size: eager vs graph time of a plain decode step and of each stage of a
    speculative round, on static buffers filled as the engine fills them."""
    from eaglebatch.attention import allocate_kv_cache, get_backend
    from eaglebatch.model.causal_lm import CausalLM
    from eaglebatch.speculative.eagle import load_draft
    from eaglebatch.speculative.worker import SpecWorker
    from eaglebatch.worker import KvBudget, Worker

    dev = torch.device(device)
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    bs, max_len, mb = 16, context + 64, max(batches)
    model = CausalLM.from_pretrained(model_dir, dtype=dt, device=dev,
                                             backend=get_backend(backend), max_positions=max_len)
    blocks_per_seq = math.ceil((context + k + 1) / bs)
    num_blocks = mb * blocks_per_seq
    budget = KvBudget(num_blocks, bs, 0)
    kv = allocate_kv_cache(model.config, num_blocks + 1, bs, dt, dev)
    draft = load_draft(draft_dir, model.config, model, dtype=dt, device=dev,
                       max_positions=max_len + k)
    draft_kv = draft.allocate_kv_cache(num_blocks + 1, bs)
    measure = timer(dev, iters)
    rng = np.random.default_rng(0)
    out = {}
    workers = {}
    for mode in ("eager", "cuda") if dev.type == "cuda" else ("eager",):
        w = Worker(model, kv, budget, max_len)
        w.enable_graphs(mode, mb)
        sw = SpecWorker(w, draft, num_steps=k, max_batch_size=mb, adaptive=False,
                        draft_kv_cache=draft_kv)
        sw.enable_graphs(mode, mb)
        workers[mode] = (w, sw)
    for b in batches:
        tables = np.arange(b * blocks_per_seq, dtype=np.int32).reshape(b, blocks_per_seq)
        start = np.full(b, context, dtype=np.int64)  # L-1: the last committed token's position
        pos = start[:, None] + np.arange(k + 1)  # [b, k+1]
        slots = (tables[np.arange(b)[:, None], pos // bs] * bs + pos % bs).astype(np.int64)
        first = torch.from_numpy(rng.integers(0, model.config.vocab_size, b)).to(dev)
        row = {}
        for mode, (w, sw) in workers.items():
            row[mode] = _time_round(measure, w, sw.graphs, b, k, start, tables, slots, first,
                                    draft.config.hidden_size, rng)
        row["roofline"] = roofline(model, draft, b, k, context, dt, row)
        out[str(b)] = row
    return out


@torch.inference_mode()
def _time_round(measure, w, g, b, k, start, tables, slots, first, hidden, rng) -> dict:
    """One batch size, one mode: a plain decode step and the three stages of a round."""
    model, dev = w.model, w.device
    bp = g.bucket(b)

    class Plan:  # a decode plan as the Rust scheduler hands it over
        num_seqs = b
        cu_seqlens_q = np.arange(b + 1, dtype=np.int32)
        seq_lens = (start + 1).astype(np.int32)
        block_tables = tables
        slot_mapping = slots[:, 0]
        input_ids = rng.integers(0, model.config.vocab_size, b)
        positions = start
        prev_rows = np.full(b, -1, dtype=np.int32)  # no placeholders

    h0 = torch.randn(b, hidden, dtype=g.h0.dtype, device=dev)
    ids = g.draft_chain(bp, k, h0, start, tables, slots)
    tokens = g.target_verify(bp, k, first, ids, start, tables, slots).argmax(-1)
    acc = torch.zeros(b, dtype=torch.long, device=dev)
    r = {
        "plain_decode_ms": measure(lambda: w._decode_logits(Plan)),
        "draft_loop_ms": measure(lambda: g.draft_chain(bp, k, h0, start, tables, slots)),
        "verify_ms": measure(lambda: g.target_verify(bp, k, first, ids, start, tables, slots)),
        "draft_extend_ms": measure(lambda: g.draft_extend(bp, k, tokens, acc)),
    }
    r["spec_round_ms"] = round(r["draft_loop_ms"] + r["verify_ms"] + r["draft_extend_ms"], 4)
    return r


def roofline(model, draft, b: int, k: int, context: int, dt, row: dict) -> dict:
    """Bytes and FLOPs of each step (weights once per step, KV read per row, 2 FLOPs per MAC)."""
    cfg = model.config
    item = torch.empty((), dtype=dt).element_size()
    w_target = sum(p.numel() for p in model.parameters()) * item
    w_draft = sum(p.numel() for p in draft.parameters()) * item
    kv_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * item * context
    n_target = sum(p.numel() for p in model.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    return {
        "plain_decode": {"bytes": w_target + b * kv_row, "flops": 2 * n_target * b},
        "verify": {"bytes": w_target + b * kv_row, "flops": 2 * n_target * b * (k + 1)},
        "draft_loop": {"bytes": k * w_draft, "flops": 2 * n_draft * b * k},
        "draft_extend": {"bytes": w_draft, "flops": 2 * n_draft * b * (k + 1)},
    }


def device_ceilings(dev: torch.device) -> dict:
    if dev.type != "cuda":
        return {}
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    measure = timer(dev, 10)
    copy_ms = measure(lambda: y.copy_(x))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    mm_ms = measure(lambda: a @ a)
    return {"copy_TB_s": round(2 * x.numel() / copy_ms / 1e9, 2),
            "bf16_matmul_TFLOP_s": round(2 * 8192**3 / mm_ms / 1e9, 1)}


def classify(row: dict, ceilings: dict, mode: str) -> dict:
    """Fraction of the bandwidth and compute ceilings each graph step reaches."""
    if not ceilings:
        return {}
    out = {}
    for step, key in (("plain_decode", "plain_decode_ms"), ("verify", "verify_ms"),
                      ("draft_loop", "draft_loop_ms"), ("draft_extend", "draft_extend_ms")):
        ms = row[mode][key]
        bw = row["roofline"][step]["bytes"] / (ms * 1e-3) / 1e12 / ceilings["copy_TB_s"]
        fl = row["roofline"][step]["flops"] / (ms * 1e-3) / 1e12 / ceilings[
            "bf16_matmul_TFLOP_s"]
        bound = ("bandwidth" if bw >= 0.5 else "compute" if fl >= 0.5 else "launch/latency")
        out[step] = {"of_bandwidth": round(bw, 3), "of_compute": round(fl, 3), "bound": bound}
    return out


def hf_baseline(model_dir: Path, prompts: Path, batch: int, max_new: int, device: str) -> dict:
    """transformers `generate` (eager, greedy, bf16) on the same weights, left-padded batches."""
    import transformers

    tok_ids = read_prompt_ids(prompts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(
        device).eval()
    out_tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(tok_ids), batch):
        chunk = tok_ids[i : i + batch]
        n = max(len(c) for c in chunk)
        ids = torch.tensor([[0] * (n - len(c)) + c for c in chunk], device=device)
        mask = torch.tensor([[0] * (n - len(c)) + [1] * len(c) for c in chunk], device=device)
        with torch.no_grad():
            g = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                            min_new_tokens=max_new, do_sample=False, pad_token_id=0)
        out_tokens += (g.shape[1] - n) * len(chunk)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"output_tok_s": round(out_tokens / wall, 1), "wall_s": round(wall, 3)}


# ---- main ---------------------------------------------------------------------------------------


def report_file(out: Path, report: dict):
    """(save, section) over the JSON report at `out`: save() writes it; section(name, fn) runs
    one section (run_section) and saves."""
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")

    return save, lambda name, fn: run_section(report, save, name, fn)


def run_section(report: dict, save, name: str, fn) -> None:
    """Runs one section of a device script; an error is recorded with its trace and the script
    goes on (every section's result is worth having); the JSON is saved after it."""
    t = time.perf_counter()
    try:
        fn()
    except Exception as e:
        report["errors"].append({"section": name, "error": repr(e),
                                 "trace": traceback.format_exc()[-3000:]})
    report.setdefault("section_s", {})[name] = round(time.perf_counter() - t, 1)
    save()
    print(f"[{name}] done in {report['section_s'][name]} s", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--skip", default="",
                    help="comma list of: correctness,kernels,flashinfer,timing,hf")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    graphs = "cuda" if cuda else "eager"
    from eaglebatch.job.engine_settings import flashinfer_importable

    fast_backend = "flashinfer" if cuda and flashinfer_importable() else "torch"
    name = torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu"
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "device": name, "shape": args.shape,
                    "k": args.k, "max_new_tokens": args.max_new, "context": args.context,
                    "fast_backend": fast_backend, "checks": {}, "errors": []}
    save, section = report_file(Path(args.out), report)

    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        model_dir = make_model_dir(tmp / "model", args.shape)
        draft_dir = make_draft_dir(tmp / "draft", model_dir)
        vocab = SHAPES[args.shape]["vocab_size"]
        common = dict(max_new=args.max_new, device=args.device)
        fp32_refs: dict[int, dict] = {}

        def prompts_for(b: int) -> Path:
            """The prompts of batch size b (the same file for every section)."""
            path = tmp / f"p{b}.parquet"
            return path if path.is_file() else write_prompts(path, max(2 * b, 4), vocab, 16, 200, b)

        def fp32_reference(b: int) -> dict:
            """Plain eager float32 decoding with the torch backend, run once per batch size: what
            the engine checks and the kernel check compare with."""
            if b not in fp32_refs:
                fp32_refs[b] = run_job(tmp, model_dir, prompts_for(b), f"plain-eager-{b}",
                                       batch=b, dtype="float32", backend="torch", graphs="off",
                                       **common)
            return fp32_refs[b]

        def correctness():
            for b in batches:
                prompts = prompts_for(b)
                kw = dict(common, batch=b, dtype="float32", backend="torch")
                ref = fp32_reference(b)
                runs = {
                    "plain_graph": run_job(tmp, model_dir, prompts, f"plain-graph-{b}",
                                           graphs=graphs, **kw),
                    "spec_eager": run_job(tmp, model_dir, prompts, f"spec-eager-{b}",
                                          graphs="off", draft=draft_dir, k=args.k, **kw),
                    "spec_graph": run_job(tmp, model_dir, prompts, f"spec-graph-{b}",
                                          graphs=graphs, draft=draft_dir, k=args.k, **kw),
                }
                res = {name: compare(ref["tokens"], r["tokens"]) for name, r in runs.items()}
                for r in res.values():
                    r["pass"] = r["identical_rows"] == r["rows"]
                res["plain_tok_s"] = {"eager": ref["output_tok_s"],
                                      "graph": runs["plain_graph"]["output_tok_s"]}
                res["spec_tok_s"] = {"eager": runs["spec_eager"]["output_tok_s"],
                                     "graph": runs["spec_graph"]["output_tok_s"]}
                res["graphs"] = runs["spec_graph"]["cuda_graphs"]
                report["checks"].setdefault("float32_torch", {})[str(b)] = res

        def kernels():
            """bf16 attention kernels against the float32 reference on the same inputs: torch's
            bf16 path sets the bar (its own rounding), flashinfer must stay as close."""
            low = "bfloat16"
            cands = ["torch"] + (["flashinfer"] if fast_backend == "flashinfer" else [])
            for b in batches[:2]:
                ref_run = fp32_reference(b)
                ids = read_prompt_ids(prompts_for(b))
                tf = dict(device=args.device)
                ref, where = teacher_forced(model_dir, ids, ref_run["tokens"], dtype="float32",
                                            backend="torch", **tf)
                res = {name: agreement(teacher_forced(model_dir, ids, ref_run["tokens"],
                                                      dtype=low, backend=name, **tf)[0], ref)
                       for name in cands}
                res["positions"] = int(ref.shape[0])
                # the float32 reference fed the run's own tokens must choose them again
                seqs = [p + o for p, o in zip(ids, ref_run["tokens"])]
                nxt = [(j, seqs[i][p + 1]) for j, (i, p) in enumerate(where)
                       if p + 1 < len(seqs[i])]
                chosen = ref.argmax(-1)
                res["reference_reproduces_run"] = round(
                    sum(int(chosen[j]) == t for j, t in nxt) / max(len(nxt), 1), 4)
                if "flashinfer" in res:
                    fi, bar = res["flashinfer"], res["torch"]
                    fi["pass"] = fi["finite"] and fi["argmax_agree"] >= bar["argmax_agree"] - 0.02
                report["checks"].setdefault("bfloat16_kernels_vs_float32", {})[str(b)] = res

        def flashinfer():
            """Whole runs with flashinfer (graphs on): throughput, and how far free-running bf16
            generations stay together (information only: see kernels())."""
            if fast_backend != "flashinfer":
                report["checks"]["flashinfer"] = "flashinfer not importable: skipped"
                return
            for b in batches:
                prompts = prompts_for(b)
                kw = dict(common, batch=b, dtype="bfloat16", graphs=graphs)
                t = run_job(tmp, model_dir, prompts, f"bf16-torch-{b}", backend="torch", **kw)
                f = run_job(tmp, model_dir, prompts, f"bf16-fi-{b}", backend="flashinfer", **kw)
                fs = run_job(tmp, model_dir, prompts, f"bf16-fi-spec-{b}", backend="flashinfer",
                             draft=draft_dir, k=args.k, **kw)
                report["checks"].setdefault("bfloat16_flashinfer_runs", {})[str(b)] = {
                    "free_running_flashinfer_vs_torch": compare(t["tokens"], f["tokens"]),
                    "free_running_spec_vs_plain": compare(f["tokens"], fs["tokens"]),
                    "tok_s": {"torch_plain": t["output_tok_s"], "flashinfer_plain":
                              f["output_tok_s"], "flashinfer_spec": fs["output_tok_s"]},
                    "spec_accept_length": fs["accept_length"]}

        def timing(backend: str):
            dtype = "bfloat16" if cuda else "float32"
            rows = step_timings(model_dir, draft_dir, args.device, dtype, backend,
                                batches, args.context, args.k, args.iters)
            if "ceilings" not in report:
                report["ceilings"] = device_ceilings(dev)
            for row in rows.values():
                if "cuda" in row:
                    row["bound"] = classify(row, report["ceilings"], "cuda")
            report.setdefault("timings", {})[backend] = rows

        def hf():
            for b in batches:
                prompts = prompts_for(b)
                report.setdefault("transformers_generate", {})[str(b)] = hf_baseline(
                    model_dir, prompts, b, args.max_new, args.device)

        # cheapest and most important first: the JSON is rewritten after every section, so a
        # run cut short (flashinfer's first JIT build can take minutes) keeps what it measured
        sections = [("correctness", correctness), ("kernels", kernels),
                    ("timing", lambda: timing("torch")), ("hf", hf), ("flashinfer", flashinfer)]
        if fast_backend == "flashinfer":
            sections.append(("flashinfer_timing", lambda: timing("flashinfer")))
        for name, fn in sections:
            if name.removesuffix("_timing") not in skip and name not in skip:
                section(name, fn)
    failed = [f"{b}:{n}" for b, r in report["checks"].get("float32_torch", {}).items()
              for n, v in r.items() if isinstance(v, dict) and v.get("pass") is False]
    failed += [f"{b}:flashinfer" for b, r in report["checks"].get(
        "bfloat16_kernels_vs_float32", {}).items() if r.get("flashinfer", {}).get("pass") is False]
    report["failed"] = failed
    save()
    print(json.dumps({"failed": failed, "errors": [e["error"] for e in report["errors"]]}))
    return 1 if failed or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
