"""train-draft: the training-time-test unroll equals the inference draft chain, and the whole
command (generate -> capture -> train -> export) produces a head that loads and stays lossless."""

from __future__ import annotations

import io
import json
import re

import pyarrow.parquet as pq
import pytest
import torch
import transformers
from rich.console import Console
from safetensors.torch import load_file

from eaglebatch.errors import JobError
from eaglebatch.job.config import load_job
from eaglebatch.model.causal_lm import CausalLM
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
from eaglebatch.speculative import init_random_draft
from eaglebatch.speculative.eagle import load_draft
from eaglebatch.train.job import load_train_job
from eaglebatch.train.trainer import train_draft
from eaglebatch.train.ttt import step_mask, ttt_forward
from paged_kv import PagedSequences
from test_runner import random_prompts


def _extend(draft, kv, pk, x, feats):
    """Draft-extend over positions 0..T-2 with (fc(f_p), x_{p+1}); returns out_1 [T-1, h]."""
    if 0 in pk.lengths:
        pk.truncate(0, 0)
    ids, pos, meta = pk.step([(0, x[1:].tolist())])
    draft.backend.prepare(meta)
    return draft(ids, draft.fc(feats[:-1]), pos, meta, kv)


def _random_head(tiny_model_dir, tmp_path, seed: int):
    """(tiny target, random EAGLE-3 head over a 100-token draft vocabulary, aux layers 0-2)."""
    target = CausalLM.from_pretrained(tiny_model_dir)
    d = init_random_draft(tmp_path / "d", tiny_model_dir, kind="eagle3", draft_vocab_size=100,
                          aux_layer_ids=(0, 1, 2), seed=seed)
    return target, load_draft(d, target.config, target)


@torch.no_grad()
def test_ttt_unroll_equals_inference_chain(tiny_model_dir, tmp_path):
    target, draft = _random_head(tiny_model_dir, tmp_path, seed=3)
    torch.manual_seed(0)
    t = 14
    x = torch.randint(0, 256, (t,))
    feats = torch.randn(t, 3 * target.config.hidden_size)
    outs: list[torch.Tensor] = []
    labels = torch.full((1, t - 1), -100)
    ttt_forward(draft, x[None], feats[None], torch.tensor([t]), labels, 3, outputs=outs)

    pk = PagedSequences(num_blocks=16, block_size=4)
    kv = draft.allocate_kv_cache(16, 4)
    out1 = _extend(draft, kv, pk, x, feats)
    torch.testing.assert_close(out1, outs[0][0], atol=1e-4, rtol=1e-4)
    for p in (1, 4, 9, t - 4):
        out1 = _extend(draft, kv, pk, x, feats)
        pk.truncate(0, p)  # draft K/V from the extend is valid for positions < p
        ids, pos, meta = pk.step([(0, [int(x[p + 1])])])  # 2nd draft step at p
        draft.backend.prepare(meta)
        h2 = draft(ids, out1[p - 1 : p], pos, meta, kv)
        torch.testing.assert_close(h2[0], outs[1][0, p], atol=1e-4, rtol=1e-4)
        ids, pos, meta = pk.step([(0, [int(x[p + 2])])])  # 3rd draft step at p+1
        draft.backend.prepare(meta)
        h3 = draft(ids, h2, pos, meta, kv)
        torch.testing.assert_close(h3[0], outs[2][0, p + 1], atol=1e-4, rtol=1e-4)


def test_train_draft_end_to_end_and_resume(tiny_model_dir, tmp_path):
    pytest.importorskip("eaglebatch._native")
    import pyarrow as pa

    prompts = random_prompts(60, seed=11)
    answers = [None if i % 7 == 0 else f"answer {i}: " + p[::-1] for i, p in enumerate(prompts)]
    inp = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": prompts, "response": answers}), inp)
    job_file = tmp_path / "train.yaml"
    job_file.write_text(
        f"model: {tiny_model_dir}\ninput:\n  path: {inp}\n  apply_chat_template: true\n"
        f"output:\n  path: {tmp_path / 'head'}\n"
        "data:\n  holdout_rows: 8\n  num_prompts: 24\n  max_prompt_tokens: 200\n"
        "  max_new_tokens: 12\n  max_batch_size: 8\n"
        "  answer_column: response\n  num_reference: 16\n  max_answer_tokens: 20\n"
        "head:\n  draft_vocab_size: 64\n  aux_layer_ids: [0, 1, 2]\n"
        "train:\n  epochs: 2\n  batch_tokens: 512\n  unroll: 2\n  checkpoint_every: 2\n"
        "  warmup_steps: 1\n  val_sequences: 6\n"
    )
    console = Console(stderr=True)
    job = load_train_job(job_file)
    out = train_draft(job, console)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    work = tmp_path / "head" / "work"
    distilled = pq.read_table(work / "prompts.parquet").column("id").to_pylist()
    reference = pq.read_table(work / "reference.parquet").column("id").to_pylist()
    assert min(distilled) >= 8  # the first 8 rows are never trained on
    assert min(reference) > max(distilled) and len(reference) == 16
    assert all(answers[i] is not None for i in reference)  # rows without an answer skipped
    # reference shards carry the target's own greedy predictions as labels
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    shard = load_file(str(work / "features-reference" / "shard-00000.safetensors"))
    cu = shard["cu"].tolist()
    assert shard["labels"].shape == shard["tokens"].shape and len(cu) == 17
    for a, b in zip(cu[:3], cu[1:4]):
        with torch.no_grad():
            logits = hf(shard["tokens"][a:b].long()[None]).logits[0]
        assert torch.equal(logits.argmax(-1).int(), shard["labels"][a:b])
    # self-distilled answers are the target's greedy output: their shards skip the LM head
    assert "labels" not in load_file(str(work / "features" / "shard-00000.safetensors"))
    ckpt = torch.load(work / "ckpt" / "latest.pt", weights_only=False)
    assert ckpt["best"]["step"] <= ckpt["step"] and len(ckpt["best"]["val_acc"]) == 2
    # another prompt selection is refused before any work: its answers were generated already
    with pytest.raises(JobError, match="another prompt selection"):
        train_draft(load_train_job(job_file, ["data.num_prompts=30"]), console)
    # a second run resumes from the last checkpoint and has nothing left to do
    train_draft(job, console)
    again = torch.load(work / "ckpt" / "latest.pt", weights_only=False)
    assert again["step"] == ckpt["step"]
    # a checkpoint trained with other settings is refused, not silently mixed
    with pytest.raises(JobError, match="other data or settings"):
        train_draft(load_train_job(job_file, ["train.unroll=3"]), console)
    # more epochs continue from the checkpoint
    train_draft(load_train_job(job_file, ["train.epochs=3"]), console)
    more = torch.load(work / "ckpt" / "latest.pt", weights_only=False)
    assert more["step"] > ckpt["step"]

    # the exported head loads and speculative greedy output equals plain greedy output
    run_file = tmp_path / "run.yaml"
    run_file.write_text(
        f"model: {tiny_model_dir}\ninput:\n  path: {inp}\n  apply_chat_template: true\n"
        "  limit: 8\n"
        f"output:\n  path: {tmp_path / 'plain'}\n  include_token_ids: true\n"
        "sampling:\n  max_new_tokens: 12\nengine:\n  device: cpu\n  kv_cache_tokens: 4096\n"
    )
    run_prepared(prepare(load_job(run_file)))
    run_prepared(prepare(load_job(run_file, [f"draft={out}", f"output.path={tmp_path / 'spec'}",
                                             "speculative.num_steps=3"])))
    plain = pq.read_table(tmp_path / "plain").sort_by("row_index")
    spec = pq.read_table(tmp_path / "spec").sort_by("row_index")
    assert plain.column("output_token_ids").to_pylist() == \
        spec.column("output_token_ids").to_pylist()

    # head.init_from fine-tunes that head: same vocabulary and aux layers, its weights as the
    # start (a vanishing learning rate leaves them as they were), its lineage in the metadata
    tuned = tmp_path / "tuned"
    overrides = [f"output.path={tuned}", f"head.init_from={out}", "data.num_prompts=0",
                 "train.lr=1e-30", "train.warmup_steps=0"]
    with pytest.raises(JobError, match="head: aux_layer_ids cannot be set with init_from"):
        load_train_job(job_file, overrides)
    base_job = job_file.read_text().replace("head:\n  draft_vocab_size: 64\n"
                                            "  aux_layer_ids: [0, 1, 2]\n", "")
    job_file.write_text(base_job)
    with pytest.raises(JobError, match="head.init_from: .*neither a folder"):
        train_draft(load_train_job(job_file, overrides[:1] + ["head.init_from=nohead"]),
                    console)
    assert not (tuned / "work" / "features-reference").exists()  # failed before any work
    train_draft(load_train_job(job_file, overrides), console)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tuned / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((tuned / "config.json").read_text())["eaglebatch_training"]
    assert meta["init_from"]["training"]["step"] == more["best"]["step"]
    # the starting head was validated before the first step; training that does not beat it
    # (here: it cannot move) leaves it the exported best
    assert meta["step"] == 0 and meta["validation"]["step"] == 0
    assert torch.load(tuned / "work" / "ckpt" / "latest.pt", weights_only=False)["step"] > 0
    assert json.loads((tuned / "config.json").read_text())[
        "eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]


def test_step_mask_follows_only_target_chosen_chains():
    labels = torch.zeros(1, 8, dtype=torch.int64)
    labels[0, 0] = -100
    chain_ok = torch.ones(1, 8, dtype=torch.bool)
    chain_ok[0, 4] = False  # x_5 is not the target's greedy choice at 4
    m = [step_mask(labels, chain_ok, j)[0].tolist() for j in (1, 2, 3)]
    # step 1 trains on every labelled position: its token is the verified one, whatever it is
    assert m[0] == [False] + [True] * 7
    # step j at p is fed x_{q+1} for q = p-j+2 .. p: p = 4 for step 2, p = 4 and 5 for step 3
    assert m[1] == [False, True, True, True, False, True, True, True]
    assert m[2] == [False, False, True, True, False, False, True, True]
    assert step_mask(labels, None, 3)[0].tolist() == [False, False] + [True] * 6


def test_collate_marks_where_the_answer_is_the_targets_choice():
    from eaglebatch.train.trainer import ShardData

    data = ShardData([])
    tok = torch.tensor([5, 6, 7, 8, 9, 10])
    greedy = torch.tensor([6, 7, 3, 9, 10, 11])  # the target would have said 3, not 8, at p = 2
    data.seqs = [(tok, torch.zeros(6, 4), greedy, 2),
                 (tok[:4], torch.zeros(4, 4), torch.cat([tok[1:4], tok.new_full((1,), -1)]), 1)]
    data.set_vocab(list(range(12)), 12)
    tokens, _, lengths, labels, chain_ok = data.collate([0, 1])
    assert chain_ok[0].tolist() == [True, True, False, True, True]
    assert chain_ok[1].tolist() == [True, True, True, False, False]  # padding past length 4
    assert labels[0].tolist() == [7, 3, 9, 10, 11]
    assert lengths.tolist() == [6, 4]


@torch.no_grad()
def test_ttt_chain_mask_drops_only_later_steps(tiny_model_dir, tmp_path):
    target, draft = _random_head(tiny_model_dir, tmp_path, seed=4)
    torch.manual_seed(1)
    t = 12
    x = torch.randint(0, 256, (1, t))
    feats = torch.randn(1, t, 3 * target.config.hidden_size)
    labels = torch.randint(0, 100, (1, t - 1))
    args = (draft, x, feats, torch.tensor([t]), labels, 3)
    loss, ces, accs = ttt_forward(*args)
    loss_ok, ces_ok, _ = ttt_forward(*args, torch.ones(1, t - 1, dtype=torch.bool))
    torch.testing.assert_close(loss, loss_ok)
    chain_ok = torch.rand(1, t - 1) < 0.5
    _, ces_m, _ = ttt_forward(*args, chain_ok)
    torch.testing.assert_close(ces_m[0], ces[0])  # step 1 is never masked
    # step 2 over the masked positions only: the mean CE of those positions
    outs: list[torch.Tensor] = []
    ttt_forward(*args, chain_ok, outputs=outs)
    sel = step_mask(labels, chain_ok, 2)
    ref = torch.nn.functional.cross_entropy(draft.compute_logits(outs[1][sel]), labels[sel])
    torch.testing.assert_close(ces_m[1], ref)
    assert not torch.allclose(ces_m[1], ces[1])


def test_verify_rounds_replays_chain_decoding():
    from eaglebatch.train.trainer import verify_rounds

    labels = torch.tensor([[-100, 5, 5, -100, 5, 5, 5, -100]])  # span 1..6; 3: outside vocab
    step1 = torch.tensor([[False, True, True, False, False, True, True, False]])
    step2 = torch.tensor([[False, False, True, False, False, True, False, False]])
    # p=1: steps 1, 2 right -> 3 tokens; p=4: rejected -> 1; p=5: step 1 right, 2 wrong at 6 -> 2
    assert verify_rounds([step1, step2], labels) == (6, 3)
    # one draft step: p=1 ok (2), p=3 outside the vocabulary (1), p=4 (1), p=5 ok (2)
    assert verify_rounds([step1], labels) == (6, 4)
    assert verify_rounds([step1], torch.full((1, 8), -100)) == (0, 0)


def test_capture_keeps_only_shards_that_hold_the_same_sequences(tiny_model_dir, tmp_path):
    from eaglebatch.train.features import capture

    target = CausalLM.from_pretrained(tiny_model_dir)
    console = Console(file=io.StringIO(), width=200)
    first = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10])]
    (path,) = capture(target, first, (0, 1, 2), tmp_path, console, greedy_labels=False)
    assert "labels" not in load_file(str(path))
    # progress with the capture rate and what is left (nothing, after the only shard)
    assert re.search(r"features: 2/2 sequences, [\d,.]+ tok/s, ETA 0s", console.file.getvalue())
    stamp = path.stat().st_mtime_ns
    capture(target, first, (0, 1, 2), tmp_path, console, greedy_labels=False)
    assert path.stat().st_mtime_ns == stamp  # complete and current: kept
    # same count and lengths, other tokens (a re-selected data set): rewritten
    second = [([1, 2, 3], [4, 6]), ([6, 7], [8, 9, 10])]
    capture(target, second, (0, 1, 2), tmp_path, console, greedy_labels=False)
    assert load_file(str(path))["tokens"].tolist() == [1, 2, 3, 4, 6, 6, 7, 8, 9, 10]
    # labels asked for where the shard has none: rewritten with them
    capture(target, second, (0, 1, 2), tmp_path, console)
    assert load_file(str(path))["labels"].shape == (10,)


def test_prompt_selection_by_length_and_its_key(tiny_model_dir, tmp_path):
    pytest.importorskip("eaglebatch._native")
    import pyarrow as pa

    from eaglebatch.job.model_files import model_files
    from eaglebatch.train.data import PromptEncoder, select_prompts

    prompts = random_prompts(40, seed=5)
    inp = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": prompts}), inp)
    job_file = tmp_path / "train.yaml"
    job_file.write_text(
        f"model: {tiny_model_dir}\ninput:\n  path: {inp}\noutput:\n  path: {tmp_path / 'h'}\n"
        "data:\n  holdout_rows: 4\n  num_prompts: 6\n  min_prompt_tokens: 12\n"
        "  max_prompt_tokens: 30\n"
    )
    job, mf = load_train_job(job_file), model_files(str(tiny_model_dir))
    lengths = [len(PromptEncoder(job, mf)(p)) for p in prompts]
    want = [i for i, n in enumerate(lengths) if i >= 4 and 12 <= n <= 30][:6]
    assert len(want) == 6 and any(n < 12 for n in lengths[4:]) and any(n > 30 for n in lengths)
    out = tmp_path / "sel.parquet"
    assert select_prompts(job, mf, out) == 6
    assert pq.read_table(out).column("id").to_pylist() == want
    # the length bounds are part of the selection: other bounds are another selection
    with pytest.raises(JobError, match="another prompt selection"):
        select_prompts(load_train_job(job_file, ["data.min_prompt_tokens=0"]), mf, out)
    # a file written before min_prompt_tokens existed was selected with 0
    job0 = load_train_job(job_file, ["data.min_prompt_tokens=0"])
    select_prompts(job0, mf, old := tmp_path / "old.parquet")
    table = pq.read_table(old)
    key = json.loads(table.schema.metadata[b"eaglebatch.selection"])
    del key["min_prompt_tokens"]
    pq.write_table(table.replace_schema_metadata({"eaglebatch.selection": json.dumps(key)}), old)
    assert select_prompts(job0, mf, old) == 6
    with pytest.raises(JobError, match="another prompt selection"):
        select_prompts(job, mf, old)
    with pytest.raises(JobError, match="min_prompt_tokens"):
        load_train_job(job_file, ["data.min_prompt_tokens=31"])


def _self_distill_job(model_dir, tmp_path, *, prompts: int, num_prompts: int, train: str):
    """A train-draft job over `prompts` random chat prompts (the first 4 held out), answered by
    the target (10 new tokens), a 64-token draft vocabulary, `train` as a YAML flow mapping."""
    import pyarrow as pa

    inp = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": random_prompts(prompts, seed=5)}), inp)
    job_file = tmp_path / "train.yaml"
    job_file.write_text(
        f"model: {model_dir}\ninput:\n  path: {inp}\n  apply_chat_template: true\n"
        f"output:\n  path: {tmp_path / 'head'}\n"
        f"data:\n  holdout_rows: 4\n  num_prompts: {num_prompts}\n  max_new_tokens: 10\n"
        "head:\n  draft_vocab_size: 64\n  aux_layer_ids: [0, 1, 2]\n"
        f"train: {{{train}}}\n"
    )
    return job_file


def test_bf16_answers_are_relabelled_and_max_minutes_ends_the_schedule(tiny_model_dir,
                                                                          tmp_path):
    pytest.importorskip("eaglebatch._native")
    from eaglebatch.train.trainer import _fit_steps

    job_file = _self_distill_job(
        tiny_model_dir, tmp_path, prompts=20, num_prompts=10,
        train="epochs: 60, batch_tokens: 256, unroll: 2, checkpoint_every: 50, "
              "warmup_steps: 1, val_sequences: 2, max_minutes: 0.0001")
    console = Console(stderr=True)
    work = tmp_path / "head" / "work"
    if not torch.cuda.is_available():
        with pytest.raises(JobError, match="train.device"):
            train_draft(load_train_job(job_file, ["train.device=cuda"]), console)
    train_draft(load_train_job(job_file), console)
    # 6 ms of training: the schedule ends at the first estimate (step 21), far short of the
    # planned steps, with a final checkpoint and an exported head
    ckpt = torch.load(work / "ckpt" / "latest.pt", weights_only=False)
    meta = json.loads((tmp_path / "head" / "config.json").read_text())["eaglebatch_training"]
    assert ckpt["step"] == 21 == meta["total_steps"] and ckpt["best"]["step"] == 21
    # float32 answers (CPU) are their own labels; answers recorded as generated in bfloat16
    # get the float32 target's argmax as labels, since they may part from it at near-ties
    done = json.loads((work / "gen.done").read_text())
    assert done["dtype"] == "float32"
    assert "labels" not in load_file(str(work / "features" / "shard-00000.safetensors"))
    (work / "gen.done").write_text(json.dumps({**done, "dtype": "bfloat16"}))
    for name in ("features", "ckpt"):
        for f in sorted((work / name).rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
    train_draft(load_train_job(job_file), console)
    shard = load_file(str(work / "features" / "shard-00000.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cu = shard["cu"].tolist()
    with torch.no_grad():
        logits = hf(shard["tokens"][cu[0] : cu[1]].long()[None]).logits[0]
    assert torch.equal(logits.argmax(-1).int(), shard["labels"][cu[0] : cu[1]])

    # the estimate: steps that fit in the time left at the rate so far, within [step+1, planned]
    job = load_train_job(job_file, ["train.max_minutes=1"])
    assert _fit_steps(job, step=100, first=0, elapsed=20.0, planned=10_000) == 100 + int(
        40 * 5 * 0.97)
    assert _fit_steps(job, step=100, first=0, elapsed=20.0, planned=150) == 150
    assert _fit_steps(job, step=100, first=0, elapsed=90.0, planned=10_000) == 101
    assert _fit_steps(job, step=100, first=0, elapsed=90.0, planned=100) == 100
    assert _fit_steps(load_train_job(job_file, ["train.max_minutes=null"]), 100, 0, 90.0,
                      500) == 500


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_train_draft_on_cuda(tiny_model_dir, tmp_path):
    """On a GPU the answers are generated in bfloat16 (the engine's CUDA default), relabelled by
    the float32 target there, and the head trains there; the exported head loads on the CPU."""
    pytest.importorskip("eaglebatch._native")
    job_file = _self_distill_job(
        tiny_model_dir, tmp_path, prompts=24, num_prompts=16,
        train="device: cuda, epochs: 3, batch_tokens: 512, unroll: 2, checkpoint_every: 4, "
              "warmup_steps: 1, val_sequences: 4")
    out = train_draft(load_train_job(job_file), Console(stderr=True))
    work = tmp_path / "head" / "work"
    assert json.loads((work / "gen.done").read_text())["dtype"] == "bfloat16"
    shard = load_file(str(work / "features" / "shard-00000.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cu = shard["cu"].tolist()
    same = total = 0
    for a, b in zip(cu[:-1], cu[1:]):
        with torch.no_grad():
            greedy = hf(shard["tokens"][a:b].long()[None]).logits[0].argmax(-1).int()
        same += int((greedy == shard["labels"][a:b]).sum())
        total += b - a
    assert same / total > 0.99  # float32 on both sides; only summation order differs
    target = CausalLM.from_pretrained(tiny_model_dir)
    assert load_draft(out, target.config, target).eagle3
