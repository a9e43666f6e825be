"""The published EAGLE-3 layouts (speculators, NVIDIA ModelOpt `eagle_config`) load to the same
head as ours from the same weights; each math flag is read (it changes the output); settings
not implemented are refused by name; speculative greedy == plain greedy with heads in each
layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglebatch.model import CausalLM
from eaglebatch.speculative import SpecWorker, load_draft
from eaglebatch.speculative.draft_formats import flat_config
from paged_kv import PagedSequences
from support.draft_layouts import FLAGS, LAYOUTS, set_flags, to_layout
from support.spec_models import make_draft_dir, make_target_dir, target_worker
from test_spec_worker import MAX_LEN, Req, run

LAYERS = 4
# each flag alone, all together, and none
FLAG_SETS = [{}, *({f: True} for f in FLAGS), dict.fromkeys(FLAGS, True)]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target_dir(tmp_path_factory.mktemp("target"), num_layers=LAYERS)


@pytest.fixture(scope="module")
def target(target_dir):
    return CausalLM.from_pretrained(target_dir)


def head(tmp, target_dir, flags: dict, **kwargs):
    """A random head of ours with `flags` (random norm weights), reduced vocabulary."""
    kwargs.setdefault("draft_vocab_size", 200)
    return set_flags(make_draft_dir(tmp, target_dir, "eagle3", seed=5, **kwargs), **flags)


def outputs(draft) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft tokens, logits) of a random sequence: random target states -> features -> layer
    -> head, then one more step on the draft's own last output fed back."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(320, (9,), generator=gen)
    captured = {i: 2 * torch.randn(9, 64, generator=gen) for i in range(LAYERS)}
    seqs = PagedSequences(64, 4, seed=3)
    kv = draft.allocate_kv_cache(64, 4)
    with torch.inference_mode():
        tok, pos, meta = seqs.step([(0, ids.tolist())])
        draft.backend.prepare(meta)
        h = draft(tok, draft.target_features(captured), pos, meta, kv)  # [9, h]
        tok2, pos2, meta2 = seqs.step([(0, [int(draft.argmax_tokens(h[-1:])[0])])])
        draft.backend.prepare(meta2)
        h2 = draft(tok2, h[-1:], pos2, meta2, kv)  # the draft's own output fed back
        both = torch.cat([h, h2])
        return draft.argmax_tokens(both), draft.compute_logits(both)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "+".join(f) or "none")
def test_a_foreign_layout_loads_the_same_head(tmp_path, target_dir, target, layout, flags):
    ours = head(tmp_path / "ours", target_dir, flags, aux_layer_ids=(3, 1, 2))
    other = to_layout(ours, tmp_path / layout, layout, LAYERS)
    if layout == "speculators":  # some versions saved the verifier's norm and lm_head too
        w = load_file(other / "model.safetensors")
        w.update({"verifier_norm.weight": torch.ones(64),
                  "verifier_lm_head.weight": torch.zeros(200, 64)})  # fmt: skip
        save_file(w, other / "model.safetensors")
    a, b = load_draft(ours, target.config, target), load_draft(other, target.config, target)
    assert b.config.layer_prefix == "layers.0." and a.config.layer_prefix == "midlayer."
    for key in (*FLAGS, "aux_layer_ids", "draft_vocab_size"):
        assert getattr(a.config, key) == getattr(b.config, key), key
    assert a.config.aux_layer_ids == (1, 2, 3)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    ta, la = outputs(a)
    tb, lb = outputs(b)
    assert torch.equal(ta, tb) and torch.equal(la, lb)


@pytest.mark.parametrize("flag", FLAGS)
def test_each_flag_changes_the_output(tmp_path, target_dir, target, flag):
    """The same weights with the flag on and off draft differently: the flag is read."""
    on = head(tmp_path / "on", target_dir, {flag: True})
    off = tmp_path / "off"
    off.mkdir()
    config = json.loads((on / "config.json").read_text())
    config[flag] = False
    (off / "config.json").write_text(json.dumps(config))
    tensors = {"input_norm.weight", *(f"fc_norm.{i}.weight" for i in range(3))}
    w = {k: v for k, v in load_file(on / "model.safetensors").items() if k not in tensors}
    save_file(w, off / "model.safetensors")
    _, la = outputs(load_draft(on, target.config, target))
    _, lb = outputs(load_draft(off, target.config, target))
    assert not torch.allclose(la, lb, atol=1e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_speculative_greedy_equals_plain(tmp_path, target_dir, layout):
    ours = head(tmp_path / "ours", target_dir, dict.fromkeys(FLAGS, True))
    path = to_layout(ours, tmp_path / layout, layout, LAYERS)
    gen = torch.Generator().manual_seed(2)
    reqs = [Req(tuple(torch.randint(320, (n,), generator=gen).tolist()), 16)
            for n in (1, 5, 17, 30)]  # fmt: skip
    plain, _ = run(target_worker(target_dir, max_model_len=MAX_LEN), reqs)
    for k in (1, 3):
        worker = SpecWorker.from_target(target_worker(target_dir, max_model_len=MAX_LEN), path,
                                        num_steps=k, max_batch_size=8, adaptive=False)  # fmt: skip
        out, _ = run(worker, reqs, k=k)
        assert out == plain
        assert worker.stats.verify_rounds > 0


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"speculators_model_type": "eagle", "transformer_layer_config": {}},
         "speculators_model_type 'eagle' is not supported"),
        ({"speculators_model_type": "eagle3", "transformer_layer_config": {"model_type": "qwen3"}},
         "transformer_layer_config.model_type 'qwen3' is not supported"),
        ({"speculators_model_type": "eagle3"}, "transformer_layer_config must be a mapping"),
        ({"speculators_model_type": "eagle3", "transformer_layer_config": {},
          "speculators_config": {"algorithm": "hass"}}, "speculators_config.algorithm 'hass'"),
        ({"eagle_config": {"use_last_layernorm": False}}, "eagle_config.use_last_layernorm"),
        ({"eagle_config": {"use_aux_hidden_state": False}}, "eagle_config.use_aux_hidden_state"),
        ({"eagle_config": {"use_mtp_layernorm": True}}, "eagle_config.use_mtp_layernorm"),
        ({"eagle_config": {"use_input_layernorm_in_first_layer": False}},
         "eagle_config.use_input_layernorm_in_first_layer"),
        ({"eagle_config": {"parallel_draft_step": 3}}, "eagle_config.parallel_draft_step = 3"),
        ({"eagle_config": {"eh_proj_before_attn": True}}, "eagle_config.eh_proj_before_attn"),
        ({"parallel_drafting": True}, "parallel_drafting"),
        ({"logit_scale": -1.0}, "logit_scale"),
    ],
)  # fmt: skip
def test_unsupported_settings_are_refused_by_name(raw, match):
    with pytest.raises(ValueError, match=match):
        flat_config(raw)


def test_speculators_layer_config_takes_llama_defaults_and_flag_defaults():
    """A to_diff_dict layer config leaves out LlamaConfig's defaults; norm_before_residual
    absent reads as vLLM reads speculators configs (True); the nested norm_before_fc wins."""
    flat = flat_config({"speculators_model_type": "eagle3",
                        "transformer_layer_config": {"num_hidden_layers": 1}})  # fmt: skip
    assert flat["hidden_size"] == 4096 and flat["rms_norm_eps"] == 1e-6
    assert flat["rope_theta"] == 10000.0 and flat["norm_before_residual"] is True
    assert flat_config({}) == {}
    nested = flat_config({"norm_before_fc": False, "eagle_config": {"norm_before_fc": True}})
    assert nested["norm_before_fc"] is True
    assert flat_config({"eagle_config": {"return_hidden_post_norm": True}})["norm_output"]
