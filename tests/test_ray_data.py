"""The Ray Data processor: a Dataset through preprocess -> engine actors -> postprocess gives
the rows `Engine.generate` gives, with the input's columns carried through."""

from __future__ import annotations

import numpy as np
import pytest

from test_runner import random_prompts

pytest.importorskip("eaglebatch._native")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")


@pytest.fixture(scope="module")
def local_ray():
    import logging

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)  # fmt: skip
    yield
    ray.shutdown()


def test_a_dataset_through_the_processor_equals_engine_generate(local_ray, tiny_model_dir):
    import eaglebatch
    from eaglebatch.integrations.ray_data import ProcessorConfig, build_processor

    prompts = random_prompts(20, seed=9)
    sections = {"engine": {"device": "cpu", "kv_cache_tokens": 4096},
                "sampling": {"max_new_tokens": 6},
                "output": {"include_token_ids": True}}  # fmt: skip
    config = ProcessorConfig(model=str(tiny_model_dir), batch_size=8, concurrency=1,
                             **sections)  # fmt: skip
    processor = build_processor(
        config,
        preprocess=lambda row: {"prompt": row["text"][1:-1], "key": row["key"]},
        postprocess=lambda row: {"key": row["key"], "answer": row["output_text"],
                                 "tokens": list(row["output_token_ids"])},
    )  # fmt: skip
    ds = ray.data.from_items([{"text": f" {p} ", "key": i} for i, p in enumerate(prompts)])
    got = sorted(processor(ds).take_all(), key=lambda r: r["key"])
    with eaglebatch.Engine(str(tiny_model_dir), engine=sections["engine"]) as engine:
        want = engine.generate(prompts, sampling=sections["sampling"],
                               output=sections["output"]).to_pylist()  # fmt: skip
    assert [r["key"] for r in got] == list(range(20))
    assert [r["tokens"] for r in got] == [r["output_token_ids"] for r in want]
    assert [r["answer"] for r in got] == [r["output_text"] for r in want]


def test_the_processor_embeds_with_task_embed(local_ray, tmp_path):
    import eaglebatch
    from eaglebatch.integrations.ray_data import ProcessorConfig, build_processor
    from support.tiny import make_tiny_model
    from test_embed import write_st_files

    model = make_tiny_model(tmp_path / "embedder", model_type="qwen3", head_dim=16)
    write_st_files(model, "mean", True)
    prompts = random_prompts(12, seed=4)
    engine = {"device": "cpu", "kv_cache_tokens": 4096}
    config = ProcessorConfig(model=str(model), engine=engine, task="embed",
                             embed={"dimensions": 16}, batch_size=5)  # fmt: skip
    processor = build_processor(config, postprocess=lambda row: {
        "key": row["key"], "vector": list(row["embedding"])})  # fmt: skip
    ds = ray.data.from_items([{"prompt": p, "key": i} for i, p in enumerate(prompts)])
    got = sorted(processor(ds).take_all(), key=lambda r: r["key"])
    with eaglebatch.Engine(str(model), engine=engine) as eng:
        want = eng.embed(prompts, embed={"dimensions": 16}).column("embedding").to_pylist()
    # batches of 5 rows pack other GEMM shapes than one call of 12: float rounding apart
    assert [r["key"] for r in got] == list(range(12))
    np.testing.assert_allclose([r["vector"] for r in got], want, atol=1e-5)
