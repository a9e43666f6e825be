"""Gemma 4's assistant drafter (speculative/assistant.py): one drafting step against
transformers' Gemma4AssistantForCausalLM on the same target K/V, speculative greedy == plain
greedy end to end, and mismatched drafters refused before any work (exit 2)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from eaglebatch.attention import allocate_kv_cache
from eaglebatch.attention.base import AttentionMetadata
from eaglebatch.model.causal_lm import CausalLM
from eaglebatch.speculative.eagle import load_draft
from support.tiny import make_tiny_model
from test_model_families import FAMILIES, PROMPTS, SHAPE, tokens
from test_runner import run_job

transformers = pytest.importorskip("transformers")
pytest.importorskip("eaglebatch._native")

BLOCK = 4


def make_assistant(out, target_dir, *, seed=0, ordered=False, **text_overrides):
    """A random Gemma4AssistantForCausalLM for the target in `target_dir`, saved by
    transformers: two layers (sliding, full) of hidden size 32 over the target's KV shapes."""
    target = json.loads((target_dir / "config.json").read_text())
    drop = ("architectures", "auto_map", "per_layer_config")
    text = {k: v for k, v in target.items() if k not in drop}
    full = target["layer_types"].index("full_attention")  # its shapes: the assistant's layer 1
    full_shape = (target.get("per_layer_config") or {}).get(str(full), {})
    text.update(per_layer_config={"1": full_shape}, hidden_size=32, intermediate_size=48,
                num_hidden_layers=2,
                layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=2,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                use_double_wide_mlp=False, tie_word_embeddings=True, **text_overrides)  # fmt: skip
    torch.manual_seed(seed)
    cfg = transformers.Gemma4AssistantConfig(
        text_config=transformers.Gemma4TextConfig(**text),
        backbone_hidden_size=target["hidden_size"], use_ordered_embeddings=ordered,
        num_centroids=8, centroid_intermediate_top_k=3,
    )  # fmt: skip
    model = transformers.Gemma4AssistantForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the init's: drafts that depend on the input
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(text["vocab_size"]))
    model.save_pretrained(out)
    return out, model


@pytest.fixture(scope="module", params=["gemma4", "gemma4_e2b"])
def target(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param),
                           **{**SHAPE, **FAMILIES[request.param]})  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return path, hf.eval()


def _prefill(model: CausalLM, ids: list[int]):
    """Our target over `ids` from position 0: (final hidden [P, H], caches, block table)."""
    n = len(ids)
    blocks = -(-(n + 2) // BLOCK)
    caches = allocate_kv_cache(model.config, blocks, BLOCK, torch.float32, "cpu")
    table = np.arange(blocks, dtype=np.int32)[None]
    meta = AttentionMetadata.from_numpy([0, n], [n], table, np.arange(n), BLOCK, "cpu")
    model.backend.prepare(meta)
    pos = torch.arange(n)
    return model(torch.tensor(ids), pos, meta, caches), caches, table


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("length", [5, 19])  # within and past the sliding window of 8
def test_drafting_steps_equal_transformers(tmp_path, target, ordered, length):
    path, hf = target
    folder, ref = make_assistant(tmp_path / "a", path, ordered=ordered)
    model = CausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()
    prompt, last = ids[:-1], ids[-1]  # x_c = last at c = length - 1
    hidden, caches, table = _prefill(model, prompt)
    draft = load_draft(folder, model.config, model)
    draft.kv_caches = caches
    c = length - 1
    meta = AttentionMetadata.from_numpy([0, 1], [c], table, [c - 1], BLOCK, "cpu")
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True, return_shared_kv_states=True)
        embed = hf.get_input_embeddings()
        state_ref = out.hidden_states[-1][:, -1:]
        state = draft(torch.tensor([last]), hidden[-1:], torch.tensor([c - 1]), meta)
        token = last
        for _ in range(3):  # the chain: the same position, the previous step's state
            got = draft.compute_logits(state)[0]
            r = ref(inputs_embeds=torch.cat([embed(torch.tensor([[token]])), state_ref], -1),
                    position_ids=torch.tensor([[c]]), shared_kv_states=out.shared_kv_states,
                    attention_mask=torch.ones(1, length, dtype=torch.long))  # fmt: skip
            torch.testing.assert_close(got, r.logits[0, 0].float(), rtol=1e-5, atol=1e-5)
            token = int(draft.argmax_tokens(state)[0])
            assert token == int(r.logits[0, 0].argmax())
            state_ref = r.last_hidden_state
            state = draft(torch.tensor([token]), state, torch.tensor([c - 1]), meta)


def _repeating_assistant(tmp_path, path, hf):
    """An assistant that drafts the token it reads (its layers add nothing, its embedding is
    the target's projected by pre_projection): greedy outputs of tiny random models repeat
    tokens often enough for drafts to be accepted."""
    folder, model = make_assistant(tmp_path / "a", path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            layer.layer_scalar.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        big = model.pre_projection.weight.shape[1] // 2
        model.pre_projection.weight[:, big:] = 0.0
        proj = model.pre_projection.weight[:, :big]  # [h, H]
        model.model.embed_tokens.weight.copy_(hf.get_input_embeddings().weight @ proj.T)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("adaptive", ["false", "true"])
def test_speculative_greedy_equals_plain(tmp_path, target, adaptive):
    path, hf = target
    folders = {"random": make_assistant(tmp_path / "r", path)[0],
               "repeating": _repeating_assistant(tmp_path, path, hf)}  # fmt: skip
    plain = tokens(tmp_path / "plain", path, ["engine.max_batch_size=4"])
    for (name, folder), k in itertools.product(folders.items(), (1, 3)):
        table, res = run_job(tmp_path / f"{name}{k}", path, PROMPTS,
                             overrides=[f"draft={folder}", f"speculative.num_steps={k}",
                                        f"speculative.adaptive={adaptive}",
                                        "engine.max_batch_size=4"])  # fmt: skip
        assert table.column("output_token_ids").to_pylist() == plain
        drafts = res.stats["drafts"]
        assert drafts["drafted"] > 0
        if name == "repeating" and adaptive == "false":  # the policy soon stops drafting
            assert drafts["accepted"] > 0


def _invoke(tmp_path, model, folder, command="validate"):
    from click.testing import CliRunner

    from eaglebatch.cli import main
    from support.tiny import write_prompts

    inp = write_prompts(tmp_path / "in.parquet", ["hello"])
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {model}\ndraft: {folder}\ninput:\n  path: {inp}\n"
                   f"output:\n  path: {tmp_path / 'o'}\n")  # fmt: skip
    return CliRunner().invoke(main, [command, str(job)])


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("key, edit", [
    ("backbone_hidden_size", lambda c: c.update(backbone_hidden_size=48)),
    ("vocab_size", lambda c: c["text_config"].update(vocab_size=321)),
    ("model_type", None),  # a target of another family
])  # fmt: skip
def test_mismatched_assistant_exits_2_naming_the_key(tmp_path, target, command, key, edit):
    path, _ = target
    folder = make_assistant(tmp_path / "a", path)[0]
    model = path
    if edit is None:
        model = make_tiny_model(tmp_path / "qwen", **{**SHAPE, **FAMILIES["qwen3"]})
    else:
        cfg = json.loads((folder / "config.json").read_text())
        edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    r = _invoke(tmp_path, model, folder, command)
    assert r.exit_code == 2, r.output
    assert key in r.output and "Traceback" not in r.output
