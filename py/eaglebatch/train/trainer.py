"""Stage 3: train the EAGLE-3 head on the captured features; checkpoints; export.

Resumable: `work/ckpt/latest.pt` holds the head, the optimizer, the step and the data order, and
is replaced atomically every `checkpoint_every` steps; a restarted run continues from it. The
exported head (`output.path/config.json` + `model.safetensors`, bfloat16, EAGLE-3 format with a
reduced draft vocabulary mapped back through d2t) is rewritten at every checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

from eaglebatch.model.llama import LlamaForCausalLM
from eaglebatch.model_files import model_files
from eaglebatch.speculative import init_random_draft
from eaglebatch.speculative.draft_config import default_aux_layer_ids
from eaglebatch.speculative.eagle import EagleDraft, load_draft

from .data import PromptEncoder, generate_answers
from .features import capture, training_sequences
from .job import TrainJob
from .ttt import ttt_forward


def draft_vocabulary(gen_dir: Path, size: int, eos_ids: tuple[int, ...]) -> list[int]:
    """The `size` most frequent tokens of the target's own answers (EOS always included)."""
    counts: Counter[int] = Counter()
    for ids in pq.read_table(gen_dir, columns=["output_token_ids"]).column(0).to_pylist():
        counts.update(ids or [])
    top = [t for t, _ in counts.most_common(size)]
    for e in eos_ids:
        if e not in top:
            top = top[: size - 1] + [e]
    return sorted(top[:size])


def init_head(job: TrainJob, target: LlamaForCausalLM, model_dir: Path, vocab: list[int],
              aux: tuple[int, ...]) -> EagleDraft:
    """A fresh head: random layer, lm_head rows and final norm copied from the target (tied
    embedding) and fc starting as the identity on the highest aux layer."""
    init_dir = job.work_dir / "init"
    if not (init_dir / "model.safetensors").is_file():
        init_random_draft(init_dir, model_dir, kind="eagle3", draft_vocab_size=len(vocab),
                          seed=job.train.seed, aux_layer_ids=aux, draft_token_ids=vocab)
    draft = load_draft(init_dir, target.config, target, dtype=torch.float32)
    with torch.no_grad():
        head = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
        draft.lm_head.weight.copy_(head[torch.tensor(vocab)].float())
        draft.norm.weight.copy_(target.model.norm.weight.float())
        h = draft.config.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, -h:] = torch.eye(h)
        draft.midlayer.self_attn.o_proj.weight.mul_(0.1)
        draft.midlayer.mlp.down_proj.weight.mul_(0.1)
    return draft


class ShardData:
    """All shards in memory (bf16 features: ~3.5 KB per token for a 576-wide target)."""

    def __init__(self, paths: list[Path], vocab: list[int], vocab_size: int) -> None:
        self.t2d = torch.full((vocab_size,), -100, dtype=torch.int64)
        self.t2d[torch.tensor(vocab)] = torch.arange(len(vocab))
        self.seqs: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for p in paths:
            s = load_file(str(p))
            cu = s["cu"].tolist()
            for i in range(len(cu) - 1):
                a, b = cu[i], cu[i + 1]
                self.seqs.append((s["tokens"][a:b].long(), s["feats"][a:b], int(s["prompt"][i])))

    def batches(self, batch_tokens: int, seed: int) -> list[list[int]]:
        """Length-bucketed batches (padded size <= batch_tokens) in a seeded random order."""
        order = sorted(range(len(self.seqs)), key=lambda i: len(self.seqs[i][0]))
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

    def collate(self, idx: list[int]):
        seqs = [self.seqs[i] for i in idx]
        t = max(len(s[0]) for s in seqs)
        bsz = len(seqs)
        tokens = torch.zeros(bsz, t, dtype=torch.int64)
        feats = torch.zeros(bsz, t, seqs[0][1].shape[1], dtype=torch.float32)
        labels = torch.full((bsz, t - 1), -100, dtype=torch.int64)
        lengths = torch.zeros(bsz, dtype=torch.int64)
        for r, (tok, f, prompt) in enumerate(seqs):
            n = len(tok)
            tokens[r, :n], feats[r, :n], lengths[r] = tok, f.float(), n
            # position p predicts x_{p+2}; train where x_{p+2} is an answer token
            lab = self.t2d[tok[2:]]
            lab[: max(0, prompt - 2)] = -100
            labels[r, : n - 2] = lab
        return tokens, feats, lengths, labels


def export_head(draft: EagleDraft, init_dir: Path, out: Path, meta: dict) -> None:
    """The head in the published EAGLE-3 folder format, bfloat16, written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((init_dir / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg["eaglebatch_training"] = meta
    init = load_file(str(init_dir / "model.safetensors"))
    tensors = {k: v.detach().to(torch.bfloat16).contiguous()
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


def train_draft(job: TrainJob, console) -> Path:
    if job.train.num_threads:
        torch.set_num_threads(job.train.num_threads)
    torch.manual_seed(job.train.seed)
    mf = model_files(job.model)
    gen_dir = generate_answers(job, mf, console)

    target = LlamaForCausalLM.from_pretrained(mf.dir, dtype=torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)
    aux = job.head.aux_layer_ids or default_aux_layer_ids(target.config.num_hidden_layers)
    enc = PromptEncoder(job, mf)
    seqs = training_sequences(job.work_dir / "prompts.parquet", gen_dir, enc)
    console.print(f"[2/3] capturing target features of {len(seqs)} sequences at layers {aux} ...")
    shards = capture(target, seqs, aux, job.work_dir / "features", console)

    vocab_file = job.work_dir / "draft_vocab.json"
    if not vocab_file.is_file():
        vocab = draft_vocabulary(gen_dir, job.head.draft_vocab_size, mf.eos_token_ids)
        vocab_file.write_text(json.dumps(vocab))
    vocab = json.loads(vocab_file.read_text())
    draft = init_head(job, target, mf.dir, vocab, tuple(aux))
    draft.train()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=job.train.lr, weight_decay=job.train.weight_decay)

    data = ShardData(shards, vocab, target.config.vocab_size)
    per_epoch = len(data.batches(job.train.batch_tokens, 0))
    total = max(1, int(job.train.epochs * per_epoch))
    ckpt = job.work_dir / "ckpt" / "latest.pt"
    step = 0
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        console.print(f"  resuming from step {step}/{total}")
    console.print(f"[3/3] training: {len(data.seqs)} sequences, {per_epoch} steps per epoch, "
                  f"{total} steps, unroll {job.train.unroll}")
    init_dir = job.work_dir / "init"
    t0, last, first = time.monotonic(), time.monotonic(), step
    while step < total:
        epoch, i = divmod(step, per_epoch)
        batch = data.batches(job.train.batch_tokens, job.train.seed + epoch)[i]
        tokens, feats, lengths, labels = data.collate(batch)
        for g in opt.param_groups:
            g["lr"] = _lr(step, total, job)
        loss, ces, accs = ttt_forward(draft, tokens, feats, lengths, labels, job.train.unroll)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, job.train.grad_clip)
        opt.step()
        step += 1
        now = time.monotonic()
        if now - last > 10 or step == total:
            last = now
            rate = (step - first) / max(now - t0, 1e-9)  # steps/s of this run
            console.print(
                f"  step {step}/{total} epoch {epoch} loss {loss.item():.3f} "
                f"acc/step {' '.join(f'{a.item():.2f}' for a in accs)} "
                f"ETA {(total - step) / max(rate, 1e-9):.0f}s", highlight=False
            )
        if step % job.train.checkpoint_every == 0 or step == total:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
            meta = {"step": step, "total_steps": total, "sequences": len(data.seqs),
                    "unroll": job.train.unroll, "acc_per_step": [round(a.item(), 4) for a in accs]}
            export_head(draft, init_dir, job.output_path, meta)
    console.print(f"exported the head to {job.output_path}")
    return job.output_path


