"""Graph steps on CPU: bucket choice, padding rows and static buffers, the torch backend's uniform
(graph) path against its regular path, and whole runs through the static graph steps run eagerly
("eager" mode) against plain eager runs; configuration errors. The same steps are captured as
CUDA graphs by benchmarks/gpu_check.py on a GPU (and by the CUDA-only test at the end)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from eaglebatch.attention import get_backend
from eaglebatch.cpu import SMALL_GEMM_AVAILABLE
from eaglebatch.errors import JobError
from eaglebatch.graphs import StaticMeta, bucket_for, capture_sizes, fill_rows
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import build_worker, run_prepared
from eaglebatch.speculative import init_random_draft
from paged_kv import PagedSequences
from support.tiny import write_prompts
from test_runner import random_prompts

HQ, HKV, D = 4, 2, 16


def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 24, 64]
    assert bucket_for(65, sizes) is None


def test_static_meta_pads_rows_onto_the_pad_block():
    sm = StaticMeta(max_seqs=8, q_len=3, max_blocks=4, block_size=2, pad_block=9,
                    device=torch.device("cpu"))
    tables = np.array([[1, 2], [3, 4]], dtype=np.int32)
    slots = np.arange(6) + 2
    meta = sm.fill(4, np.array([5, 3]), tables, slots)
    assert meta is sm.view(4)  # one object per bucket: a graph keeps its addresses
    assert meta.seq_lens.tolist() == [5, 3, 3, 3]
    assert meta.block_tables.tolist() == [[1, 2, 9, 9], [3, 4, 9, 9], [9] * 4, [9] * 4]
    assert meta.slot_mapping.tolist() == [2, 3, 4, 5, 6, 7] + [18, 19, 18] * 2
    assert meta.cu_seqlens_q.tolist() == [0, 3, 6, 9, 12]
    # a smaller batch later re-pads the rows it no longer uses
    meta = sm.fill(4, np.array([2]), tables[:1], slots[:3])
    assert meta.seq_lens.tolist() == [2, 3, 3, 3]
    assert meta.block_tables[1].tolist() == [9] * 4
    with pytest.raises(ValueError):
        sm.fill(2, np.array([1, 1, 1]), np.zeros((3, 1), np.int32), np.zeros(9))
    buf = torch.full((6,), 7)
    fill_rows(buf, np.array([1, 2]), 4)
    assert buf.tolist() == [1, 2, 0, 0, 7, 7]


@pytest.mark.parametrize("q_len, lens, bp", [(1, [5, 17, 33], 4), (4, [4, 9, 30], 3),
                                             (3, [40], 8)])
def test_torch_uniform_path_equals_regular_path(q_len, lens, bp):
    """Graph metadata (padded, all block-table columns) gives the same attention as the
    regular per-step plan, and padding rows touch only the pad block."""
    bs, num_blocks = 8, 32
    backend = get_backend("torch")
    seqs = PagedSequences(num_blocks, bs, seed=3)
    cache = torch.randn(2, num_blocks + 1, bs, HKV, D)
    for s, n in enumerate(lens):  # context before this step
        seqs.step([(s, [0] * (n - q_len))]) if n > q_len else None
    _, _, meta = seqs.step([(s, [0] * q_len) for s in range(len(lens))])
    t = meta.num_tokens
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (HQ, HKV, HKV))
    ref_cache = cache.clone()
    backend.prepare(meta)
    ref = backend.forward(0, q, k, v, ref_cache, meta, D**-0.5)

    max_blocks = 6
    sm = StaticMeta(8, q_len, max_blocks, bs, num_blocks, torch.device("cpu"))
    gmeta = sm.fill(bp, meta.seq_lens.numpy(), meta.block_tables.numpy(),
                    meta.slot_mapping.numpy())
    state = backend.make_graph_state(bp, q_len, max_blocks, torch.device("cpu"))
    backend.prepare_graph(gmeta, state)
    pad = bp * q_len - t
    qp = torch.cat([q, torch.randn(pad, HQ, D)])
    kp, vp = (torch.cat([x, torch.randn(pad, HKV, D)]) for x in (k, v))
    out = backend.forward(0, qp, kp, vp, cache, gmeta, D**-0.5)
    torch.testing.assert_close(out[:t], ref, atol=1e-5, rtol=1e-5)
    # the real blocks hold exactly what the regular path wrote; only the pad block differs
    torch.testing.assert_close(cache[:, :num_blocks], ref_cache[:, :num_blocks])


# ---- whole runs through the graph steps (eager on CPU) -----------------------------------------

MAX_NEW = 16


def _job(tmp, model_dir, prompts, name, overrides=()):
    inp = write_prompts(tmp / "in.parquet", prompts)
    job_file = tmp / f"{name}.yaml"
    job_file.write_text(
        f"model: {model_dir}\ninput:\n  path: {inp}\noutput:\n  path: {tmp / name}\n"
        f"  include_token_ids: true\nsampling:\n  max_new_tokens: {MAX_NEW}\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 4096\n  max_model_len: 512\n"
    )
    return prepare(load_job(job_file, list(overrides)))


def _outputs(prep, worker):
    res = run_prepared(prep, worker=worker)
    rows = pq.read_table(prep.job.output.path).sort_by("row_index").to_pylist()
    return [r["output_token_ids"] for r in rows], res


@pytest.fixture(scope="module")
def graph_prompts():
    return random_prompts(11, seed=21)


@pytest.fixture(scope="module")
def eagle3_dir(tiny_model_dir, tmp_path_factory):
    return init_random_draft(tmp_path_factory.mktemp("g") / "e3", tiny_model_dir, kind="eagle3",
                             draft_vocab_size=200, seed=4, aux_layer_ids=(0, 1, 2))


@pytest.mark.parametrize("batch", [3, 8])
def test_plain_decode_through_graph_steps_equals_eager(tmp_path, tiny_model_dir, graph_prompts,
                                                       batch):
    pytest.importorskip("eaglebatch._native")
    over = [f"engine.max_batch_size={batch}"]
    prep = _job(tmp_path, tiny_model_dir, graph_prompts, "eager", over)
    ref, _ = _outputs(prep, build_worker(prep, graph_mode="off"))
    prep = _job(tmp_path, tiny_model_dir, graph_prompts, "graph", over)
    worker = build_worker(prep, graph_mode="eager")
    got, res = _outputs(prep, worker)
    assert got == ref
    g = res.stats["cuda_graphs"]
    assert g["mode"] == "eager" and g["replays"] > 0 and g["eager_steps"] == 0
    assert g["graphs"] == len(capture_sizes(batch))


@pytest.mark.parametrize(
    "k, batch, adaptive, lookup, lookup_tokens",
    [(3, 8, False, 3, 3), (2, 5, True, 3, 8), (1, 4, False, 3, 1), (3, 2, False, 1, 6),
     (2, 4, True, 1, 5)],
)
def test_speculative_through_graph_steps_equals_plain(tmp_path, tiny_model_dir, graph_prompts,
                                                      eagle3_dir, k, batch, adaptive, lookup,
                                                      lookup_tokens):
    """Draft loop, verify and draft-extend through their graph steps, batches shrinking as
    requests finish (every bucket edge on the way), against plain eager greedy; with lookup
    1, prompt-lookup rounds (up to lookup_tokens wide) go through the verify and extend graphs
    too."""
    pytest.importorskip("eaglebatch._native")
    prep = _job(tmp_path, tiny_model_dir, graph_prompts, "plain",
                [f"engine.max_batch_size={batch}"])
    ref, _ = _outputs(prep, build_worker(prep, graph_mode="off"))
    over = [f"draft={eagle3_dir}", f"speculative.num_steps={k}",
            f"speculative.adaptive={str(adaptive).lower()}", f"engine.max_batch_size={batch}",
            f"speculative.prompt_lookup_min={lookup}",
            f"speculative.prompt_lookup_tokens={lookup_tokens}"]
    prep = _job(tmp_path, tiny_model_dir, graph_prompts, "spec", over)
    worker = build_worker(prep, graph_mode="eager")
    got, res = _outputs(prep, worker)
    assert got == ref
    g = res.stats["cuda_graphs"]
    assert g["replays"] > 0 and res.stats["spec_steps"] > 0
    if lookup == 1 and not adaptive:  # the adaptive policy prices rounds by measured step
        # times, so whether it runs lookup rounds at all depends on the machine's load
        assert res.stats["drafts"]["lookup_rows"] > 0
    # per bucket: verify + extend for k = 0..W (W = max(K, lookup_tokens)), the loop for 1..K
    assert g["graphs"] == len(capture_sizes(batch)) * (2 * (max(k, lookup_tokens) + 1) + k)


def test_batches_above_the_largest_bucket_run_eagerly(tmp_path, tiny_model_dir, graph_prompts,
                                                      eagle3_dir):
    pytest.importorskip("eaglebatch._native")
    prep = _job(tmp_path, tiny_model_dir, graph_prompts, "plain", ["engine.max_batch_size=8"])
    ref, _ = _outputs(prep, build_worker(prep, graph_mode="off"))
    prep = _job(tmp_path, tiny_model_dir, graph_prompts, "spec",
                [f"draft={eagle3_dir}", "engine.max_batch_size=8", "speculative.num_steps=2"])
    worker = build_worker(prep, graph_mode="off")
    worker.enable_graphs("eager", max_batch_size=2)  # buckets 1, 2 only
    got, res = _outputs(prep, worker)
    assert got == ref
    g = res.stats["cuda_graphs"]
    assert g["eager_steps"] > 0 and g["replays"] > 0


def test_graph_configuration_errors(tmp_path, tiny_model_dir):
    with pytest.raises(JobError, match="engine.cuda_graph"):
        _job(tmp_path, tiny_model_dir, ["hi"], "x", ["engine.cuda_graph=true"])
    with pytest.raises(JobError, match="engine.attention_backend"):
        _job(tmp_path, tiny_model_dir, ["hi"], "x", ["engine.attention_backend=flashinfer"])
    with pytest.raises(JobError, match="engine.cpu_gemm"):  # refused before any work
        _job(tmp_path, tiny_model_dir, ["hi"], "x", ["engine.cpu_gemm=native",
                                                    "engine.dtype=bfloat16"])
    prep = _job(tmp_path, tiny_model_dir, ["hi"], "x", ["engine.cuda_graph=false"])
    worker = build_worker(prep)
    assert worker.graph_stats() is None  # off on CPU by default
    # the native small GEMM is on for a float32 CPU run wherever the CPU can run it
    on = torch.get_num_threads() if SMALL_GEMM_AVAILABLE else 0
    assert getattr(worker.model, "small_gemm_threads", 0) == on
    assert getattr(worker.model.model.layers[0].mlp.down_proj, "small_gemm_threads", 0) == on


def test_backend_without_graph_support_is_refused(tmp_path, tiny_model_dir):
    prep = _job(tmp_path, tiny_model_dir, ["hi"], "x")
    worker = build_worker(prep, graph_mode="off")
    worker.model.backend.supports_cuda_graphs = False  # instance attribute: this worker only
    with pytest.raises(JobError, match="cannot run inside CUDA graphs"):
        worker.enable_graphs("eager", 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_run_equals_eager(tmp_path, tiny_model_dir, graph_prompts, eagle3_dir):
    over = ["engine.device=cuda", "engine.dtype=float32", "engine.attention_backend=torch",
            f"draft={eagle3_dir}", "engine.max_batch_size=8"]
    prep = _job(tmp_path, tiny_model_dir, graph_prompts, "eager", over)
    ref, _ = _outputs(prep, build_worker(prep, graph_mode="off"))
    prep = _job(tmp_path, tiny_model_dir, graph_prompts, "cuda", over)
    got, res = _outputs(prep, build_worker(prep, graph_mode="cuda"))
    assert got == ref and res.stats["cuda_graphs"]["replays"] > 0


def test_backend_and_graph_mode_selection(monkeypatch):
    from eaglebatch.job import engine_settings as w

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(w, "flashinfer_importable", lambda: True)
    assert w.resolve_backend("auto", cpu) == "cpu"  # flashinfer is never picked on CPU
    assert w.resolve_backend("torch", cpu) == "torch"
    with pytest.raises(JobError, match="'cpu' needs engine.device cpu"):
        w.resolve_backend("cpu", cuda)
    assert w.resolve_backend("auto", cuda) == "flashinfer"
    assert w.resolve_backend("torch", cuda) == "torch"
    with pytest.raises(JobError, match="needs engine.device cuda"):
        w.resolve_backend("flashinfer", cpu)
    # a model whose layers differ in head shapes (Gemma 4): torch, flashinfer refused by key
    assert w.resolve_backend("auto", cuda, uniform_heads=False) == "torch"
    with pytest.raises(JobError, match="engine.attention_backend: 'flashinfer' plans one head"):
        w.resolve_backend("flashinfer", cuda, uniform_heads=False)
    # a model with attention sinks (gpt-oss): torch, flashinfer refused naming the feature
    assert w.resolve_backend("auto", cuda, sinks=True) == "torch"
    with pytest.raises(JobError, match="engine.attention_backend: 'flashinfer' does not attend "
                                       "with attention sinks"):  # fmt: skip
        w.resolve_backend("flashinfer", cuda, sinks=True)
    monkeypatch.setattr(w, "flashinfer_importable", lambda: False)
    assert w.resolve_backend("auto", cuda) == "torch"
    with pytest.raises(JobError, match="not installed"):
        w.resolve_backend("flashinfer", cuda)
    assert w.resolve_graph_mode(None, cpu) == "off"
    assert w.resolve_graph_mode(None, cuda) == "cuda"
    assert w.resolve_graph_mode(False, cuda) == "off"
    with pytest.raises(JobError, match="engine.cuda_graph"):
        w.resolve_graph_mode(True, cpu)


def test_graph_reserve_grows_with_batch_queries_and_context():
    from eaglebatch.graphs import graph_reserve_bytes

    class Shape:  # SmolLM2-135M's shape
        vocab_size, hidden_size, intermediate_size = 49152, 576, 1536
        num_experts = num_experts_per_tok = moe_intermediate_size = 0
        num_key_value_heads, num_attention_heads, head_dim, num_hidden_layers = 3, 9, 64, 30

        def heads_of(self, layer: int) -> tuple[int, int, int]:
            return 9, 3, 64

    Cfg = Shape()

    base = graph_reserve_bytes(Cfg, 64, 4, 8192, 2)
    assert base > 2 * 64 * 8192 * 2 * 3 * 64 * 2  # at least the torch backend's K/V gather
    assert graph_reserve_bytes(Cfg, 64, 1, 8192, 2) < base
    assert graph_reserve_bytes(Cfg, 8, 4, 8192, 2) < base
    assert graph_reserve_bytes(Cfg, 64, 4, 1024, 2) < base


def test_graph_reserve_holds_the_routed_experts_rows():
    """A Qwen3-30B-A3B-shaped layer: the grouped GEMMs hold 8 expert rows per token (gathered
    input, gate/up, activation, output), more than the dense MLP's intermediates."""
    from types import SimpleNamespace

    from eaglebatch.graphs import graph_reserve_bytes

    cfg = SimpleNamespace(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          num_attention_heads=32, num_hidden_layers=48,
                          heads_of=lambda layer: (32, 4, 128))  # fmt: skip
    rows = 2048  # decode, one token per row; short contexts: the MLP dominates
    experts = rows * 8 * (3 * 768 + 4 * 2048) * 2
    reserve = graph_reserve_bytes(cfg, rows, 1, 16, 2)
    assert reserve > 2 * experts + 16 * rows * 2048 * 2
    dense = SimpleNamespace(**{**vars(cfg), "num_experts": 0})
    assert graph_reserve_bytes(dense, rows, 1, 16, 2) < reserve
