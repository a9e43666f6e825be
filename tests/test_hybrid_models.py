"""Hybrid linear-attention families (Qwen3.5 dense and MoE text, Qwen3-Next): tiny random
checkpoints written by transformers, run by our CausalLM over paged KV and recurrent states,
against transformers' own forward."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglebatch.attention import allocate_kv_cache
from eaglebatch.model.causal_lm import CausalLM
from eaglebatch.model.config import ModelConfig
from eaglebatch.model.recurrent_state import STATE_ZERO, StepContext
from eaglebatch.speculative import init_random_draft
from paged_kv import PagedSequences
from support.spies import ReaderWaitSpy
from support.tiny import byte_tokenizer, make_tiny_model
from test_runner import hf_greedy, random_prompts, run_job

TOL = dict(atol=1e-4, rtol=1e-4)
# hidden 64, 4 layers: 3 linear + 1 full (the default interval), GQA, head_dim 32
SHAPE = dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_conv_kernel_dim=4)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)  # fmt: skip
HYBRIDS = {
    "qwen3_5_text": dict(model_type="qwen3_5_text"),
    "qwen3_5_moe_text": dict(model_type="qwen3_5_moe_text", **MOE),
    "qwen3_next": dict(model_type="qwen3_next", **MOE, decoder_sparse_step=2),
}


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request, tmp_path_factory):
    """(name, checkpoint dir, transformers' model) of each family."""
    import transformers

    path = make_tiny_model(tmp_path_factory.mktemp(request.param), init_std=0.1,
                           max_position_embeddings=1024,
                           **{**SHAPE, **HYBRIDS[request.param]})  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return request.param, path, hf.eval()


def _ours(path, slots: int = 4, checkpoints: int = 0) -> tuple[CausalLM, list[torch.Tensor]]:
    model = CausalLM.from_pretrained(path)
    model.attach_states(slots, checkpoints)
    cfg = model.config
    return model, allocate_kv_cache(cfg, 64, 16, torch.float32, "cpu")


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:  # [T, V]
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _forward(model, caches, seqs: PagedSequences, batch, ctx: StepContext) -> torch.Tensor:
    ids, pos, meta = seqs.step(batch)
    model.backend.prepare(meta)
    model.states.context = ctx
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, meta, caches))  # [T, V]


def test_family_config_features(hybrid) -> None:
    name, path, _ = hybrid
    cfg = ModelConfig.from_dir(path)
    assert cfg.linear_layers == (0, 1, 2) and cfg.attention_output_gate
    assert cfg.norm_kind == "rms_plus_one" and cfg.rotary_dim == 8  # 32 * 0.25
    assert (cfg.num_experts > 0) == (name != "qwen3_5_text")


def test_prefill_then_decode_and_verify_equal_transformers(hybrid) -> None:
    """Two rows: prefills of 37 and 21 tokens (chunked form, cut at a saved offset), one
    decode token each (step form), then a verify of 4 tokens (step form keeping every
    position) whose kept states continue a row exactly."""
    _, path, hf = hybrid
    model, caches = _ours(path, checkpoints=2)
    gen = torch.Generator().manual_seed(1)
    seqs_ids = [torch.randint(0, 256, (44,), generator=gen).tolist() for _ in range(2)]
    want = [_hf_logits(hf, s) for s in seqs_ids]
    seqs = PagedSequences(64, 16)
    model.states.restore([0, 3], [STATE_ZERO, STATE_ZERO])
    batch = [(0, seqs_ids[0][:37]), (1, seqs_ids[1][:21])]
    ctx = StepContext(slots=[0, 3], lengths=[37, 21], chunked=[True, True],
                      saves=[(0, 15, 4), (1, 20, 5)])  # fmt: skip
    got = _forward(model, caches, seqs, batch, ctx)
    torch.testing.assert_close(got[:37], want[0][:37], **TOL)
    torch.testing.assert_close(got[37:], want[1][:21], **TOL)
    ctx = StepContext(slots=[0, 3], lengths=[1, 1], chunked=[False, False])
    got = _forward(model, caches, seqs, [(0, [seqs_ids[0][37]]), (1, [seqs_ids[1][21]])], ctx)
    torch.testing.assert_close(got[0], want[0][37], **TOL)
    torch.testing.assert_close(got[1], want[1][21], **TOL)
    ctx = StepContext(slots=[0, 3], lengths=[4, 4], chunked=[False, False], keep=True)
    got = _forward(model, caches, seqs, [(0, seqs_ids[0][38:42]), (1, seqs_ids[1][22:26])], ctx)
    torch.testing.assert_close(got[:4], want[0][38:42], **TOL)
    torch.testing.assert_close(got[4:], want[1][22:26], **TOL)
    # row 0 accepts 1 draft (keeps the state after query token 1), row 1 none
    model.states.keep_accepted(ctx, [1, 0])
    seqs.truncate(0, 40)
    seqs.truncate(1, 23)
    ctx = StepContext(slots=[0, 3], lengths=[1, 1], chunked=[False, False])
    got = _forward(model, caches, seqs, [(0, [seqs_ids[0][40]]), (1, [seqs_ids[1][23]])], ctx)
    torch.testing.assert_close(got[0], want[0][40], **TOL)
    torch.testing.assert_close(got[1], want[1][23], **TOL)


def test_a_checkpoint_restores_a_prefix(hybrid) -> None:
    """A state saved after 16 tokens restores into another slot: the rest of the prompt from
    there equals transformers."""
    _, path, hf = hybrid
    model, caches = _ours(path, checkpoints=1)
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    want = _hf_logits(hf, ids)
    seqs = PagedSequences(64, 16)
    model.states.restore([1], [STATE_ZERO])
    _forward(model, caches, seqs, [(0, ids)], StepContext([1], [30], [True], saves=[(0, 15, 4)]))
    seqs.tables[1] = list(seqs.tables[0][:1])  # the cached block
    seqs.lengths[1] = 16
    model.states.restore([2], [0])
    got = _forward(model, caches, seqs, [(1, ids[16:])], StepContext([2], [14], [True]))
    torch.testing.assert_close(got, want[16:], **TOL)


def test_kv_bytes_count_attention_layers_only(hybrid) -> None:
    from eaglebatch.attention import kv_cache_bytes_per_block
    from eaglebatch.attention.base import kv_layer_bytes_per_block

    cfg = ModelConfig.from_dir(hybrid[1])
    one = kv_layer_bytes_per_block(cfg.num_key_value_heads, cfg.head_dim, 16, torch.float32)
    assert kv_cache_bytes_per_block(cfg, 16, torch.float32) == one  # 1 full layer of 4
    caches = allocate_kv_cache(cfg, 8, 16, torch.float32, "cpu")
    assert [c.numel() > 0 for c in caches] == [False, False, False, True]


def test_mtp_tensors_are_ignored_on_load(hybrid, tmp_path) -> None:
    """A checkpoint's multi-token-prediction layer (`mtp.*`) is not the causal LM's: it loads
    without it and without error."""
    import shutil

    _, path, _ = hybrid
    copy = tmp_path / "with_mtp"
    shutil.copytree(path, copy)
    tensors = load_file(copy / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    save_file(tensors, copy / "model.safetensors")
    CausalLM.check_checkpoint(copy, ModelConfig.from_dir(copy))
    CausalLM.from_pretrained(copy)


@pytest.mark.parametrize("key, value", [("layer_types", ["linear_attention", "sliding_attention",
                                                         "linear_attention", "full_attention"]),
                                        ("hidden_act", "gelu"),
                                        ("linear_num_value_heads", 3)])  # fmt: skip
def test_refused_values_name_the_key(hybrid, key, value) -> None:
    raw = json.loads((hybrid[1] / "config.json").read_text())
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict({**raw, key: value})


def test_default_partial_rotary_is_a_quarter() -> None:
    raw = dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=64,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               vocab_size=300, max_position_embeddings=128)  # fmt: skip
    assert ModelConfig.from_dict(raw).rotary_dim == 16
    assert ModelConfig.from_dict({**raw, "partial_rotary_factor": 0.5}).rotary_dim == 32
    assert ModelConfig.from_dict({**raw, "full_attention_interval": 2}).linear_layers == (0, 2)


def test_hybrid_steps_run_eagerly() -> None:
    """No CUDA graphs for hybrid models: unset means off, `engine.cuda_graph: true` is refused
    naming the key."""
    from eaglebatch.errors import JobError
    from eaglebatch.job.engine_settings import hybrid_graph_mode

    assert hybrid_graph_mode(None) == hybrid_graph_mode(False) == "off"
    with pytest.raises(JobError, match="^engine.cuda_graph: true is not supported"):
        hybrid_graph_mode(True)


def test_state_rows_hold_slots_then_checkpoints(hybrid) -> None:
    model, _ = _ours(hybrid[1], slots=3, checkpoints=2)
    states = model.states
    s = model.config.deltanet
    assert set(states.layers) == {0, 1, 2}
    assert states.layers[0].ssm.shape == (5, *s.ssm_state_shape)
    assert states.nbytes == 5 * 3 * s.state_bytes
    assert np.isclose(states.nbytes, 5 * states.bytes_per_row(s, 3))


# ---- end to end: the scheduler's recurrent-state plan fields (state_from, state_saves) ------

PROMPTS = [p or "a" for p in random_prompts(8, seed=21)]
PREAMBLE = ("the cat sat on the mat and the dog ran far away " * 12)[:512]  # 512 byte tokens
CHUNKS = ["engine.max_num_batched_tokens=16"]
HF_REFS: dict = {}


@pytest.fixture(scope="module")
def hybrid_e2e(hybrid):
    """(name, model dir, transformers' model, its greedy 32 tokens on PROMPTS)."""
    name, path, hf = hybrid
    return name, path, hf, [hf_greedy(hf, p, max_new=32) for p in PROMPTS]


def _tokens(table) -> list[list[int]]:
    return table.column("output_token_ids").to_pylist()


def _run(tmp, path, prompts, over, name="out", wrap=None, columns=None):
    return run_job(tmp, path, prompts, name=name, wrap=wrap, columns=columns,
                   overrides=["sampling.max_new_tokens=32", *over])  # fmt: skip


@pytest.mark.parametrize("batch, gemm, overlap", [(1, "native", False), (8, "native", False),
                                                  (8, "torch", False), (8, "native", True)])
def test_greedy_32_tokens_equal_transformers_with_chunks_and_preemption(tmp_path, hybrid_e2e,
                                                                         gemm, batch, overlap):
    """Greedy 32 tokens on 8 prompts at batch 1 and 8, prompts in 16-token chunks, and at
    batch 8 a KV cache so short that rows are preempted (and come back from a zero state);
    also with the next step planned while one is in flight (overlap)."""
    _, path, _, reference = hybrid_e2e
    over = [*CHUNKS, f"engine.cpu_gemm={gemm}", f"engine.max_batch_size={batch}",
            f"engine.overlap={str(overlap).lower()}"]
    if batch > 1:
        over.append("engine.kv_cache_tokens=128")
    table, res = _run(tmp_path, path, PROMPTS, over, wrap=ReaderWaitSpy)
    assert batch == 1 or res.stats["preemptions"] > 0
    assert _tokens(table) == reference


def test_prompt_logprobs_equal_transformers(tmp_path, hybrid_e2e):
    _, path, hf, _ = hybrid_e2e
    table, _ = _run(tmp_path, path, PROMPTS[:4], ["output.prompt_logprobs=1", *CHUNKS])
    for row, prompt in zip(table.to_pylist(), PROMPTS[:4], strict=True):
        ids = byte_tokenizer().encode(prompt).ids
        ref = torch.log_softmax(_hf_logits(hf, ids), dim=-1)
        entries = row["prompt_logprobs"]
        assert [e["token_id"] for e in entries] == ids[1:]
        for j, e in enumerate(entries):
            assert abs(e["logprob"] - ref[j, ids[j + 1]].item()) < 1e-4


class AcceptSpy:
    """Wraps a SpecWorker: records every verify round's accepted counts and width."""

    def __init__(self, worker) -> None:
        self.worker, self.rounds = worker, []
        accept = worker._accept

        def spied(r, *args, **kwargs):
            out = accept(r, *args, **kwargs)
            self.rounds.append((r.k, out.accepted.tolist()))
            return out

        worker._accept = spied

    def __getattr__(self, name):
        return getattr(self.worker, name)


# a literal the grammar forces (its tokens drafted and all accepted), then free letters (the
# random head's drafts: mostly refused)
FORCED = json.dumps({"type": "regex", "pattern": "the cat sat on the mat[a-z ]{0,30}"})


@pytest.mark.parametrize("batch", [1, 8])
def test_speculative_equals_plain(tmp_path, hybrid_e2e, batch):
    """A random EAGLE-3 head (k = 3) with and without prompt lookup equals transformers'
    greedy tokens; under a grammar that forces a literal, rounds accept no draft, some and all
    of them, and every row then resumes from the state after its last accepted token, so the
    tokens equal plain decoding's under the same grammar."""
    _, path, _, reference = hybrid_e2e
    head = init_random_draft(tmp_path / "head", path, kind="eagle3", seed=3,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    spec = [f"draft={head}", "speculative.num_steps=3", "speculative.adaptive=false",
            f"engine.max_batch_size={batch}", *CHUNKS]  # fmt: skip
    spies = []

    def spy(worker):
        spies.append(AcceptSpy(worker))
        return spies[-1]

    for lookup in (False, True) if batch > 1 else (True,):  # CI time: the head alone once
        extra = [] if lookup else ["speculative.prompt_lookup_min=0"]
        table, _ = _run(tmp_path, path, PROMPTS, [*spec, *extra], name=f"spec{lookup}",
                        wrap=spy)  # fmt: skip
        assert _tokens(table) == reference
    formats = {"rf": [FORCED] * len(PROMPTS)}
    grammar = ["input.sampling_columns={response_format: rf}"]
    plain, _ = _run(tmp_path, path, PROMPTS, [*grammar, f"engine.max_batch_size={batch}"],
                    name="plain", columns=formats)  # fmt: skip
    table, _ = _run(tmp_path, path, PROMPTS, [*spec, *grammar], name="forced", columns=formats,
                    wrap=spy)  # fmt: skip
    assert _tokens(table) == _tokens(plain)
    seen = {(a == 0, a == k) for s in spies for k, row in s.rounds for a in row if k > 0}
    assert {(True, False), (False, False), (False, True)} <= seen  # none, some, all


@pytest.mark.parametrize("spec", [False, True])
def test_prefix_caching_on_and_off_equal_with_a_512_token_preamble(tmp_path, hybrid_e2e, spec):
    """Rows sharing a 512-token preamble: the cached run restores the checkpointed state and
    computes only the rest; tokens equal the uncached run's (and transformers'): plain, under
    preemption (a cache of 640 tokens), and with speculative decoding."""
    name, path, hf, _ = hybrid_e2e
    if spec and name != "qwen3_5_text":
        pytest.skip("CI time: the state handling under speculation is the families' shared one")
    prompts = [PREAMBLE + p for p in PROMPTS[:6]]
    reference = HF_REFS.setdefault((path, "pre"), [hf_greedy(hf, p, max_new=32) for p in prompts])
    extra = []
    if spec:
        head = init_random_draft(tmp_path / "head", path, kind="eagle3", seed=4,
                                 aux_layer_ids=(0, 1, 2))  # fmt: skip
        extra = [f"draft={head}", "speculative.adaptive=false"]
    runs = {}
    for caching in (True, False):
        over = [f"engine.prefix_caching={str(caching).lower()}", "engine.max_batch_size=4",
                "engine.kv_cache_tokens=640", "engine.max_num_batched_tokens=128", *extra]
        table, res = _run(tmp_path, path, prompts, over, name=f"c{caching}", wrap=ReaderWaitSpy)
        assert _tokens(table) == reference
        runs[caching] = (table, res)
    assert sum(runs[True][0].column("cached_tokens").to_pylist()) > 0
    assert sum(runs[False][0].column("cached_tokens").to_pylist()) == 0
    assert spec or runs[True][1].stats["preemptions"] > 0  # plain: 4 rows overflow the cache


def test_sampled_tokens_follow_the_model_distribution(tmp_path, hybrid_e2e):
    """1000 rows of one prompt, each its own seed, speculative (a random head, k = 2): the
    joint distribution of the first three tokens (the prefill's, then a verify round's, then
    the next round's, which reads the state the first round rolled back to) is the model's."""
    from test_verify import chi2_critical_001, chi_square

    name, path, hf, _ = hybrid_e2e
    if name != "qwen3_5_text":
        pytest.skip("one family is enough: the state handling is shared")
    n, prompt, temp = 1000, "the cat", 0.3  # a peaked distribution: cells worth counting
    head = init_random_draft(tmp_path / "head", path, kind="eagle3", seed=6,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    over = [f"sampling.temperature={temp}", "engine.max_batch_size=64",
            "sampling.max_new_tokens=3", "sampling.ignore_eos=true", f"draft={head}",
            "speculative.num_steps=2", "speculative.adaptive=false",
            "speculative.prompt_lookup_min=0"]  # fmt: skip
    table, _ = run_job(tmp_path, path, [prompt] * n, overrides=over)
    out = torch.tensor([t[:3] for t in _tokens(table)])  # [n, 3]
    ids = byte_tokenizer().encode(prompt).ids

    def dist(prefix: list[int]) -> torch.Tensor:  # [V] the model's next-token distribution
        return torch.softmax(_hf_logits(hf, ids + prefix)[-1].double() / temp, -1)

    # cells: (a, b, c) for the 8 likeliest a and their 8 likeliest b (fixed before looking at
    # the samples), every c; one more cell for everything else
    p1 = dist([])
    observed, expected = [], []
    for a in p1.topk(8).indices.tolist():
        p2 = dist([a])
        for b in p2.topk(8).indices.tolist():
            expected.append(p1[a] * p2[b] * dist([a, b]))
            pair = (out[:, 0] == a) & (out[:, 1] == b)
            observed.append(torch.bincount(out[pair, 2], minlength=len(p1)))
    observed = torch.cat([*observed, torch.tensor([n - sum(int(o.sum()) for o in observed)])])
    rest = 1.0 - float(sum(e.sum() for e in expected))
    probs = torch.cat([*expected, torch.tensor([rest], dtype=torch.float64)])
    stat, dof = chi_square(observed, probs)
    assert dof >= 10 and stat < chi2_critical_001(dof), (stat, dof)
