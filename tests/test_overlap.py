"""engine.overlap: steps planned and launched one ahead of their commit give exactly the outputs
of steps run one at a time (the reference: overlap off), greedy and sampled, through the eager
and the graph-step paths, with rows ending by length, end ids, stop strings and preemption;
the switch's resolution and its configuration error."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from eaglebatch.errors import JobError
from eaglebatch.job.engine_settings import resolve_engine, resolve_overlap
from eaglebatch.job.model_files import model_files
from eaglebatch.model.config import ModelConfig
from test_runner import random_prompts, run_job

pytest.importorskip("eaglebatch._native")


class LaunchSpy:
    """Counts launches made while an earlier launched step was not yet collected."""

    def __init__(self, worker) -> None:
        self.worker, self.in_flight, self.ahead = worker, 0, 0

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def launch(self, plan, prev=None):
        self.ahead += self.in_flight > 0
        self.in_flight += 1
        return self.worker.launch(plan, prev)

    def collect(self, launched):
        self.in_flight -= 1
        return self.worker.collect(launched)


def _pair(tmp_path, model_dir, prompts, overrides, wrap=None):
    """(overlap off rows, overlap on rows, the spy of the overlapped run)."""
    spies = []

    def spy(worker):
        spies.append(LaunchSpy(worker if wrap is None else wrap(worker)))
        return spies[-1]

    off, _ = run_job(tmp_path, model_dir, prompts, overrides=[*overrides, "engine.overlap=false"],
                     name="off", wrap=wrap)
    on, res = run_job(tmp_path, model_dir, prompts, overrides=[*overrides, "engine.overlap=true"],
                      name="on", wrap=spy)
    keep = ["row_index", "sample_index", "output_token_ids", "output_text", "finish_reason",
            "num_output_tokens", "logprobs"]
    keep = [c for c in keep if c in off.column_names]
    order = [(c, "ascending") for c in ("row_index", "sample_index") if c in keep]

    def rows(table):
        return table.select(keep).sort_by(order).to_pylist()

    return rows(off), rows(on), spies[0], res


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(10, seed=5)


@pytest.mark.parametrize("extra", [
    ["engine.max_batch_size=3"],
    ["engine.max_batch_size=8", "engine.max_num_batched_tokens=16"],  # prompt chunks ride along
    ["engine.max_batch_size=8", "engine.chunked_prefill=false"],
    ["engine.max_batch_size=8", "engine.kv_cache_tokens=160"],  # preemptions
    ["engine.max_batch_size=4", "sampling.max_new_tokens=1"],
], ids=["batch3", "chunked", "unchunked", "preempting", "one-token"])
def test_greedy_outputs_equal_overlap_off(tmp_path, tiny_model_dir, prompts, extra):
    off, on, spy, _ = _pair(tmp_path, tiny_model_dir, prompts, extra)
    assert on == off
    if "sampling.max_new_tokens=1" not in extra:
        assert spy.ahead > 0  # steps really were launched ahead of their commit


def test_rows_ending_by_end_ids_and_stop_strings(tmp_path, tiny_model_dir, prompts):
    """Rows that finish at a commit (an end id, a stop string) computed one token too many in
    the step already launched: it is dropped, and outputs are those of overlap off."""
    base, _ = run_job(tmp_path, tiny_model_dir, prompts, name="base")
    rows = base.column("output_token_ids").to_pylist()
    # an end id and a stop string that some rows meet and others do not
    end_id = _in_some([set(row[1:]) for row in rows])
    texts = [base.column("output_text").to_pylist()[i] for i, r in enumerate(rows)
             if end_id not in r[1:]]
    stop = _in_some([{t[i : i + 2] for i in range(len(t) - 1)} for t in texts])
    extra = ["engine.max_batch_size=6", f"sampling.stop_token_ids=[{end_id}]",
             f"sampling.stop={json.dumps([stop])}"]
    off, on, spy, _ = _pair(tmp_path, tiny_model_dir, prompts, extra)
    assert on == off and spy.ahead > 0
    reasons = Counter(r["finish_reason"] for r in on)
    assert reasons["stop"] >= 3 and reasons["length"] >= 1, reasons


def _in_some(items: list[set]):
    """The item found in the fewest rows, but in at least two of them."""
    counts = Counter(x for found in items for x in found)
    return min((c, str(x), x) for x, c in counts.items() if c >= 2)[2]


def test_sampled_samples_equal_overlap_off(tmp_path, tiny_model_dir, prompts):
    extra = ["engine.max_batch_size=8", "sampling.temperature=0.9", "sampling.top_p=0.9",
             "sampling.seed=3", "sampling.n=3"]
    off, on, spy, _ = _pair(tmp_path, tiny_model_dir, prompts[:5], extra)
    assert on == off and spy.ahead > 0


def test_logprobs_equal_overlap_off(tmp_path, tiny_model_dir, prompts):
    """Logprobs come down behind the step's event (Worker.collect): the same entries, up to
    float rounding (a finished row's slot is reused one step later, so a step's batch, and the
    GEMMs' rounding, can differ)."""
    extra = ["engine.max_batch_size=4", "output.logprobs=3", "sampling.temperature=0.7",
             "sampling.seed=11"]
    off, on, spy, _ = _pair(tmp_path, tiny_model_dir, prompts[:6], extra)
    assert spy.ahead > 0

    def split(rows):
        lps = [r.pop("logprobs") for r in rows]
        flat = [(e["token_id"], e["logprob"], [(t["token_id"], t["logprob"])
                                              for t in e["top_logprobs"]])
                for row in lps for e in row]
        return rows, flat

    (on_rows, on_lp), (off_rows, off_lp) = split(on), split(off)
    assert on_rows == off_rows and len(on_lp) == sum(len(r["output_token_ids"]) for r in on)
    for (tok, lp, top), (tok2, lp2, top2) in zip(on_lp, off_lp, strict=True):
        assert tok == tok2 and lp == pytest.approx(lp2, abs=1e-5)
        assert [t for t, _ in top] == [t for t, _ in top2]
        assert [v for _, v in top] == pytest.approx([v for _, v in top2], abs=1e-5)


def test_penalized_rows_commit_before_the_next_plan(tmp_path, tiny_model_dir, prompts):
    """A penalty needs every committed token: the scheduler does not plan ahead (outputs as
    overlap off, nothing launched ahead)."""
    extra = ["engine.max_batch_size=4", "sampling.repetition_penalty=1.3"]
    off, on, spy, _ = _pair(tmp_path, tiny_model_dir, prompts, extra)
    assert on == off and spy.ahead == 0


def test_graph_steps_fill_placeholders(tmp_path, tiny_model_dir, prompts):
    """The graph-step path (run eagerly on the CPU) writes the placeholders into its static
    input buffer."""
    extra = ["engine.max_batch_size=4", "engine.max_model_len=512"]

    def with_graphs(worker):
        worker.enable_graphs("eager", 4)
        return worker

    off, on, spy, res = _pair(tmp_path, tiny_model_dir, prompts, extra, wrap=with_graphs)
    assert on == off and spy.ahead > 0
    assert res.stats["cuda_graphs"]["replays"] > 0


def test_resolution_and_errors():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_overlap(None, cuda, False) and not resolve_overlap(None, cpu, False)
    assert not resolve_overlap(None, cuda, True) and resolve_overlap(True, cpu, False)
    assert not resolve_overlap(False, cuda, False)
    with pytest.raises(JobError, match="engine.overlap"):
        resolve_overlap(True, cuda, True)


def test_overlap_with_a_draft_is_a_job_error(tmp_path, tiny_model_dir):
    from eaglebatch.job.config import load_job

    job_file = tmp_path / "j.yaml"
    job_file.write_text(f"model: {tiny_model_dir}\ninput:\n  path: x.parquet\noutput:\n  path: o\n"
                        "draft: builtin\nengine:\n  device: cpu\n  overlap: true\n")
    job = load_job(job_file, [])
    with pytest.raises(JobError, match="engine.overlap: true needs plain decoding"):
        mf = model_files(job.model)
        resolve_engine(job, mf, ModelConfig.from_dir(mf.dir))
