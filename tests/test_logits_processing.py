"""LogitsControls (min_new_tokens, the three penalties) against a dense per-position reference
written from vLLM's definitions: position j of a verify round is processed as if the drafts
before it had been appended to the row's output."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eaglebatch.logits_processing import LogitsControls

V = 40


def reference(logits, prompt, output, drafts, rep, freq, pres, min_tokens, end_ids):
    """One row, dense: logits [Q, V] -> processed [Q, V]."""
    out = logits.clone().double()
    for j in range(out.shape[0]):
        seen_out = list(output) + list(drafts[:j])
        counts = np.bincount(np.asarray(seen_out, dtype=np.int64), minlength=V)
        for v in range(V):
            x = out[j, v].item()
            if v in set(prompt) or counts[v] > 0:
                x = x / rep if x > 0 else x * rep
            x -= freq * counts[v] + pres * (counts[v] > 0)
            out[j, v] = x
        if len(output) + j < min_tokens:
            out[j, end_ids] = -np.inf
    return out.float()


def plan_of(rows, min_tokens):
    """A plan-like object for rows of (prompt, output, rep, freq, pres)."""
    ids, cu, plens = [], [0], []
    for prompt, output, rep, freq, pres in rows:
        on = rep != 1 or freq != 0 or pres != 0
        ids += (list(prompt) + list(output)) if on else []
        cu.append(len(ids))
        plens.append(len(prompt) if on else 0)
    return SimpleNamespace(
        min_tokens=np.asarray(min_tokens, np.int32),
        num_generated=np.asarray([len(r[1]) for r in rows], np.int32),
        penalty_ids=np.asarray(ids, np.int64),
        cu_penalty=np.asarray(cu, np.int32),
        penalty_prompt_lens=np.asarray(plens, np.int32),
        repetition_penalty=np.asarray([r[2] for r in rows], np.float32),
        frequency_penalty=np.asarray([r[3] for r in rows], np.float32),
        presence_penalty=np.asarray([r[4] for r in rows], np.float32),
    )


@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("seed", range(5))
def test_controls_equal_the_dense_reference(q, seed):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(5):
        prompt = rng.integers(0, V, rng.integers(1, 12)).tolist()
        output = rng.integers(0, V // 2, rng.integers(0, 10)).tolist()
        penalties = [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (0.8, 0.5, -0.4), (1.0, 0.0, 1.5),
                     (2.0, -1.0, 0.3)][(i + seed) % 5]  # fmt: skip
        rows.append((prompt, output, *penalties))
    min_tokens = rng.integers(0, 12, len(rows))
    end_ids = torch.tensor([3, 7])
    logits = torch.randn(len(rows), q, V) * 3
    drafts = torch.from_numpy(rng.integers(0, V // 2, (len(rows), q - 1)))
    controls = LogitsControls.from_plan(plan_of(rows, min_tokens), end_ids, "cpu")
    got = controls.apply(logits, drafts if q > 1 else None)
    for i, (prompt, output, rep, freq, pres) in enumerate(rows):
        want = reference(logits[i], prompt, output, drafts[i].tolist(), rep, freq, pres,
                         min_tokens[i], end_ids)  # fmt: skip
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits, logits.clone())  # the input is left alone


def test_nothing_asked_is_none():
    rows = [([1, 2], [3], 1.0, 0.0, 0.0)]
    assert LogitsControls.from_plan(plan_of(rows, [1]), torch.tensor([3]), "cpu") is None
    assert LogitsControls.from_plan(plan_of(rows, [2]), torch.tensor([3]), "cpu") is not None
