"""The model's own MTP layer as the drafter (`draft: mtp`, speculative/mtp.py): one step against
the same math on transformers' decoder layer, speculative == plain token for token at batch 1
and 8 with drafts none / some / all accepted, the sampled distribution exact (chi-square), and
checkpoints without a usable MTP layer refused before any work (exit 2, naming `draft`).

The tiny targets are transformers checkpoints with `mtp.*` tensors written beside them (a
second safetensors file) and `mtp_num_hidden_layers: 1` added to their config.json. An
"agreeing" MTP layer is the target's one layer copied, reading the token's embedding only
(fc = [I, 0], embeddings of unit RMS so that its input norm is the identity): it predicts what
the target predicts one position later, up to the first token of the context it does not see,
so most of its drafts are accepted; a random one's seldom are."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglebatch.attention.base import AttentionMetadata
from eaglebatch.model.causal_lm import CausalLM
from eaglebatch.runner import build_worker
from eaglebatch.speculative import SpecWorker, load_draft
from eaglebatch.speculative.mtp import MtpDraft
from support.fake_scheduler import FakeRequest, FakeScheduler
from support.spec_models import target_worker
from support.tiny import make_tiny_model
from test_graphs import _job as graph_job
from test_graphs import _outputs as graph_outputs
from test_hybrid_models import HYBRIDS as HYBRID_KINDS
from test_hybrid_models import PREAMBLE, AcceptSpy
from test_hybrid_models import SHAPE as HYBRID_SHAPE
from test_runner import run_job
from test_verify import chi2_critical_001, chi_square

transformers = pytest.importorskip("transformers")
pytest.importorskip("eaglebatch._native")

BLOCK = 4
MAX_LEN = 128
SHAPE = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, init_std=0.3)


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _random_mtp(target: dict[str, torch.Tensor], layer: int, seed: int) -> dict:
    """mtp.* tensors shaped as the target's layer `layer`, random."""
    gen = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{layer}."
    out = {}
    for name, t in target.items():
        if name.startswith(prefix):
            out["mtp.layers.0." + name[len(prefix) :]] = t.clone()
    h = target["model.norm.weight"].shape[0]
    out.update({"mtp.fc.weight": torch.empty(h, 2 * h), "mtp.norm.weight": torch.empty(h),
                "mtp.pre_fc_norm_embedding.weight": torch.empty(h),
                "mtp.pre_fc_norm_hidden.weight": torch.empty(h)})  # fmt: skip
    for t in out.values():
        if t.dim() == 1:  # norms
            t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
        else:
            t.copy_(torch.randn(t.shape, generator=gen) * 1.5 / t.shape[-1] ** 0.5)
    return out


def _agreeing_mtp(model_dir: Path, target: dict[str, torch.Tensor]) -> dict:
    """The module doc's agreeing layer for a one-layer target (whose embedding rows it rescales
    to unit RMS, in place in its checkpoint)."""
    emb = target["model.embed_tokens.weight"]
    target["model.embed_tokens.weight"] = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
    save_file(target, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    out = _random_mtp(target, 0, 0)
    for name in list(out):
        if name.startswith("mtp.layers.0."):
            out[name] = target["model.layers.0." + name[len("mtp.layers.0.") :]].clone()
    h = emb.shape[1]
    out["mtp.fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    out["mtp.pre_fc_norm_embedding.weight"] = torch.ones(h)
    out["mtp.norm.weight"] = target["model.norm.weight"].clone()
    return out


def add_mtp(model_dir: Path, *, agree: bool = False, seed: int = 0, layers: int = 1) -> Path:
    """Writes mtp.safetensors into the transformers checkpoint `model_dir` and states
    `mtp_num_hidden_layers: layers` in its config.json."""
    target = _tensors(model_dir)
    n = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    mtp = _agreeing_mtp(model_dir, target) if agree else _random_mtp(target, n - 1, seed)
    save_file(mtp, str(model_dir / "mtp.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": layers}))
    return model_dir


def qwen3_target(path: Path, *, num_layers: int, agree: bool = False, vocab: int = 320,
                 seed: int = 0) -> Path:  # fmt: skip
    make_tiny_model(path, model_type="qwen3", num_layers=num_layers, vocab_size=vocab, seed=seed,
                    **SHAPE)  # fmt: skip
    return add_mtp(path, agree=agree, seed=seed + 1)


HYBRID_FAMILIES = ("qwen3_5_text", "qwen3_next")


def hybrid_target(path: Path, family: str, *, repeating: bool = False) -> Path:
    """A tiny hybrid checkpoint (test_hybrid_models' shapes: 3 linear layers, then a full
    one) with a random MTP layer; `repeating`: module doc of the hybrid tests below."""
    make_tiny_model(path, init_std=0.1, max_position_embeddings=1024, tie_word_embeddings=True,
                    **{**HYBRID_SHAPE, **HYBRID_KINDS[family]})  # fmt: skip
    add_mtp(path, seed=1)
    if repeating:
        _repeat(path)
    return path


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    return {"random": qwen3_target(root / "random", num_layers=3),
            "agreeing": qwen3_target(root / "agreeing", num_layers=1, agree=True)}  # fmt: skip


# ---- one step ----------------------------------------------------------------------------------


def _reference(model_dir: Path, ids, features) -> torch.Tensor:
    """norm(layer(fc(cat[norm_e(E(ids)), norm_h(features)]))) at positions 0..n-1, the layer and
    norms transformers' own: a one-layer model of the family holding the MTP layer's weights,
    written as a checkpoint and loaded by transformers (which converts the experts' names)."""
    import copy

    cfg = json.loads((model_dir / "config.json").read_text())
    t = {**_tensors(model_dir), **load_file(str(model_dir / "mtp.safetensors"))}
    one = {k: v for k, v in cfg.items() if k not in ("layer_types", "max_window_layers")}
    one.update(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[],
               decoder_sparse_step=1)  # fmt: skip
    state = {"model." + k[len("mtp."):]: v for k, v in t.items() if k.startswith("mtp.layers.")}
    state.update({"model.norm.weight": t["mtp.norm.weight"],
                  "model.embed_tokens.weight": t["model.embed_tokens.weight"]})  # fmt: skip
    if "lm_head.weight" in t:
        state["lm_head.weight"] = t["lm_head.weight"]
    folder = model_dir.parent / f"{model_dir.name}-mtp-reference"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(one))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    layer_model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).model.eval()
    norm = copy.deepcopy(layer_model.norm)  # the family's kind ((1 + w) in Qwen3.5)

    def normed(x, name):
        norm.weight.data.copy_(t[name])
        return norm(x)

    e = normed(t["model.embed_tokens.weight"][ids], "mtp.pre_fc_norm_embedding.weight")
    x = torch.cat((e, normed(features, "mtp.pre_fc_norm_hidden.weight")), -1) @ t["mtp.fc.weight"].T
    with torch.no_grad():
        return layer_model(inputs_embeds=x[None], position_ids=torch.arange(len(ids))[None]
                           ).last_hidden_state[0]  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3", *HYBRID_FAMILIES, "qwen3_5_moe_text"])
def test_one_step_equals_the_math_on_transformers_layer(tmp_path, targets, family):
    """Positions 0..n-1, reading (f_p, x_{p+1}) with f_p the model's final-normed state; the
    hybrids' layer is their gated full attention (partial rotary, (1 + w) norms; Qwen3-Next's
    experts)."""
    path = targets["random"] if family == "qwen3" else hybrid_target(tmp_path / family, family)
    model = CausalLM.from_pretrained(path)
    draft = load_draft(path, model.config, model)
    assert isinstance(draft, MtpDraft)
    assert draft.capture_layers == (model.config.num_hidden_layers,)
    ids = torch.randint(0, 320, (11,), generator=torch.Generator().manual_seed(2))
    n = len(ids) - 1
    blocks = -(-n // BLOCK)
    table = np.arange(blocks, dtype=np.int32)[None]
    meta = AttentionMetadata.from_numpy([0, n], [n], table, np.arange(n), BLOCK, "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        hidden = hf.model(ids[None, :n]).last_hidden_state[0]  # [n, H] f_0..f_{n-1}
        draft.backend.prepare(meta)
        got = draft(ids[1:], hidden, torch.arange(n), meta, draft.allocate_kv_cache(blocks, BLOCK))
        want = _reference(path, ids[1:], hidden)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        logits = hf.get_output_embeddings()(want)
        torch.testing.assert_close(draft.compute_logits(got), logits, rtol=1e-5, atol=1e-5)


# ---- lossless ----------------------------------------------------------------------------------


def _requests(n: int, seed: int = 0) -> list[FakeRequest]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, 30, (1,), generator=gen))
        prompt = torch.randint(0, 320, (length,), generator=gen).tolist()
        out.append(FakeRequest(prompt, int(torch.randint(4, 24, (1,), generator=gen))))
    return out


def _run(worker, k: int, batch: int):
    sched = FakeScheduler(_requests(16), num_blocks=512, block_size=BLOCK, max_batch_size=batch,
                          max_model_len=MAX_LEN, max_draft_tokens=k)  # fmt: skip
    return sched.run(worker), sched


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", ["random", "agreeing"])
def test_greedy_equals_plain(targets, kind, batch):
    path = targets[kind]
    plain, _ = _run(target_worker(path, max_model_len=MAX_LEN), 0, batch)
    accepted = Counter()
    for k in (1, 3):
        worker = SpecWorker.from_target(target_worker(path, max_model_len=MAX_LEN), path,
                                        num_steps=k, max_batch_size=batch, adaptive=False)
        out, sched = _run(worker, k, batch)
        assert out == plain
        assert worker.stats.drafted == k * sum(len(a) for a in sched.accept_log) > 0
        for a in np.concatenate(sched.accept_log):
            accepted[k, "none" if a == 0 else "all" if a == k else "some"] += 1
    rate = sum(n for (_, what), n in accepted.items() if what != "none") / sum(accepted.values())
    if kind == "agreeing":  # rounds of every outcome, most with drafts accepted
        assert accepted[3, "none"] and accepted[3, "some"] and accepted[3, "all"], accepted
        assert rate > 0.5, accepted
    else:
        assert rate < 0.1, accepted


@pytest.mark.parametrize("batch", [1, 8])
def test_a_job_with_draft_mtp_equals_plain(tmp_path, targets, batch):
    """Through the job (`draft: mtp`, the adaptive policy on): the plain run of a checkpoint
    that carries an MTP layer loads without it, and the speculative run equals it."""
    path = targets["agreeing"]
    prompts = [f"prompt {i} " * (1 + i % 3) for i in range(8)]
    common = [f"engine.max_batch_size={batch}"]
    plain, _ = run_job(tmp_path / "p", path, prompts, overrides=common)
    spec, res = run_job(tmp_path / "s", path, prompts,
                        overrides=[*common, "draft=mtp", "speculative.adaptive=false"])
    assert spec.column("output_token_ids").to_pylist() == plain.column(
        "output_token_ids").to_pylist()  # fmt: skip
    drafts = res.stats["drafts"]
    assert drafts["accepted"] > 0 and drafts["drafted"] > drafts["accepted"]
    adaptive, _ = run_job(tmp_path / "a", path, prompts, overrides=[*common, "draft=mtp"])
    assert adaptive.column("output_token_ids").to_pylist() == plain.column(
        "output_token_ids").to_pylist()  # fmt: skip


def test_graph_steps_equal_plain(tmp_path, targets):
    """The uniform (CUDA-graph) steps, run eagerly on the CPU: the MTP layer's chain and extend
    captured per bucket as a head's are."""
    path = targets["agreeing"]
    prompts = [f"prompt {i} " * (1 + i % 3) for i in range(6)]
    runs = {}
    for name, extra in (("plain", []), ("spec", ["draft=mtp", "speculative.adaptive=false"])):
        prep = graph_job(tmp_path, path, prompts, name, ["engine.max_batch_size=4", *extra])
        runs[name] = graph_outputs(prep, build_worker(prep, graph_mode="eager"))
    assert runs["spec"][1].stats["cuda_graphs"]["replays"] > 0
    assert runs["spec"][1].stats["drafts"]["accepted"] > 0
    assert runs["spec"][0] == runs["plain"][0]


def test_the_python_api_takes_draft_mtp(targets):
    from eaglebatch import Engine

    path = targets["agreeing"]
    prompts = ["one two", "three"]
    with Engine(str(path)) as plain:
        want = plain.generate(prompts, sampling={"max_new_tokens": 12})
    with Engine(str(path), draft="mtp", speculative={"adaptive": False}) as spec:
        got = spec.generate(prompts, sampling={"max_new_tokens": 12})
    assert got.column("output_text").to_pylist() == want.column("output_text").to_pylist()
    assert sum(got.column("accepted_tokens").to_pylist()) > 0


# ---- sampling ----------------------------------------------------------------------------------


def _distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.double() / temperature, -1)


@pytest.mark.parametrize("agree", [False, True])
def test_sampled_tokens_follow_the_target_distribution(tmp_path, agree):
    """Thousands of rows with different seeds: the joint distribution of the first three output
    tokens (prefill, then the first verify round's) is the target's own."""
    vocab, n, k, prompt, temperature = 8, 3000, 2, [1, 5, 2], 1.0
    path = qwen3_target(tmp_path / "t", num_layers=1, agree=agree, vocab=vocab)
    blocks = 2 * n + 8
    worker = SpecWorker.from_target(target_worker(path, num_blocks=blocks, max_model_len=32),
                                    path, num_steps=k, max_batch_size=n, adaptive=False)
    reqs = [FakeRequest(list(prompt), 3, temperature, 1.0, 0, seed) for seed in range(n)]
    sched = FakeScheduler(reqs, num_blocks=blocks, block_size=BLOCK, max_batch_size=n,
                          max_model_len=32, max_draft_tokens=k, max_prefill_tokens=10**6)
    out = torch.tensor(sched.run(worker))  # [n, 3]
    accepted = np.concatenate(sched.accept_log)
    assert 0 < accepted.sum() and (accepted < k).any()  # both outcomes occur
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.inference_mode():

        def dist(prefixes: list[list[int]]) -> torch.Tensor:  # [len, V]
            return _distribution(hf(torch.tensor(prefixes)).logits[:, -1].float(), temperature)

        p1 = dist([prompt])[0]
        p2 = dist([prompt + [a] for a in range(vocab)])
        p3 = dist([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
    joint = (p1[:, None, None] * p2[:, :, None] * p3.view(vocab, vocab, -1)).reshape(-1)
    cells = out[:, 0] * vocab * vocab + out[:, 1] * vocab + out[:, 2]
    stat, dof = chi_square(torch.bincount(cells, minlength=vocab**3), joint)
    assert dof >= 10 and stat < chi2_critical_001(dof), (stat, dof)


# ---- hybrid models (linear-attention layers: the target's state rolls back after a round) ------
#
# A "repeating" MTP layer drafts the token it reads: fc reads the embedding only, the layer adds
# nothing (its o_proj and down projections zero) and its norms scale by 1 (w = 0 of the (1 + w)
# norms), so its output is the token's embedding over its RMS, which the tied LM head scores
# highest for that token. The target's residual branches are damped so that its greedy output
# repeats tokens in runs: rounds where no draft, some and all are accepted all occur.


def _repeat(path: Path, damping: float = 0.35) -> None:
    mtp = load_file(str(path / "mtp.safetensors"))
    h = mtp["mtp.norm.weight"].shape[0]
    for name, t in mtp.items():
        if "o_proj" in name or "down_proj" in name:
            t.zero_()
    mtp["mtp.fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    mtp["mtp.norm.weight"].zero_()
    mtp["mtp.pre_fc_norm_embedding.weight"].zero_()
    save_file(mtp, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    target = _tensors(path)
    for name, t in target.items():
        if any(s in name for s in ("o_proj", "down_proj", "out_proj")):
            t.mul_(damping)
    save_file(target, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def hybrid(request, tmp_path_factory) -> Path:
    return hybrid_target(tmp_path_factory.mktemp(request.param), request.param, repeating=True)


HYBRID_PROMPTS = ["hello there " * 3, "abc", "the cat sat on the mat", "x", "qwerty",
                  "12345 12345", "a b c d", "zz"]  # fmt: skip


@pytest.mark.parametrize("batch", [1, 8])
def test_hybrid_speculative_equals_plain(tmp_path, hybrid, batch):
    common = ["sampling.max_new_tokens=32", f"engine.max_batch_size={batch}",
              "engine.max_num_batched_tokens=16"]  # fmt: skip
    plain, _ = run_job(tmp_path, hybrid, HYBRID_PROMPTS, overrides=common, name="plain")
    spies = []
    spec, res = run_job(tmp_path, hybrid, HYBRID_PROMPTS, name="spec",
                        overrides=[*common, "draft=mtp", "speculative.num_steps=3",
                                   "speculative.adaptive=false", "speculative.prompt_lookup_min=0"],
                        wrap=lambda w: spies.append(AcceptSpy(w)) or spies[-1])  # fmt: skip
    assert spec.column("output_token_ids").to_pylist() == plain.column(
        "output_token_ids").to_pylist()  # fmt: skip
    outcomes = Counter("none" if a == 0 else "all" if a == k else "some"
                       for k, row in spies[0].rounds if k > 0 for a in row)  # fmt: skip
    assert outcomes["none"] and outcomes["some"] and outcomes["all"], outcomes


def test_hybrid_prefix_caching_with_draft_mtp_equals_plain(tmp_path, hybrid):
    """Rows sharing test_hybrid_models' 512-token preamble, served from the prefix cache (the
    target's state checkpoint and the MTP layer's K/V of the shared blocks): the tokens of
    plain decoding without caching."""
    prompts = [PREAMBLE + p for p in HYBRID_PROMPTS[:6]]
    common = ["sampling.max_new_tokens=24", "engine.max_batch_size=4",
              "engine.max_num_batched_tokens=128", "engine.kv_cache_tokens=1536"]  # fmt: skip
    plain, _ = run_job(tmp_path, hybrid, prompts, name="plain",
                       overrides=[*common, "engine.prefix_caching=false"])  # fmt: skip
    spec, res = run_job(tmp_path, hybrid, prompts, name="spec",
                        overrides=[*common, "engine.prefix_caching=true", "draft=mtp",
                                   "speculative.adaptive=false"])  # fmt: skip
    assert spec.column("output_token_ids").to_pylist() == plain.column(
        "output_token_ids").to_pylist()  # fmt: skip
    assert sum(spec.column("cached_tokens").to_pylist()) > 0
    assert res.stats["drafts"]["accepted"] > 0


def test_hybrid_sampled_tokens_follow_the_model_distribution(tmp_path):
    """2000 rows of one prompt, each its own seed, drafting by the MTP layer (k = 2): the first
    token, the second given the first and the third given the first two (the prefill's, a
    verify round's, then the same round's or the next one's, which reads the state the first
    round rolled back to) follow the model's distributions. One chi-square over the first
    token's counts and the next-token counts after every prefix drawn 50 times or more (exact
    given the prefixes; a pooled cell of the pairs never drawn would not be)."""
    from support.tiny import byte_tokenizer

    path = hybrid_target(tmp_path / "m", "qwen3_5_text", repeating=True)
    n, text, temp, vocab = 2000, "the cat", 0.3, 320
    over = ["draft=mtp", "speculative.num_steps=2", "speculative.adaptive=false",
            "speculative.prompt_lookup_min=0", f"sampling.temperature={temp}",
            "engine.max_batch_size=64", "sampling.max_new_tokens=3", "sampling.ignore_eos=true"]
    table, res = run_job(tmp_path, path, [text] * n, overrides=over)
    assert 0 < res.stats["drafts"]["accepted"] < res.stats["drafts"]["drafted"]
    out = torch.tensor([t[:3] for t in table.column("output_token_ids").to_pylist()])  # [n, 3]
    ids = byte_tokenizer().encode(text).ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()

    def dist(prefix: tuple[int, ...]) -> torch.Tensor:  # [V] the model's next-token distribution
        with torch.no_grad():
            logits = hf(torch.tensor([ids + list(prefix)])).logits[0, -1]
        return torch.softmax(logits.double() / temp, -1)

    total, dofs = 0.0, 0
    for depth in range(3):
        prefixes = Counter(map(tuple, out[:, :depth].tolist()))
        for prefix, count in prefixes.items():
            if count < 50:
                continue
            rows = (out[:, :depth] == torch.tensor(prefix, dtype=out.dtype)).all(dim=1)
            stat, dof = chi_square(torch.bincount(out[rows, depth], minlength=vocab), dist(prefix))
            total, dofs = total + stat, dofs + dof
    assert dofs >= 10 and total < chi2_critical_001(dofs), (total, dofs)


# ---- refused -----------------------------------------------------------------------------------


def _invoke(tmp_path, model, command):
    from click.testing import CliRunner

    from eaglebatch.cli import main
    from support.tiny import write_prompts

    inp = write_prompts(tmp_path / "in.parquet", ["hello"])
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {model}\ndraft: mtp\ninput:\n  path: {inp}\n"
                   f"output:\n  path: {tmp_path / 'o'}\n")  # fmt: skip
    return CliRunner().invoke(main, [command, str(job)])


def _no_count(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    del cfg["mtp_num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))


def _two_layers(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 2}))


def _misshapen(d: Path) -> None:
    t = load_file(str(d / "mtp.safetensors"))
    t["mtp.fc.weight"] = t["mtp.fc.weight"][:, :64].contiguous()
    save_file(t, str(d / "mtp.safetensors"))


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("edit, words", [
    (_no_count, "no MTP layer"),
    (lambda d: (d / "mtp.safetensors").unlink(), "no mtp.* tensors"),
    (_two_layers, "mtp_num_hidden_layers is 2"),
    (_misshapen, "mtp.fc.weight"),
])  # fmt: skip
def test_a_model_without_a_usable_mtp_layer_exits_2_naming_draft(tmp_path, command, edit, words):
    path = qwen3_target(tmp_path / "m", num_layers=2)
    edit(path)
    r = _invoke(tmp_path, path, command)
    assert r.exit_code == 2, r.output
    assert "draft: mtp" in r.output and words in r.output, r.output
    assert "Traceback" not in r.output


def test_a_gguf_model_is_refused_for_draft_mtp(targets):
    """The MTP layer loads from a safetensors checkpoint only (refused before the MTP check)."""
    import dataclasses

    from eaglebatch.errors import JobError
    from eaglebatch.job.model_files import check_model_dir
    from eaglebatch.model.config import ModelConfig
    from eaglebatch.prepare import _check_draft

    path = targets["random"]
    job = SimpleNamespace(draft="mtp")
    mf = check_model_dir(path)
    _check_draft(job, path, mf, ModelConfig.from_dir(path))  # the safetensors model: fits
    gguf = dataclasses.replace(mf, gguf=path / "model.gguf")
    with pytest.raises(JobError, match=r"^draft: mtp: the model is the GGUF file"):
        _check_draft(job, path, gguf, ModelConfig.from_dir(path))


@pytest.mark.parametrize("raw, count", [
    ({"mtp_num_hidden_layers": 1}, 1),
    ({"text_config": {"mtp_num_hidden_layers": 1}}, 1),  # a multimodal config's text tower
    ({}, 0),
    ({"mtp_num_hidden_layers": True}, None),
    ({"mtp_num_hidden_layers": -1}, None),
])  # fmt: skip
def test_mtp_layer_count(raw, count):
    from eaglebatch.speculative.mtp_config import mtp_layer_count, states_mtp

    assert states_mtp(raw) == (raw != {})
    if count is None:
        with pytest.raises(ValueError, match="mtp_num_hidden_layers must be a count"):
            mtp_layer_count(raw)
    else:
        assert mtp_layer_count(raw) == count
