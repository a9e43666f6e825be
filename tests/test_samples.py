"""`sampling.n`: n output rows per input row (`sample_index` 0..n-1), the prompt computed once
and shared, each sample seeded by (seed, row, sample) so that samples do not depend on the
batch, forking or caching; resume by (row, sample); n in the job identity."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from eaglebatch.errors import JobError
from eaglebatch.speculative import init_random_draft
from test_runner import random_prompts, run_job

pytest.importorskip("eaglebatch._native")

PROMPTS = random_prompts(7, seed=5) + [None]  # the null prompt: n error rows
SAMPLED = ["sampling.temperature=0.9", "sampling.seed=3"]


def samples(table) -> dict[tuple[int, int], list[int]]:
    rows = table.select(["row_index", "sample_index", "output_token_ids"]).to_pylist()
    return {(r["row_index"], r["sample_index"]): r["output_token_ids"] for r in rows}


@pytest.fixture(scope="module")
def alone(tmp_path_factory, tiny_model_dir):
    """n = 4 at batch 1: each sample runs on its own (its sibling has finished: no fork)."""
    tmp = tmp_path_factory.mktemp("alone")
    table, res = run_job(tmp, tiny_model_dir, PROMPTS, name="alone",
                         overrides=[*SAMPLED, "sampling.n=4", "engine.max_batch_size=1",
                                    "engine.prefix_caching=false"])  # fmt: skip
    return table, res.stats


def test_n_rows_per_input_row_distinct_and_independent_of_batch_and_caching(tmp_path,
                                                                             tiny_model_dir,
                                                                             alone):  # fmt: skip
    table, stats1 = alone
    want = samples(table)
    assert sorted(want) == [(r, s) for r in range(len(PROMPTS)) for s in range(4)]
    errors = table.filter(table.column("error").is_valid())
    assert errors.num_rows == 4 and set(errors.column("row_index").to_pylist()) == {7}
    for r in range(7):
        assert len({tuple(want[r, s]) for s in range(4)}) > 1  # temperature 0.9: they differ
    for batch, caching in ((8, "false"), (8, "true"), (3, "true")):
        got, res = run_job(tmp_path, tiny_model_dir, PROMPTS, name=f"b{batch}{caching}",
                           overrides=[*SAMPLED, "sampling.n=4", f"engine.max_batch_size={batch}",
                                      f"engine.prefix_caching={caching}"])  # fmt: skip
        assert samples(got) == want, (batch, caching)
        # the prompt is computed once and each other sample computes its last token only
        assert res.stats["prefill_tokens"] < stats1["prefill_tokens"]
    # sample 0 keeps the n = 1 seed
    one, _ = run_job(tmp_path, tiny_model_dir, PROMPTS, name="one", overrides=SAMPLED)
    assert {r: t for (r, s), t in want.items() if s == 0} == {
        r: t for (r, _), t in samples(one).items()
    }


def test_forked_prefill_computes_each_prompt_once(tmp_path, tiny_model_dir):
    prompts = ["the cat sat on the mat " * 3] * 2  # 69 byte tokens each
    _, res = run_job(tmp_path, tiny_model_dir, prompts,
                     overrides=[*SAMPLED, "sampling.n=8", "engine.max_batch_size=16",
                                "engine.prefix_caching=false"])  # fmt: skip
    # two prompts prefilled in full, 14 forked samples of one token each
    assert res.stats["prefill_tokens"] == 2 * 69 + 14
    assert res.stats["requests"] == 16


def test_speculative_samples_do_not_depend_on_the_batch(tmp_path, tiny_model_dir):
    head = init_random_draft(tmp_path / "head", tiny_model_dir, kind="eagle3", seed=2,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    extra = [*SAMPLED, "sampling.n=3", f"draft={head}", "speculative.adaptive=false"]
    runs = [run_job(tmp_path, tiny_model_dir, PROMPTS[:5], name=f"s{b}",
                    overrides=[*extra, f"engine.max_batch_size={b}"])[0]
            for b in (1, 6)]  # fmt: skip
    assert samples(runs[0]) == samples(runs[1])


def test_resume_generates_only_the_missing_samples(tmp_path, tiny_model_dir, alone):
    over = [*SAMPLED, "sampling.n=4", "engine.max_batch_size=8"]
    first, _ = run_job(tmp_path, tiny_model_dir, PROMPTS, name="r", overrides=over)  # 4-row parts
    parts = sorted((tmp_path / "r").glob("part-*.parquet"))
    lost = pq.read_table(parts[1]).num_rows
    parts[1].unlink()  # a lost part: some rows lose some of their samples
    table, res = run_job(tmp_path, tiny_model_dir, PROMPTS, name="r", overrides=over)
    assert res.stats["requests"] == lost
    assert table.num_rows == len(PROMPTS) * 4
    assert samples(table) == samples(alone[0])


def test_n_needs_temperature_and_is_part_of_the_job_identity(tmp_path, tiny_model_dir):
    with pytest.raises(JobError, match="sampling.n: 2 samples per row need sampling.temperature"):
        run_job(tmp_path, tiny_model_dir, PROMPTS[:2], overrides=["sampling.n=2"])
    run_job(tmp_path, tiny_model_dir, PROMPTS[:2], name="id", overrides=SAMPLED)
    with pytest.raises(JobError, match="different job.*sampling.n"):
        run_job(tmp_path, tiny_model_dir, PROMPTS[:2], name="id",
                overrides=[*SAMPLED, "sampling.n=2"])  # fmt: skip
