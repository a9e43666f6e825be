"""A draft head that does not fit the job's model stops `validate` and `run` before any work with
exit 2 and one message naming the key and both values (no traceback): hidden size, vocabulary,
d2t, aux layers, fc's input width, unsupported settings; a head that fits passes, in each
layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglebatch.speculative import init_random_draft
from support.draft_layouts import LAYOUTS, to_layout
from support.spec_models import make_target_dir
from support.tiny import write_prompts
from test_cli import invoke, job

pytest.importorskip("eaglebatch._native")


def head(tmp, model_dir, **kwargs):
    kwargs.setdefault("aux_layer_ids", (0, 1, 2))
    kwargs.setdefault("draft_vocab_size", 200)
    return init_random_draft(tmp, model_dir, kind="eagle3", seed=1, **kwargs)


def edit_config(path, fn):
    config = json.loads((path / "config.json").read_text())
    fn(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


def edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def refused(tmp_path, model_dir, draft) -> str:
    """The one message `validate` and `run` both print (exit 2, no traceback)."""
    inp = write_prompts(tmp_path / "in.parquet", ["a", "b"])
    job_file = job(tmp_path, model_dir, inp, f"draft: {draft}\n")
    messages = []
    for command in ("validate", "run"):
        r = invoke(command, str(job_file))
        assert r.exit_code == 2, (command, r.output, r.exception)
        assert "Traceback" not in r.output
        assert r.output.startswith(f"error: draft: {draft}: "), r.output
        messages.append(r.output)
    assert messages[0] == messages[1]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.parquet"))
    return messages[0]


def _set_d2t_out_of_range(t):
    t["d2t"][-1] = 1000
    t.pop("t2d")


CASES = {
    "hidden": (lambda tmp, m: head(tmp, make_target_dir(tmp.parent / "narrow", hidden=32,
                                                        num_layers=2)),
               "EAGLE-3 draft hidden_size 32 does not match the target's hidden_size 64"),
    "vocab": (lambda tmp, m: head(tmp, make_target_dir(tmp.parent / "v", vocab=300, num_layers=2)),
              "draft vocab_size 300 does not match the target's vocab_size 320"),
    "draft_vocab": (lambda tmp, m: edit_config(head(tmp, m), lambda c: c.update(
        draft_vocab_size=400)), "draft_vocab_size 400 must be in [1, the target's vocab_size 320]"),
    "d2t": (lambda tmp, m: edit_tensors(head(tmp, m), _set_d2t_out_of_range),
            "d2t maps draft ids to target ids in [0, 1199], outside the target's vocabulary "
            "[0, 320)"),
    "aux_layers": (lambda tmp, m: edit_config(head(tmp, m), lambda c: c.update(
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 5]})),
        "EAGLE-3 target layers [1, 2, 6] from eagle_config.eagle_aux_hidden_state_layer_ids "
        "(+1: layer outputs) do not fit the target's 2 layers"),
    "fc_width": (lambda tmp, m: edit_config(head(tmp, m), lambda c: c.update(
        eagle_aux_hidden_state_layer_ids=[0, 1])),
        "fc.weight reads 192 features (a head for 3 target layers), but 2 aux layers [0, 1] of "
        "the target's hidden_size 64 give 128"),
    "flag": (lambda tmp, m: edit_config(head(tmp, m), lambda c: c["eagle_config"].update(
        use_last_layernorm=False)), "eagle_config.use_last_layernorm = False is not supported"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_head_that_does_not_fit_is_refused_before_any_work(tmp_path, tiny_model_dir, case):
    make, message = CASES[case]
    draft = make(tmp_path / "head", tiny_model_dir)
    assert message in refused(tmp_path, tiny_model_dir, draft)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_heads_in_each_layout_validate(tmp_path, tiny_model_dir, layout):
    draft = to_layout(head(tmp_path / "ours", tiny_model_dir), tmp_path / layout, layout, 2)
    inp = write_prompts(tmp_path / "in.parquet", ["a"])
    r = invoke("validate", str(job(tmp_path, tiny_model_dir, inp, f"draft: {draft}\n")))
    assert r.exit_code == 0, r.output
    # and a misfit in that layout is refused the same way
    if layout == "speculators":
        edit_config(draft, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 7]))
        expected = "EAGLE-3 target layers [0, 1, 7] from eagle_aux_hidden_state_layer_ids"
    else:
        edit_tensors(draft, lambda t: t.update({"lm_head.weight": torch.zeros(100, 64)}))
        expected = "lm_head.weight has shape (100, 64); draft_vocab_size 200"
    assert expected in refused(tmp_path / "bad", tiny_model_dir, draft)
