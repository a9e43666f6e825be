"""The memory promise (job/memory.py): `validate` and `run` say what the model, the KV cache
and the buffers will take, and refuse with exit 2 naming engine.kv_cache_tokens or the model
what cannot fit, before any work; the model's figure is what the loaded model holds."""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from eaglebatch.cli import main
from eaglebatch.job import memory
from support.tiny import make_tiny_model, write_prompts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("mem"), hidden_size=32, num_layers=2,
                           num_heads=2, num_kv_heads=1)  # fmt: skip


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A model of 8192 positions: max_batch_size whole sequences would be 64 x 8192 tokens."""
    return make_tiny_model(tmp_path_factory.mktemp("mem-long"), hidden_size=32, num_layers=2,
                           num_heads=2, num_kv_heads=1, max_position_embeddings=8192)  # fmt: skip


def _job(tmp_path, model, engine: str = "", rows: int = 1) -> str:
    job = tmp_path / "job.yaml"
    prompts = write_prompts(tmp_path / "in.parquet", ["hi"] * rows)
    job.write_text(
        f"model: {model}\ninput:\n  path: {prompts}\n"
        f"output:\n  path: {tmp_path / 'out'}\nsampling:\n  max_new_tokens: 2\n"
        f"engine:\n  device: cpu\n{engine}"
    )
    return str(job)


def test_validate_and_run_say_what_the_run_will_hold(tmp_path, model):
    job = _job(tmp_path, model, "  kv_cache_tokens: 1024\n")
    for cmd in ("validate", "run"):
        r = CliRunner().invoke(main, [cmd, job])
        assert r.exit_code == 0, r.output
        line = "memory: model 0.00 GiB + KV cache 0.00 GiB (engine.kv_cache_tokens) + buffers"
        assert line in r.output, r.output


def test_a_kv_cache_larger_than_memory_is_refused_naming_the_key(tmp_path, model):
    r = CliRunner().invoke(main, ["run", _job(tmp_path, model, "  kv_cache_tokens: 2000000000\n")])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.output.startswith("error: engine.kv_cache_tokens: 2000000000 tokens take"), r.output
    assert "at most" in r.output and not (tmp_path / "out").exists()
    job = _job(tmp_path, model, "  kv_cache_tokens: 2000000000\n")
    r = CliRunner().invoke(main, ["status", job])  # the job may run on a bigger machine
    assert r.output.startswith("0/1 rows done"), r.output  # exit 1: rows to go


def test_a_model_larger_than_memory_is_refused_naming_it(tmp_path, model, monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: 64 << 10)
    r = CliRunner().invoke(main, ["validate", _job(tmp_path, model)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert f"error: model: {model} needs" in r.output and "cannot run here" in r.output


def test_the_model_figure_is_what_the_loaded_model_holds(model):
    from eaglebatch.model.causal_lm import CausalLM
    from eaglebatch.model.weights import checkpoint_shapes

    loaded = CausalLM.from_pretrained(model)
    held = sum(p.numel() * p.element_size() for p in loaded.parameters())
    assert memory.model_bytes(checkpoint_shapes(model), 4, {}) == held
    blocks = {"model.embed_tokens.weight": 100}
    emb = loaded.model.embed_tokens.weight
    want = held - emb.numel() * 4 + 100
    assert memory.model_bytes(checkpoint_shapes(model), 4, blocks) == want


def test_a_cgroup_memory_limit_caps_what_is_available(tmp_path):
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("268435456\n")
    assert memory._cgroup_memory_left(tmp_path) == 768 << 20
    (tmp_path / "memory.max").write_text("max\n")
    assert memory._cgroup_memory_left(tmp_path) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(1 << 62))  # v1's "no limit"
    (v1 / "memory.usage_in_bytes").write_text("5")
    assert memory._cgroup_memory_left(tmp_path / "v1") is None
    (v1 / "memory.limit_in_bytes").write_text(str(2 << 30))
    assert memory._cgroup_memory_left(tmp_path / "v1") == (2 << 30) - 5


def test_the_cpu_default_kv_cache_holds_what_the_job_can_use(tmp_path, long_model):
    """Unset engine.kv_cache_tokens on the CPU: min(max_batch_size, rows) sequences of a
    1024-token prompt allowance + max_new_tokens, 25% more for the prefix cache; not the
    free-memory share (GiBs) nor 64 sequences of 8192 tokens."""
    from eaglebatch.job.config import load_job
    from eaglebatch.prepare import prepare
    from eaglebatch.runner import build_worker

    prep = prepare(load_job(_job(tmp_path, long_model, rows=8)))
    rule = "the job's 8 sequences x 1026 tokens + 25%"
    assert prep.memory_plan.kv_key == rule
    worker = build_worker(prep)
    assert worker.num_blocks == math.ceil(8 * 1026 * 1.25 / 16)
    assert prep.memory_plan.kv_bytes == worker.num_blocks * worker.budget.bytes_per_block
    r = CliRunner().invoke(main, ["validate", _job(tmp_path, long_model, rows=8)])
    assert r.exit_code == 0 and f"({rule})" in r.output, r.output
    # engine.kv_cache_tokens still wins
    big = _job(tmp_path, long_model, "  kv_cache_tokens: 40000\n", rows=8)
    assert build_worker(prepare(load_job(big))).num_blocks == 2500


def test_the_cpu_default_kv_cache_always_holds_one_whole_sequence(tmp_path, long_model):
    from eaglebatch.job.config import load_job
    from eaglebatch.prepare import prepare

    one = prepare(load_job(_job(tmp_path, long_model, "  prefix_caching: false\n")))
    assert one.memory_plan.kv_key == "one sequence of 8192 tokens, the longest"
    assert one.memory_plan.kv_bytes == 8192 // 16 * (2 * 16 * 1 * 16 * 4 * 2)


HYBRID = dict(model_type="qwen3_5_text", hidden_size=32, num_layers=4, num_heads=2,
              num_kv_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16)  # fmt: skip


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A hybrid linear-attention model: 3 Gated DeltaNet layers (a recurrent state per row,
    no KV) and 1 attention layer."""
    return make_tiny_model(tmp_path_factory.mktemp("mem-hybrid"), **HYBRID)


def test_a_hybrid_run_says_its_recurrent_states(tmp_path, hybrid):
    """The pool: max_batch_size request slots + 2 x max_batch_size prefix-cache checkpoints
    (none without prefix caching), each row every linear layer's conv and SSM states."""
    from eaglebatch.job.state_budget import state_plan
    from eaglebatch.model.config import ModelConfig

    job = _job(tmp_path, hybrid, "  kv_cache_tokens: 1024\n  max_batch_size: 8\n")
    r = CliRunner().invoke(main, ["validate", job])
    assert r.exit_code == 0, r.output
    assert "recurrent states (8 request slots (engine.max_batch_size) + 16 prefix-cache" \
        in r.output, r.output  # fmt: skip
    cfg = ModelConfig.from_dir(hybrid)
    row = 3 * cfg.deltanet.state_bytes
    from eaglebatch.job.config import load_job

    eng = load_job(job).engine
    plan = state_plan(eng, cfg)
    assert (plan.slots, plan.checkpoints, plan.interval, plan.row_bytes) == (8, 16, 64, row)
    off = state_plan(eng.model_copy(update={"prefix_caching": False}), cfg)
    assert off.checkpoints == 0 and off.nbytes == 8 * row


def test_recurrent_states_that_cannot_fit_exit_2_naming_the_key(tmp_path, hybrid, monkeypatch):
    """Model and buffers fit, the states of 4096 slots (and their checkpoints) do not."""
    from eaglebatch.job.config import load_job
    from eaglebatch.job.state_budget import state_plan
    from eaglebatch.model.config import ModelConfig

    job = _job(tmp_path, hybrid, "  kv_cache_tokens: 64\n  max_batch_size: 4096\n")
    states = state_plan(load_job(job).engine, ModelConfig.from_dir(hybrid)).nbytes
    monkeypatch.setattr(memory, "available_memory", lambda: states)
    r = CliRunner().invoke(main, ["run", job])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.output.startswith("error: engine.max_batch_size: "), r.output
    assert not (tmp_path / "out").exists()


def test_the_kv_budget_takes_the_recurrent_states_first(hybrid, monkeypatch):
    """On any device the pool comes out of the memory the KV cache may take; a pool larger
    than that is a JobError naming engine.max_batch_size."""
    import torch

    from eaglebatch import worker
    from eaglebatch.errors import JobError
    from eaglebatch.job.config import EngineConfig
    from eaglebatch.job.state_budget import state_plan
    from eaglebatch.model.config import ModelConfig

    cfg = ModelConfig.from_dir(hybrid)
    eng = EngineConfig(max_batch_size=64, kv_cache_memory_fraction=0.5)
    plan = state_plan(eng, cfg)
    per_block = worker.kv_cache_bytes_per_block(cfg, eng.block_size, torch.float32)
    free = 2 * (plan.nbytes + 100 * per_block)
    monkeypatch.setattr(worker, "_free_memory", lambda device: free)
    budget = worker.plan_kv_budget(eng, cfg, 10**6, torch.float32, torch.device("cpu"),
                                   states=plan)  # fmt: skip
    assert budget.num_blocks == 100 and budget.states == plan
    monkeypatch.setattr(worker, "_free_memory", lambda device: plan.nbytes)
    with pytest.raises(JobError, match="^engine.max_batch_size: "):
        worker.plan_kv_budget(eng, cfg, 10**6, torch.float32, torch.device("cpu"), states=plan)
