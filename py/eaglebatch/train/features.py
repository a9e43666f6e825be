"""Stage 2: the target's hidden states at the draft's aux layers over prompt + answer.

Shards `work/features/shard-NNNNN.safetensors` of SHARD_SEQS sequences (each written under a
temporary name, then renamed: a shard that exists is complete; one whose tokens are not those of
its slot's sequences now, after the data set grew or was selected anew, is rewritten):
    tokens  int32 [N]          prompt + answer of every sequence, packed
    cu      int64 [S+1]        sequence offsets
    prompt  int32 [S]          prompt length (labels inside the answer only)
    feats   bfloat16 [N, 3h]   hidden states of the aux layers (HF output_hidden_states indices)
    labels  int32 [N]          the target's greedy next token after each position
Shards without `labels` (self-distilled answers, and shards older than it) are read with labels =
the next token of the sequence: a self-distilled answer is the target's greedy output, so the
LM-head pass that computes the labels is skipped for them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglebatch.attention import AttentionMetadata, allocate_kv_cache
from eaglebatch.model.causal_lm import CausalLM
from eaglebatch.train.data import PromptEncoder

SHARD_SEQS = 64


def training_sequences(prompts: Path, gen_dir: Path, enc: PromptEncoder) -> list[tuple]:
    """(prompt_ids, answer_ids) for every successfully generated row, in prompt order."""
    ptab = pq.read_table(prompts)
    by_id = dict(zip(ptab.column("id").to_pylist(), ptab.column(enc.column).to_pylist()))
    gen = pq.read_table(gen_dir, columns=["id", "output_token_ids", "finish_reason"])
    rows = sorted(zip(*(gen.column(i).to_pylist() for i in range(3))))
    seqs = []
    for rid, out, reason in rows:
        if reason == "error" or not out:
            continue
        prompt = enc(by_id[rid])
        if prompt:
            seqs.append((prompt, out))
    return seqs


@torch.inference_mode()
def capture(
    target: CausalLM,
    seqs: list[tuple[list[int], list[int]]],
    aux_layers: tuple[int, ...],
    out_dir: Path,
    console,
    batch_tokens: int = 4096,
    greedy_labels: bool = True,
) -> list[Path]:
    """Writes missing shards; returns all shard paths. A prefill-only forward per batch over a
    scratch paged KV cache (block size 16, blocks handed out contiguously). `greedy_labels`:
    store the target's argmax after every position (answers not written by the target)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if not seqs:
        return []
    bs = 16
    longest = max(len(p) + len(a) for p, a in seqs)
    blocks = (max(batch_tokens, longest) // bs) + 2 * SHARD_SEQS + 8
    kv = allocate_kv_cache(target.config, blocks, bs, target.dtype, target.device)
    paths = []
    # progress: tokens of the shards handled so far (kept or written) and captured by this run
    total, handled, captured, t0 = sum(len(p) + len(a) for p, a in seqs), 0, 0, time.monotonic()
    for s0 in range(0, len(seqs), SHARD_SEQS):
        path = out_dir / f"shard-{s0 // SHARD_SEQS:05d}.safetensors"
        paths.append(path)
        shard = seqs[s0 : s0 + SHARD_SEQS]
        toks = [np.asarray(p + a, dtype=np.int64) for p, a in shard]
        shard_tokens = sum(len(t) for t in toks)
        handled += shard_tokens
        if path.is_file() and _holds(path, toks, [len(p) for p, _ in shard], greedy_labels):
            continue
        feats, labels = [], []
        for batch in _packed(toks, batch_tokens):
            f, lab = _forward(target, batch, aux_layers, kv, bs, greedy_labels)
            feats.extend(f)
            labels.extend(lab)
        _write_shard(path, toks, [len(p) for p, _ in shard], feats, labels, greedy_labels)
        captured += shard_tokens
        rate = captured / max(time.monotonic() - t0, 1e-9)  # tokens/s of this run
        console.print(f"  features: {min(s0 + SHARD_SEQS, len(seqs))}/{len(seqs)} sequences, "
                      f"{rate:,.0f} tok/s, ETA {(total - handled) / rate:.0f}s", highlight=False)
    return paths


def _packed(toks: list[np.ndarray], batch_tokens: int) -> list[list[np.ndarray]]:
    """`toks` in order, packed into batches of at most batch_tokens tokens (a longer sequence
    is a batch of its own)."""
    batches = []
    i = 0
    while i < len(toks):
        j, n = i, 0
        while j < len(toks) and (j == i or n + len(toks[j]) <= batch_tokens):
            n += len(toks[j])
            j += 1
        batches.append(toks[i:j])
        i = j
    return batches


def _write_shard(
    path: Path,
    toks: list[np.ndarray],
    prompt_lens: list[int],
    feats: list[torch.Tensor],
    labels: list[torch.Tensor | None],
    greedy_labels: bool,
) -> None:
    """The shard (module doc) of sequences `toks` with their features [n, n_aux * h] and
    greedy labels [n] (stored if `greedy_labels`), written under a temporary name."""
    cu = np.cumsum([0] + [len(t) for t in toks])
    tmp = path.with_suffix(".tmp")
    tensors = {
        "tokens": torch.from_numpy(np.concatenate(toks).astype(np.int32)),
        "cu": torch.from_numpy(cu.astype(np.int64)),
        "prompt": torch.tensor(prompt_lens, dtype=torch.int32),
        "feats": torch.cat(feats).to(torch.bfloat16).cpu().contiguous(),
    }
    if greedy_labels:
        tensors["labels"] = torch.cat(labels).to(torch.int32).cpu()
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def _holds(path: Path, toks: list[np.ndarray], prompt_lens: list[int], labels: bool) -> bool:
    """True if the shard at `path` holds exactly these sequences (tokens and prompt lengths),
    with greedy labels if `labels` (a shard may hold labels it does not need)."""
    with safe_open(str(path), "pt") as f:
        if labels and "labels" not in f.keys():
            return False
        prompt = f.get_tensor("prompt")
        if prompt.tolist() != prompt_lens:
            return False
        stored = f.get_tensor("tokens").numpy()
    want = np.concatenate(toks)
    return stored.shape == want.shape and bool((stored == want).all())


def _forward(target, toks: list[np.ndarray], aux_layers, kv, bs: int, greedy_labels: bool):
    """Per sequence: (aux features [n, n_aux * h] float32, greedy next-token ids [n] or None
    when not `greedy_labels`)."""
    lens = np.array([len(t) for t in toks])
    cu = np.concatenate([[0], np.cumsum(lens)])
    nblk = -(-lens // bs)
    starts = np.concatenate([[0], np.cumsum(nblk)[:-1]])
    width = int(nblk.max())
    tables = np.zeros((len(toks), width), dtype=np.int32)
    slots = []
    for r, (s, nb, n) in enumerate(zip(starts, nblk, lens, strict=False)):
        tables[r, :nb] = np.arange(s, s + nb)
        slots.append(s * bs + np.arange(n))
    meta = AttentionMetadata.from_numpy(
        cu, lens, tables, np.concatenate(slots), bs, target.device
    )
    target.backend.prepare(meta)
    ids = torch.from_numpy(np.concatenate(toks)).to(target.device)
    pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lens])).to(target.device)
    hidden, captured = target(ids, pos, meta, kv, capture_layers=tuple(aux_layers))
    f = torch.cat([captured[i] for i in aux_layers], dim=-1)  # [N, n_aux * h]
    feats = [f[cu[r] : cu[r + 1]].float() for r in range(len(toks))]
    if not greedy_labels:
        return feats, [None] * len(toks)
    # argmax over the full vocabulary, 1024 rows at a time ([1024, V] float32 logits)
    greedy = torch.cat([target.compute_logits(hidden[a : a + 1024]).argmax(-1)
                        for a in range(0, hidden.shape[0], 1024)])
    return feats, [greedy[cu[r] : cu[r + 1]] for r in range(len(toks))]
