"""Stage 3: train the EAGLE-3 head on the captured features; checkpoints; export.

Runs where `train.device` says (CUDA when there is one): the float32 target and the head live
there; the features wait in host memory and travel one batch at a time.

Resumable: `work/ckpt/` holds the draft vocabulary, the initial head and `latest.pt` (the head,
the optimizer, the step, the best validation result and a fingerprint of the data and settings),
replaced atomically every `checkpoint_every` steps; a restarted run continues from it and refuses
a checkpoint trained on other data (delete `work/ckpt/` to start over). At every checkpoint the
head is measured on `val_sequences` held-out training sequences; the exported head
(`output.path/config.json` + `model.safetensors`, bfloat16, EAGLE-3 format with a reduced draft
vocabulary mapped back through d2t) is the best one so far.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglebatch.cpu.gguf_blocks import checkpoint
from eaglebatch.cpu.threads import set_threads
from eaglebatch.errors import JobError
from eaglebatch.job.engine_settings import resolve_device
from eaglebatch.job.fingerprint import sha256_file
from eaglebatch.job.model_files import model_files, resolve_draft_dir
from eaglebatch.model.causal_lm import CausalLM
from eaglebatch.model.config import ModelConfig
from eaglebatch.speculative import init_random_draft
from eaglebatch.speculative.draft_config import default_aux_layer_ids
from eaglebatch.speculative.eagle import EagleDraft, load_draft
from eaglebatch.train.data import (
    PromptEncoder,
    answers_are_greedy,
    generate_answers,
    reference_sequences,
    select_reference,
)
from eaglebatch.train.features import capture, training_sequences
from eaglebatch.train.job import TrainJob
from eaglebatch.train.ttt import step_mask, ttt_forward


def draft_vocabulary(data: ShardData, size: int, eos_ids: tuple[int, ...]) -> list[int]:
    """The `size` tokens the target predicts most often inside the answers (EOS always in)."""
    counts: Counter[int] = Counter()
    for _, _, labels, prompt in data.seqs:
        counts.update(labels[max(0, prompt - 1) :].tolist())
    counts.pop(-1, None)
    top = [t for t, _ in counts.most_common(size)]
    for e in eos_ids:
        if e not in top:
            top = top[: size - 1] + [e]
    return sorted(top[:size])


def init_head(job: TrainJob, target: CausalLM, model_dir: Path, vocab: list[int],
              aux: tuple[int, ...]) -> EagleDraft:
    """A fresh head, written to work/ckpt/init: random layer, lm_head rows and final norm copied
    from the target (tied embedding), fc the identity on the highest aux layer."""
    init_dir = job.work_dir / "ckpt" / "init"
    if not (init_dir / "model.safetensors").is_file():
        init_random_draft(init_dir, model_dir, kind="eagle3", draft_vocab_size=len(vocab),
                          seed=job.train.seed, aux_layer_ids=aux, draft_token_ids=vocab)
    draft = load_draft(init_dir, target.config, target, dtype=torch.float32)
    with torch.no_grad():
        head = target.lm_head_weight
        draft.lm_head.weight.copy_(head[torch.tensor(vocab, device=head.device)].float())
        draft.norm.weight.copy_(target.model.norm.scale().float())  # the target's final norm
        h = draft.config.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, -h:] = torch.eye(h, device=draft.fc.weight.device)
        draft.midlayer.self_attn.o_proj.weight.mul_(0.1)
        draft.midlayer.mlp.down_proj.weight.mul_(0.1)
    return draft


def copy_init_head(job: TrainJob, target: CausalLM) -> tuple[EagleDraft, list[int], str]:
    """head.init_from: copies the head into work/ckpt/init (unless that copy is already of the
    same weights) and returns (the head loaded from it in float32, its draft vocabulary as
    target ids, its weights' sha256). Fails with a JobError naming head.init_from if it is not
    an EAGLE-3 head of this target."""
    src = resolve_draft_dir(job.head.init_from, "head.init_from")
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise JobError(f"head.init_from: {src} has no model.safetensors")
    digest = sha256_file(weights)
    init_dir = job.work_dir / "ckpt" / "init"
    if not (init_dir / "model.safetensors").is_file() or sha256_file(
        init_dir / "model.safetensors"
    ) != digest:
        init_dir.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(src / name, init_dir / f".{name}.tmp")
            os.replace(init_dir / f".{name}.tmp", init_dir / name)
    try:
        draft = load_draft(init_dir, target.config, target, dtype=torch.float32)
    except (ValueError, FileNotFoundError) as e:
        raise JobError(f"head.init_from: {e}") from None
    if not draft.eagle3:
        raise JobError(f"head.init_from: {src} is an EAGLE-1 head; train-draft trains EAGLE-3 "
                       "heads (reduced vocabulary, aux-layer features)")
    n = draft.lm_head.weight.shape[0]
    ids = torch.arange(n) if draft.d2t is None else torch.arange(n) + draft.d2t.cpu()
    return draft, ids.tolist(), digest


class ShardData:
    """All shards in memory (bf16 features: ~3.5 KB per token for a 576-wide target). Each
    sequence: (tokens [n], features [n, n_aux * h], greedy next-token labels [n], prompt length)."""

    def __init__(self, paths: list[Path]) -> None:
        self.seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        for p in paths:
            s = load_file(str(p))
            cu = s["cu"].tolist()
            for i in range(len(cu) - 1):
                a, b = cu[i], cu[i + 1]
                tok = s["tokens"][a:b].long()
                if "labels" in s:
                    lab = s["labels"][a:b].long()
                else:  # older shards: self-distilled answers are the greedy continuation
                    lab = torch.cat([tok[1:], tok.new_full((1,), -1)])
                self.seqs.append((tok, s["feats"][a:b], lab, int(s["prompt"][i])))
        self.t2d = torch.empty(0, dtype=torch.int64)

    def set_vocab(self, vocab: list[int], vocab_size: int) -> None:
        # index vocab_size maps label -1 (no label) to -100 as well
        self.t2d = torch.full((vocab_size + 1,), -100, dtype=torch.int64)
        self.t2d[torch.tensor(vocab)] = torch.arange(len(vocab))

    def split(self, n_val: int, seed: int) -> tuple[list[int], list[int]]:
        """(train, validation) sequence indices: a seeded random `n_val` sequences held out."""
        order = list(range(len(self.seqs)))
        random.Random(seed).shuffle(order)
        n_val = min(n_val, len(order) // 4)
        return sorted(order[n_val:]), sorted(order[:n_val])

    def batches(self, idx: list[int], batch_tokens: int, seed: int) -> list[list[int]]:
        """Length-bucketed batches of `idx` (padded size <= batch_tokens) in a seeded order."""
        order = sorted(idx, key=lambda i: len(self.seqs[i][0]))
        out, cur, longest = [], [], 0
        for i in order:
            n = len(self.seqs[i][0])
            if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
                out.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            out.append(cur)
        random.Random(seed).shuffle(out)
        return out

    def collate(self, idx: list[int], device: torch.device | str = "cpu"):
        """The padded batch of sequences `idx`, on `device`: tokens int64 [B, T], features
        float32 [B, T, n_aux * h], lengths int64 [B], draft-vocab labels int64 [B, T-1] (-100 =
        no loss), chain_ok bool [B, T-1] (see ttt_forward)."""
        seqs = [self.seqs[i] for i in idx]
        t = max(len(s[0]) for s in seqs)
        bsz = len(seqs)
        tokens = torch.zeros(bsz, t, dtype=torch.int64)
        feats = torch.zeros(bsz, t, seqs[0][1].shape[1], dtype=torch.float32)
        labels = torch.full((bsz, t - 1), -100, dtype=torch.int64)
        chain_ok = torch.zeros(bsz, t - 1, dtype=torch.bool)
        lengths = torch.zeros(bsz, dtype=torch.int64)
        vocab_size = len(self.t2d) - 1
        for r, (tok, f, greedy, prompt) in enumerate(seqs):
            n = len(tok)
            tokens[r, :n], feats[r, :n], lengths[r] = tok, f.float(), n
            # position p predicts the target's greedy token after x_{p+1}; train inside the
            # answer: from the prediction of its first token (p + 1 = prompt - 1) on
            lab = self.t2d[greedy[1:].where(greedy[1:] >= 0, vocab_size)]
            lab[: max(0, prompt - 2)] = -100
            labels[r, : n - 1] = lab
            # x_{p+1} is the target's own greedy choice at p: always so in self-distilled
            # answers, about 60% of the time in recorded ones (ttt_forward's chain mask)
            chain_ok[r, : n - 1] = tok[1:] == greedy[:-1]
        out = (tokens, feats, lengths, labels, chain_ok)
        return tuple(x.to(device, non_blocking=True) for x in out)


def acceptance_estimate(accs: list[float]) -> float:
    """Expected accepted tokens per verify round for a chain of len(accs) drafts, treating
    step j's top-1 accuracy (its inputs follow a correct chain) as the chance it is accepted
    given the steps before were: 1 + a1 + a1 a2 + ..."""
    total, run = 1.0, 1.0
    for a in accs:
        run *= a
        total += run
    return total


def verify_rounds(hits: list[torch.Tensor], labels: torch.Tensor) -> tuple[int, int]:
    """(tokens, rounds) of greedy chain decoding replayed over each row's labelled span: a round
    whose first draft step sits at p accepts drafts while step j is right at p + j - 1 and yields
    them plus the target's own token; the next round starts after those. hits: per step, bool
    [B, T-1] as ttt_forward fills it. A position inside the span without a label (the target's
    token is outside the draft vocabulary) is a rejection, as at inference. Exact for
    self-distilled answers; in recorded ones a chain also stops where the text leaves the
    target's choices (step_mask), so there it errs low."""
    tokens = rounds = 0
    k = len(hits)
    right = torch.stack(hits, 0).tolist()  # [K][B][T-1]
    for r, row in enumerate((labels >= 0).tolist()):
        span = [p for p, ok in enumerate(row) if ok]
        if not span:
            continue
        p, end = span[0], span[-1]
        while p <= end:
            m = 0
            while m < k and p + m <= end and right[m][r][p + m]:
                m += 1
            tokens += m + 1
            rounds += 1
            p += m + 1
    return tokens, rounds


@torch.no_grad()
def evaluate(draft: EagleDraft, data: ShardData, idx: list[int],
             job: TrainJob) -> tuple[list[float], float]:
    """Token-weighted top-1 accuracy per unroll step over the sequences `idx`, and the
    acceptance length of chain decoding replayed over them (`verify_rounds`). The second is what
    inference sees: rounds crowd where drafts fail, so it is below 1 + a1 + a1 a2 + ... whenever
    accuracy varies along a text."""
    draft.eval()
    hits = [0.0] * job.train.unroll
    count = [0] * job.train.unroll
    tokens = rounds = 0
    for batch in data.batches(idx, job.train.batch_tokens, 0):
        tokens_in, feats, lengths, labels, chain_ok = data.collate(batch, draft.device)
        right: list[torch.Tensor] = []
        _, _, accs = ttt_forward(draft, tokens_in, feats, lengths, labels, job.train.unroll,
                                 chain_ok, hits=right)
        for j, a in enumerate(accs):
            n = int(step_mask(labels, chain_ok, j + 1).sum())
            hits[j] += a.item() * n
            count[j] += n
        t, r = verify_rounds(right, labels)
        tokens, rounds = tokens + t, rounds + r
    draft.train()
    return [h / max(c, 1) for h, c in zip(hits, count)], tokens / max(rounds, 1)


def export_head(draft: EagleDraft, init_dir: Path, out: Path, meta: dict) -> None:
    """The head in the published EAGLE-3 folder format, bfloat16, written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((init_dir / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg["eaglebatch_training"] = meta
    init = load_file(str(init_dir / "model.safetensors"))
    tensors = {k: v.detach().to(torch.bfloat16).cpu().contiguous()
               for k, v in draft.state_dict().items() if k != "d2t" and "rotary" not in k}
    tensors["d2t"], tensors["t2d"] = init["d2t"], init["t2d"]
    tmp = out / ".model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _lr(step: int, total: int, job: TrainJob) -> float:
    warm = job.train.warmup_steps
    if step < warm:
        return job.train.lr * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return job.train.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _fingerprint(job: TrainJob, vocab: list[int], n_seqs: int, init: str | None) -> dict:
    """What a checkpoint was trained on; resuming with anything else would mix two runs.
    `train.epochs` is not part of it: raising it continues training (the data order of every
    epoch is fixed by the seed; the learning-rate schedule stretches to the new total)."""
    return {"sequences": n_seqs, "vocab": hashlib.sha256(json.dumps(vocab).encode()).hexdigest(),
            "aux": list(job.head.aux_layer_ids or ()), "unroll": job.train.unroll,
            "batch_tokens": job.train.batch_tokens,
            "val_sequences": job.train.val_sequences, "seed": job.train.seed,
            "objective": "chain-masked",  # ttt.step_mask's loss
            **({"init_from": init} if init else {})}


def collect_sequences(job: TrainJob, mf, target: CausalLM, aux, console) -> list[Path]:
    """Stages 1-2: self-distilled answers and reference answers -> feature shards."""
    enc = PromptEncoder(job, mf)
    gen_dir = generate_answers(job, mf, console)
    shards: list[Path] = []
    if json.loads((job.work_dir / "gen.done").read_text())["rows"]:
        seqs = training_sequences(job.work_dir / "prompts.parquet", gen_dir, enc)
        console.print(f"[2/3] capturing target features of {len(seqs)} self-distilled "
                      f"sequences at layers {aux} ...")
        # float32 answers are the target's greedy output: their labels are their next tokens
        shards += capture(target, seqs, aux, job.work_dir / "features", console,
                          greedy_labels=not answers_are_greedy(job.work_dir))
    if job.data.num_reference:
        ref = job.work_dir / "reference.parquet"
        n = select_reference(job, enc, job.work_dir / "prompts.parquet", ref)
        seqs = reference_sequences(job, enc, ref)
        console.print(f"[2/3] capturing target features and greedy labels of {n} reference "
                      f"answers at layers {aux} ...")
        shards += capture(target, seqs, aux, job.work_dir / "features-reference", console)
    return shards


def train_draft(job: TrainJob, console) -> Path:
    """Stages 1-3 (module doc): answers, features, then the head trained and exported to
    `job.output_path` (returned), resuming from work/ckpt when it holds this run's checkpoint."""
    torch.manual_seed(job.train.seed)
    mf = model_files(job.model)
    device = resolve_device(job.train.device, "train.device")
    set_threads(job.train.num_threads, device)
    job.work_dir.mkdir(parents=True, exist_ok=True)
    # float32 wherever it runs: the features and labels are those of the float32 target
    gguf = checkpoint(mf.gguf, ModelConfig.from_dir(mf.dir)) if mf.gguf is not None else None
    target = CausalLM.from_pretrained(mf.dir, dtype=torch.float32, device=device,
                                              gguf=gguf)  # fmt: skip
    for p in target.parameters():
        p.requires_grad_(False)
    init_draft = init_vocab = init_digest = None
    if job.head.init_from is not None:  # before any work: a bad head fails the job here
        init_draft, init_vocab, init_digest = copy_init_head(job, target)
        aux = tuple(init_draft.config.aux_layer_ids)
    else:
        aux = job.head.aux_layer_ids or default_aux_layer_ids(target.config.num_hidden_layers)
    data = ShardData(collect_sequences(job, mf, target, aux, console))
    if not data.seqs:
        raise JobError("train-draft: no training sequences (every answer was empty or failed)")
    vocab = _draft_vocab(job, data, mf.eos_token_ids, init_vocab)
    data.set_vocab(vocab, target.config.vocab_size)
    if init_draft is not None:
        draft = init_draft
    else:
        draft = init_head(job, target, mf.dir, vocab, tuple(aux))
    run = _Training(job, console, device, draft, data, vocab, init_digest)
    run.resume()
    run.announce(len(vocab))
    if run.step == 0 and run.best is None and init_draft is not None and run.val_idx:
        # a fine-tune is measured before its first step: the head it starts from is the first
        # best, so the exported head never validates worse than the one it started from
        run.checkpoint([])
    run.train()
    console.print(f"exported the head to {job.output_path} (step {run.best['step']}, validation "
                  f"expected acceptance length {run.best['tau']:.2f})")
    return job.output_path


def _draft_vocab(
    job: TrainJob, data: ShardData, eos_ids: tuple[int, ...], init_vocab: list[int] | None
) -> list[int]:
    """The draft vocabulary (target ids): the fine-tuned head's, or chosen from the data once.
    It lives in work/ckpt with the initial head and the checkpoint: deleting that folder
    starts training over on the current data."""
    vocab_file = job.work_dir / "ckpt" / "draft_vocab.json"
    vocab_file.parent.mkdir(parents=True, exist_ok=True)
    if init_vocab is not None:
        vocab_file.write_text(json.dumps(init_vocab))
    elif not vocab_file.is_file():
        vocab = draft_vocabulary(data, job.head.draft_vocab_size, eos_ids)
        vocab_file.write_text(json.dumps(vocab))
    return json.loads(vocab_file.read_text())


class _Training:
    """Stage 3's state: the head and its optimizer, the train/validation split, the step and
    the planned total, the best validation so far, and the checkpoint that holds them."""

    def __init__(self, job: TrainJob, console, device: torch.device, draft: EagleDraft,
                 data: ShardData, vocab: list[int], init_digest: str | None) -> None:
        self.job, self.console, self.device = job, console, device
        self.draft, self.data, self.init_digest = draft, data, init_digest
        draft.train()
        self.params = [p for p in draft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=job.train.lr,
                                     weight_decay=job.train.weight_decay)
        self.train_idx, self.val_idx = data.split(job.train.val_sequences, job.train.seed)
        self.per_epoch = len(data.batches(self.train_idx, job.train.batch_tokens, 0))
        self.total = max(1, int(job.train.epochs * self.per_epoch))
        self.fingerprint = _fingerprint(job, vocab, len(data.seqs), init_digest)
        self.ckpt = job.work_dir / "ckpt" / "latest.pt"
        self.init_dir = job.work_dir / "ckpt" / "init"
        self.step, self.best = 0, None
        self.answer_tokens = sum(len(data.seqs[i][0]) - data.seqs[i][3] for i in self.train_idx)

    def resume(self) -> None:
        """Continues from the checkpoint if there is one; a JobError if it was trained on other
        data or settings."""
        if not self.ckpt.is_file():
            return
        state = torch.load(self.ckpt, weights_only=False, map_location=self.device)
        saved = dict(state.get("fingerprint") or {})
        saved.pop("epochs", None)  # recorded by older checkpoints; no longer binding
        if saved != self.fingerprint:
            raise JobError(
                f"{self.ckpt} was trained on other data or settings (saved: "
                f"{saved}, now: {self.fingerprint}); delete {self.ckpt.parent} to "
                "start training over"
            )
        self.draft.load_state_dict(state["draft"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.best = state["step"], state.get("best")
        self.console.print(f"  resuming from step {self.step}/{self.total}")

    def announce(self, vocab_size: int) -> None:
        job = self.job
        self.console.print(
            f"[3/3] training: {len(self.train_idx)} sequences ({self.answer_tokens} answer "
            f"tokens, {len(self.val_idx)} more held out for validation), {self.per_epoch} steps "
            f"per epoch, {self.total} steps, unroll {job.train.unroll}, draft vocabulary "
            f"{vocab_size}")

    def train(self) -> None:
        """Steps until `total` (train.max_minutes may lower it), with a progress line every 10 s
        and a checkpoint every `checkpoint_every` steps and at the end."""
        job = self.job
        planned = self.total  # train.epochs' step count; train.max_minutes may end it sooner
        t0, last, first = time.monotonic(), time.monotonic(), self.step
        with _tf32_on_cuda(self.device):
            while self.step < self.total:
                epoch, i = divmod(self.step, self.per_epoch)
                loss, accs = self._train_step(epoch, i)
                self.step += 1
                now = time.monotonic()
                if job.train.max_minutes is not None and (
                    self.step - first == 20 or self.step % job.train.checkpoint_every == 0
                ):
                    fit = _fit_steps(job, self.step, first, now - t0, planned)
                    if fit != self.total:
                        self.console.print(f"  train.max_minutes: {fit} steps fit ({planned} "
                                           "planned)", highlight=False)
                        self.total = fit
                if now - last > 10 or self.step == self.total:
                    last = now
                    self._progress(epoch, loss, accs, (self.step - first) / max(now - t0, 1e-9))
                if self.step % job.train.checkpoint_every == 0 or self.step == self.total:
                    self.checkpoint([a.item() for a in accs])

    def _train_step(self, epoch: int, i: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One optimizer step on batch i of `epoch`; (loss, per-step accuracies)."""
        job, data = self.job, self.data
        batch = data.batches(self.train_idx, job.train.batch_tokens, job.train.seed + epoch)[i]
        tokens, feats, lengths, labels, chain_ok = data.collate(batch, self.device)
        for g in self.opt.param_groups:
            g["lr"] = _lr(self.step, self.total, job)
        loss, _, accs = ttt_forward(self.draft, tokens, feats, lengths, labels, job.train.unroll,
                                    chain_ok)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, job.train.grad_clip)
        self.opt.step()
        return loss, accs

    def _progress(self, epoch: int, loss: torch.Tensor, accs: list[torch.Tensor],
                  rate: float) -> None:
        """A progress line; `rate`: steps/s of this run."""
        self.console.print(
            f"  step {self.step}/{self.total} epoch {epoch} loss {loss.item():.3f} "
            f"acc/step {' '.join(f'{a.item():.2f}' for a in accs)} "
            f"ETA {(self.total - self.step) / max(rate, 1e-9):.0f}s", highlight=False
        )

    def checkpoint(self, train_accs: list[float]) -> None:
        """Validates the head at `step`, saves the checkpoint and exports the head if it is the
        best so far (`train_accs`, the last batch's, stand in when nothing is held out)."""
        if self.val_idx:
            val, replayed = evaluate(self.draft, self.data, self.val_idx, self.job)
        else:
            val, replayed = train_accs, None
        tau = acceptance_estimate(val)
        # compared as recorded (4 decimals): an equal head is not an improvement
        improved = self.best is None or round(tau, 4) > self.best["tau"]
        if improved:
            self.best = {"step": self.step, "tau": round(tau, 4),
                         "val_acc": [round(a, 4) for a in val]}
            if replayed is not None:
                self.best["replayed_acceptance"] = round(replayed, 4)
        self.ckpt.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.ckpt.with_suffix(".tmp")
        torch.save({"draft": self.draft.state_dict(), "opt": self.opt.state_dict(),
                    "step": self.step, "best": self.best, "fingerprint": self.fingerprint}, tmp)
        os.replace(tmp, self.ckpt)
        what = f"checkpoint {self.step}" if self.step else "the initial head (head.init_from)"
        self.console.print(
            f"  {what}: validation acc/step {' '.join(f'{a:.3f}' for a in val)} "
            f"-> expected acceptance length {tau:.2f} at k={len(val)}"
            + (f", replayed {replayed:.2f}" if replayed is not None else "")
            + (" (best: exported)" if improved else f" (best {self.best['tau']:.2f} at step "
               f"{self.best['step']})"), highlight=False)
        if improved:
            self._export()

    def _export(self) -> None:
        """The best head so far into job.output_path, with what it was trained on."""
        job = self.job
        meta = {"step": self.step, "total_steps": self.total, "sequences": len(self.train_idx),
                "answer_tokens": self.answer_tokens, "unroll": job.train.unroll,
                "validation": self.best}
        if self.init_digest:  # the lineage: what the fine-tuned head was trained on
            base = json.loads((self.init_dir / "config.json").read_text())
            meta["init_from"] = {"head": Path(job.head.init_from).name,
                                 "sha256": self.init_digest,
                                 "training": base.get("eaglebatch_training")}
        export_head(self.draft, self.init_dir, job.output_path, meta)


@contextlib.contextmanager
def _tf32_on_cuda(device: torch.device):
    """TF32 tensor cores for the head's float32 training matmuls on CUDA; the previous setting
    is restored after (the capture before training stays full float32)."""
    precision = torch.get_float32_matmul_precision()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)


def _fit_steps(job: TrainJob, step: int, first: int, elapsed: float, planned: int) -> int:
    """The step count of this run under train.max_minutes at its step rate so far (wall time,
    so checkpoint evaluations count): at least one more step while `planned` is not reached,
    never more than `planned`."""
    if job.train.max_minutes is None or step == first:
        return planned
    rate = (step - first) / max(elapsed, 1e-9)
    fit = step + int((job.train.max_minutes * 60 - elapsed) * rate * 0.97)
    return min(planned, max(step + 1, fit))
