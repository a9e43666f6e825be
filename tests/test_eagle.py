"""EAGLE draft heads: loading both published formats, clear errors, d2t, and the paged forward
against a straightforward dense re-implementation of the reference formulas."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eaglebatch.model import CausalLM, ModelConfig
from eaglebatch.speculative import EagleDraft, default_aux_layer_ids, init_random_draft, load_draft
from eaglebatch.speculative.draft_config import resolve_aux_layer_ids
from paged_kv import PagedSequences
from support.draft_layouts import set_flags
from support.spec_models import make_draft_dir, make_target_dir

KINDS = ["eagle1", "eagle3"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target_dir(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def target(target_dir):
    return CausalLM.from_pretrained(target_dir)


def load(path, target: CausalLM) -> EagleDraft:
    return load_draft(path, target.config, target)


# ---- loading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(tmp_path, target_dir, target, kind) -> None:
    path = make_draft_dir(tmp_path, target_dir, kind)
    config = json.loads((path / "config.json").read_text())
    arch = {"eagle1": "LlamaForCausalLM", "eagle3": "LlamaForCausalLMEagle3"}[kind]
    assert config["architectures"] == [arch] and config["num_hidden_layers"] == 1
    draft = load(path, target)
    assert draft.kind == kind
    saved = load_file(path / "model.safetensors")
    params = dict(draft.named_parameters())
    for name, tensor in saved.items():
        if name in ("d2t", "t2d"):
            continue
        torch.testing.assert_close(params[name], tensor, rtol=0, atol=0)
    if kind == "eagle1":
        assert set(saved) >= {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight"}
        assert "layers.0.input_layernorm.weight" not in saved  # published heads have none
        assert draft.capture_layers == (target.config.num_hidden_layers,)
    else:
        assert saved["fc.weight"].shape == (64, 3 * 64)
        assert saved["midlayer.self_attn.q_proj.weight"].shape == (64, 2 * 64)
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
        assert draft.capture_layers == (1, 2, 3)  # layer outputs 0, 1, 2 = inputs of 1, 2, 3


@pytest.mark.parametrize("kind", KINDS)
def test_pytorch_bin_loads_like_safetensors(tmp_path, target_dir, target, kind) -> None:
    path = make_draft_dir(tmp_path, target_dir, kind)
    reference = load(path, target)
    tensors = load_file(path / "model.safetensors")
    tensors["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    torch.save(tensors, path / "pytorch_model.bin")
    os.remove(path / "model.safetensors")
    draft = load(path, target)
    for (name, a), (_, b) in zip(
        reference.state_dict().items(), draft.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_mismatched_hidden_size_and_vocab(tmp_path, target_dir, target) -> None:
    narrow = make_target_dir(tmp_path / "narrow", hidden=32, heads=4, kv_heads=2)
    other_vocab = make_target_dir(tmp_path / "vocab", vocab=300)
    for kind in KINDS:
        with pytest.raises(ValueError, match="hidden_size 32 does not match the target's"):
            load(make_draft_dir(tmp_path / f"n{kind}", narrow, kind), target)
        with pytest.raises(ValueError, match="vocab_size 300 does not match the target.s vocab_"):
            load(make_draft_dir(tmp_path / f"v{kind}", other_vocab, kind), target)


def _edit(path, fn) -> None:
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_unexpected_and_misshaped_tensors(tmp_path, target_dir, target) -> None:
    e3 = make_draft_dir(tmp_path / "e3", target_dir, "eagle3")
    _edit(e3, lambda t: (t.pop("midlayer.hidden_norm.weight"), t.update(extra=torch.ones(2))))
    with pytest.raises(ValueError) as err:
        load(e3, target)
    assert "missing tensors: midlayer.hidden_norm.weight" in str(err.value)
    assert "unexpected tensors: extra" in str(err.value)

    e1 = make_draft_dir(tmp_path / "e1", target_dir, "eagle1")
    _edit(e1, lambda t: t.pop("fc.bias"))
    with pytest.raises(ValueError, match="missing tensors: fc.bias"):
        load(e1, target)
    _edit(e1, lambda t: t.update({"fc.bias": torch.zeros(64), "fc.weight": torch.zeros(64, 96)}))
    with pytest.raises(ValueError, match=r"fc.weight has shape \(64, 96\); an EAGLE-1 head"):
        load(e1, target)

    bad_emb = make_draft_dir(tmp_path / "emb", target_dir, "eagle1")
    _edit(bad_emb, lambda t: t.update({"embed_tokens.weight": torch.zeros(100, 64)}))
    with pytest.raises(ValueError, match="embed_tokens.weight has shape"):
        load(bad_emb, target)

    reduced = make_draft_dir(tmp_path / "red", target_dir, "eagle3", draft_vocab_size=100)
    _edit(reduced, lambda t: (t.pop("d2t"), t.pop("t2d")))
    with pytest.raises(ValueError, match="missing tensors: d2t"):
        load(reduced, target)

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"hidden_size": 64}))
    save_file({"model.norm.weight": torch.ones(64)}, other / "model.safetensors")
    with pytest.raises(ValueError, match="not an EAGLE draft checkpoint"):
        load(other, target)
    with pytest.raises(FileNotFoundError, match="draft model folder not found"):
        load(tmp_path / "nowhere", target)


def test_eagle3_d2t_maps_draft_ids_to_target_ids(tmp_path, target_dir, target) -> None:
    keep = sorted(torch.randperm(320, generator=torch.Generator().manual_seed(3))[:50].tolist())
    path = make_draft_dir(tmp_path, target_dir, "eagle3", draft_token_ids=keep)
    saved = load_file(path / "model.safetensors")
    assert torch.equal(saved["d2t"] + torch.arange(50), torch.tensor(keep))
    assert saved["t2d"].sum() == 50 and bool(saved["t2d"][keep].all())
    draft = load(path, target)
    hidden = torch.randn(64, 64)
    with torch.inference_mode():
        draft_argmax = draft.compute_logits(hidden).argmax(-1)  # [64] in the draft vocabulary
        tokens = draft.argmax_tokens(hidden)
    assert torch.equal(tokens, torch.tensor(keep)[draft_argmax])

    # t2d that disagrees with d2t is refused
    _edit(path, lambda t: t.update(t2d=torch.ones(320, dtype=torch.bool)))
    with pytest.raises(ValueError, match="t2d does not agree with d2t"):
        load(path, target)


def test_aux_layer_ids() -> None:
    assert default_aux_layer_ids(32) == (2, 16, 29)  # Llama-3.1-8B: inputs of layers 2, 16, 29
    assert resolve_aux_layer_ids({}, 8) == (2, 4, 5)
    assert resolve_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}, 8) == (1, 3, 7)
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}}
    assert resolve_aux_layer_ids(nested, 8) == (2, 4, 8)  # layer outputs: +1
    # every reference concatenates the states in layer order, whatever the config's order
    assert resolve_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [7, 1, 3]}, 8) == (1, 3, 7)
    beyond = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 8]}}
    with pytest.raises(ValueError, match=r"\[2, 4, 9\] from eagle_config.* in \[0, 8\]"):
        resolve_aux_layer_ids(beyond, 8)
    with pytest.raises(ValueError, match=r"target layers \[2, 2, 1\] from the default"):
        resolve_aux_layer_ids({}, 4)


# ---- the forward against a dense re-implementation -----------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:  # [n, H, D], positions 0..n-1
    n, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(n).float()[:, None] * inv[None, :]  # [n, D/2]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
    return x * cos + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1) * sin


def dense_draft(
    w: dict, cfg: ModelConfig, kind: str, emb, feats, norm_before_residual: bool = False
) -> torch.Tensor:
    """The EAGLE draft layer over one whole sequence, from the checkpoint tensors `w`:
    EAGLE-1 fc(cat[emb, feature]) -> Llama layer without input norm; EAGLE-3
    attention over cat[norm(emb), norm(hidden)] with the hidden (norm_before_residual: the
    normed hidden) as residual."""
    eps, hq, hkv, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, 16
    p = "layers.0." if kind == "eagle1" else "midlayer."
    if kind == "eagle1":
        residual = torch.cat((emb, feats), -1) @ w["fc.weight"].T + w["fc.bias"]
        x = residual
    else:
        residual = rms(feats, w[p + "hidden_norm.weight"], eps) if norm_before_residual else feats
        x = torch.cat(
            (
                rms(emb, w[p + "input_layernorm.weight"], eps),
                rms(feats, w[p + "hidden_norm.weight"], eps),
            ),
            -1,
        )
    n = x.shape[0]
    q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(n, hq, d), cfg.rope_theta)
    k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(n, hkv, d), cfg.rope_theta)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, hkv, d)
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, hq * d)
    h = residual + attn @ w[p + "self_attn.o_proj.weight"].T
    y = rms(h, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
    return h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def dense_case(path, target: CausalLM, kind: str, cfg: ModelConfig, **flags):
    """Checkpoint tensors, three sequences' tokens and features, and the dense reference's
    outputs over them, for the random head in `path`."""
    w = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(320, (n,), generator=gen) for n in (9, 1, 14)]
    feats = [torch.randn(len(t), 64, generator=gen) for t in tokens]
    emb = target.model.embed_tokens.weight.detach()
    expected = [dense_draft(w, cfg, kind, emb[t], f, **flags)
                for t, f in zip(tokens, feats, strict=True)]  # fmt: skip
    return w, tokens, feats, expected


def draft_in_chunks(
    draft: EagleDraft,
    tokens: list[torch.Tensor],
    feats: list[torch.Tensor],
    cuts: list[tuple[int, int]],
) -> list[torch.Tensor]:
    """Runs every sequence through the draft over a paged cache, positions lo..hi of each cut
    in one step (sequences shorter than lo sit it out); returns each sequence's outputs."""
    seqs = PagedSequences(64, 4, seed=3)
    kv = draft.allocate_kv_cache(64, 4)
    got: list[list[torch.Tensor]] = [[] for _ in tokens]
    with torch.inference_mode():
        for lo, hi in cuts:
            batch = [(i, t[lo:hi].tolist()) for i, t in enumerate(tokens) if len(t) > lo]
            ids, pos, meta = seqs.step(batch)
            draft.backend.prepare(meta)
            f = torch.cat([feats[i][lo:hi] for i, _ in batch])
            out = draft(ids, f, pos, meta, kv)
            cu = meta.cu_seqlens_q.tolist()
            for row, (i, _) in enumerate(batch):
                got[i].append(out[cu[row] : cu[row + 1]])
    return [torch.cat(g) for g in got]


@pytest.mark.parametrize("kind", KINDS)
def test_paged_forward_matches_dense(tmp_path, target_dir, target, kind) -> None:
    path = make_draft_dir(tmp_path, target_dir, kind, draft_vocab_size=None)
    draft = load(path, target)
    cfg = draft.config.layer
    w, tokens, feats, expected = dense_case(path, target, kind, cfg)

    # chunks: a prefill of the first part, an extend of several tokens, then single tokens
    got = draft_in_chunks(draft, tokens, feats, [(0, 4), (4, 7), (7, 8), (8, 14)])
    for i in range(3):
        torch.testing.assert_close(got[i], expected[i], atol=1e-4, rtol=1e-4)

    # `select`: the same rows (the MLP runs on those only); logits as the reference computes them
    with torch.inference_mode():
        seqs2 = PagedSequences(64, 4, seed=5)
        ids, pos, meta = seqs2.step([(i, tokens[i].tolist()) for i in range(3)])
        draft.backend.prepare(meta)
        last = meta.cu_seqlens_q[1:].long() - 1
        out = draft(ids, torch.cat(feats), pos, meta, draft.allocate_kv_cache(64, 4), select=last)
        ref = torch.stack([e[-1] for e in expected])
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        logits = draft.compute_logits(out)
        if kind == "eagle1":  # the target's lm_head on the un-normed output (the reference)
            ref_logits = ref @ target.lm_head.weight.T
        else:
            ref_logits = rms(ref, w["norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T
        torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=1e-4)
        assert torch.equal(draft.argmax_tokens(out), ref_logits.argmax(-1))


@pytest.mark.parametrize(
    "flags", [{"norm_before_residual": True}, {"norm_before_fc": True}, {"fc_norm": True},
              {"norm_output": True}, {"norm_before_fc": True, "fc_norm": True}],
    ids=lambda f: "+".join(f),
)  # fmt: skip
def test_eagle3_flags_match_the_dense_reference(tmp_path, target_dir, target, flags) -> None:
    """vLLM's llama_eagle3: input_norm over the concatenated aux states, then one fc_norm per
    state, then fc; the residual hidden_norm(feature); norm_output: the output is norm(h)."""
    path = set_flags(make_draft_dir(tmp_path, target_dir, "eagle3"), **flags)
    draft = load(path, target)
    cfg, eps = draft.config.layer, draft.config.layer.rms_norm_eps
    w, tokens, feats, expected = dense_case(
        path, target, "eagle3", cfg, norm_before_residual=bool(flags.get("norm_before_residual")))
    captured = {i: torch.randn(5, 64) for i in range(5)}
    x = torch.cat([captured[i] for i in (1, 2, 3)], -1)
    if flags.get("norm_before_fc"):
        x = rms(x, w["input_norm.weight"], eps)
    if flags.get("fc_norm"):
        x = torch.cat([rms(c, w[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(x.chunk(3, -1))],
                      -1)  # fmt: skip
    with torch.inference_mode():
        torch.testing.assert_close(draft.target_features(captured), x @ w["fc.weight"].T,
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
    got = draft_in_chunks(draft, tokens, feats, [(0, 5), (5, 14)])
    for i in range(3):
        want = expected[i]
        if flags.get("norm_output"):
            want = rms(want, w["norm.weight"], eps)
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4)
        ref_logits = rms(expected[i], w["norm.weight"], eps) @ w["lm_head.weight"].T
        torch.testing.assert_close(draft.compute_logits(got[i]), ref_logits, atol=1e-3, rtol=1e-4)


def test_eagle3_target_features_concatenate_aux_layers(tmp_path, target_dir, target) -> None:
    path = make_draft_dir(tmp_path, target_dir, "eagle3", aux_layer_ids=(3, 0, 2))
    w = load_file(path / "model.safetensors")
    draft = load(path, target)
    assert draft.capture_layers == (0, 2, 3)  # concatenated in layer order, as every reference
    captured = {i: torch.randn(5, 64) for i in range(5)}
    with torch.inference_mode():
        feats = draft.target_features(captured)
    ref = torch.cat([captured[0], captured[2], captured[3]], -1) @ w["fc.weight"].T
    torch.testing.assert_close(feats, ref, atol=1e-5, rtol=1e-5)


def test_full_vocab_eagle3_without_lm_head_uses_the_targets(tmp_path, target_dir, target) -> None:
    path = make_draft_dir(tmp_path, target_dir, "eagle3")
    _edit(path, lambda t: (t.pop("lm_head.weight"), t.pop("d2t"), t.pop("t2d")))
    draft = load(path, target)
    hidden = torch.randn(3, 64)
    with torch.inference_mode():
        ref = draft.norm(hidden) @ target.lm_head.weight.T
        torch.testing.assert_close(draft.compute_logits(hidden), ref)


def test_init_random_draft_rejects_bad_arguments(tmp_path, target_dir) -> None:
    with pytest.raises(ValueError, match="unknown draft kind"):
        init_random_draft(tmp_path, target_dir, "medusa")
    with pytest.raises(ValueError, match="EAGLE-1 heads use the target's vocabulary"):
        init_random_draft(tmp_path, target_dir, "eagle1", draft_vocab_size=10)
    with pytest.raises(ValueError, match="draft_vocab_size 999"):
        init_random_draft(tmp_path, target_dir, "eagle3", draft_vocab_size=999)


def test_models_configure_their_attention_backends(tmp_path, target_dir) -> None:
    """Target and draft pass their head config to their backends when built, so a planning
    backend (flashinfer) can plan before any forward, graph captures included."""
    from eaglebatch.attention.torch_backend import TorchAttentionBackend

    class Recording(TorchAttentionBackend):
        def configure(self, *args, **kwargs) -> None:
            self.config = args

    tgt = CausalLM.from_pretrained(target_dir, dtype=torch.bfloat16,
                                           backend=Recording())
    cfg = tgt.config
    assert tgt.backend.config == (cfg.num_attention_heads, cfg.num_key_value_heads,
                                  cfg.head_dim, torch.bfloat16, torch.bfloat16,
                                  cfg.head_dim**-0.5)
    head = make_draft_dir(tmp_path / "e3", target_dir, "eagle3")
    draft = load_draft(head, cfg, tgt, dtype=torch.float32)
    lc = draft.config.layer
    draft_backend = Recording()
    EagleDraft(draft.config, tgt, backend=draft_backend, dtype=torch.float32)
    assert draft_backend.config == (lc.num_attention_heads, lc.num_key_value_heads,
                                    lc.head_dim, torch.float32, torch.float32, lc.head_dim**-0.5)
