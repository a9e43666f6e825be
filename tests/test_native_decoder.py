"""The native few-row decoder layers (cpu/decoder.py) against Hugging Face
transformers, against torch's layers, and row by row against themselves."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eaglebatch.cpu import SMALL_GEMM_AVAILABLE, accelerate
from eaglebatch.cpu.attention import CpuAttentionBackend
from eaglebatch.cpu.decoder import native_layers_fit
from eaglebatch.model import CausalLM
from eaglebatch.model.config import ModelConfig
from eaglebatch.speculative import load_draft
from paged_kv import PagedSequences
from support.spec_models import make_draft_dir, make_target_dir
from test_eagle import dense_case, draft_in_chunks, rms
from test_llama import PROMPTS, VARIANTS, Runner, hf_logits, make_checkpoint

pytestmark = pytest.mark.skipif(not SMALL_GEMM_AVAILABLE, reason="needs AVX-512F or AVX2+FMA")


def native_model(path) -> CausalLM:
    model = CausalLM.from_pretrained(path, backend=CpuAttentionBackend())
    assert accelerate(model, 2)
    return model


def variant_config(variant: str) -> ModelConfig:
    return ModelConfig.from_dict(VARIANTS[variant]().to_dict())


# Gemma 3's and Ministral's layers are not Llama's: their decoder layers never run natively
# (their GEMMs do, tests/test_model_families.py)
@pytest.fixture(scope="module",
                params=[v for v in VARIANTS if native_layers_fit(variant_config(v))])  # fmt: skip
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(request.param, path)
    return hf, native_model(path)


def test_decode_and_verify_steps_match_hf(pair) -> None:
    hf, ours = pair
    run = Runner(ours)
    run.step(list(enumerate(PROMPTS)))  # prefill: torch's layers (too many rows)
    assert ours.native_decoder is None
    gen = torch.Generator().manual_seed(0)
    for width in (1, 1, 3, 4, 9):  # decode steps, then verify-like steps (up to 36 rows)
        batch = [(s, torch.randint(256, (width,), generator=gen).tolist()) for s in range(4)]
        got = run.step(batch)
        for (s, _), logits in zip(batch, got, strict=True):
            ref = hf_logits(hf, run.tokens[s])[-width:]
            torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    assert ours.native_decoder is not None  # the steps above ran natively


def test_captured_hidden_states_match_hf(pair) -> None:
    hf, ours = pair
    layers = hf.config.num_hidden_layers
    capture = (0, 1, layers - 1, layers)
    run = Runner(ours)
    run.step([(0, PROMPTS[0][:-2]), (1, PROMPTS[2][:-2])])
    _, captured = run.step([(0, PROMPTS[0][-2:]), (1, PROMPTS[2][-2:])], capture=capture)
    with torch.inference_mode():
        ref = [hf(torch.tensor([p]), output_hidden_states=True).hidden_states
               for p in (PROMPTS[0], PROMPTS[2])]  # fmt: skip
    for layer in capture:
        expected = torch.cat([r[layer][0, -2:] for r in ref])
        torch.testing.assert_close(captured[layer], expected, atol=1e-4, rtol=1e-4)
    assert not torch.equal(captured[0], captured[1])  # captures are copies, not the live stream


def test_native_layers_refuse_what_they_do_not_compute() -> None:
    llama = variant_config("llama")
    assert native_layers_fit(llama)
    assert not native_layers_fit(dataclasses.replace(llama, query_position_scale=(0.1, 8)))
    assert not native_layers_fit(variant_config("ministral3"))  # its queries scaled by position
    assert not native_layers_fit(variant_config("ministral"))  # its sliding layers
    assert not native_layers_fit(variant_config("gemma3"))


def test_a_verify_step_reproduces_decode_steps_bit_for_bit(tmp_path) -> None:
    make_checkpoint("llama3_rope_bias", tmp_path)  # biases everywhere
    model = native_model(tmp_path)
    prompt, new = list(range(40, 75)), [5, 99, 17, 230]
    one, many = Runner(model), Runner(model)
    one.step([(0, prompt)])
    many.step([(0, prompt), (1, PROMPTS[3])])
    decoded = torch.cat([one.step([(0, [t])])[0] for t in new])  # four 1-row steps
    # one step beside another sequence's 14 rows (18 rows: more than one GEMM tile group)
    verified = many.step([(1, list(range(3, 17))), (0, new)])[1]
    assert torch.equal(decoded, verified)


def test_torch_layers_run_where_the_native_path_does_not_apply(tmp_path) -> None:
    make_checkpoint("llama", tmp_path)
    model = native_model(tmp_path)
    accelerate(model, 0)  # the switch: engine.cpu_gemm torch
    run = Runner(model)
    run.step([(0, PROMPTS[0])])
    run.step([(0, [3])])
    assert getattr(model, "native_decoder", None) is None


@pytest.mark.parametrize("bad", ["slot", "block"])
def test_bad_indices_are_refused_before_anything_is_written(tmp_path, bad) -> None:
    make_checkpoint("llama", tmp_path)
    model = native_model(tmp_path)
    run = Runner(model)
    run.step([(0, PROMPTS[0])])
    ids, pos, meta = run.seqs.step([(0, [9])])
    if bad == "slot":
        meta.slot_mapping = torch.full_like(meta.slot_mapping, 10**6)
    model.backend.prepare(meta)
    if bad == "block":
        meta.backend_state.block_tables[0, 0] = 10**6
    before = [c.clone() for c in run.kv]
    match = "slot 1000000 outside" if bad == "slot" else "block id 1000000 outside"
    with pytest.raises(ValueError, match=match), torch.inference_mode():
        model(ids, pos, meta, run.kv)
    assert all(torch.equal(a, b) for a, b in zip(before, run.kv, strict=True))


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_draft_layer_matches_the_dense_reference(tmp_path, kind) -> None:
    target_dir = make_target_dir(tmp_path / "target")
    target = native_model(target_dir)
    path = make_draft_dir(tmp_path / "draft", target_dir, kind, draft_vocab_size=None)
    draft = load_draft(path, target.config, target)
    assert accelerate(draft, 2, bf16_weights=True)
    cfg = draft.config.layer
    w, tokens, feats, expected = dense_case(path, target, kind, cfg)
    got = draft_in_chunks(draft, tokens, feats, [(0, 4), (4, 7), (7, 8), (8, 12), (12, 14)])
    with torch.inference_mode():  # <= 16 rows per step above; now `select`
        last = torch.tensor([1, 2])  # `select`: packed rows of seq 0 (rows 0-1) and seq 2
        seqs2 = PagedSequences(64, 4, seed=5)
        ids, pos, meta = seqs2.step([(0, tokens[0][:2].tolist()), (2, tokens[2][:1].tolist())])
        draft.backend.prepare(meta)
        f = torch.cat([feats[0][:2], feats[2][:1]])
        picked = draft(ids, f, pos, meta, draft.allocate_kv_cache(64, 4), select=last)
    assert draft.native_decoder is not None
    for i in range(3):
        torch.testing.assert_close(got[i], expected[i], atol=1e-4, rtol=1e-4)
    ref = torch.stack([expected[0][1], expected[2][0]])
    torch.testing.assert_close(picked, ref, atol=1e-4, rtol=1e-4)
    if kind == "eagle3":
        logits = draft.compute_logits(picked)
        ref_logits = rms(ref, w["norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T
        torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=1e-4)
