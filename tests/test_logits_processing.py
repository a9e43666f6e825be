"""LogitsControls (min_new_tokens, the three penalties, min-p) against a dense per-position
reference written from vLLM's definitions: position j of a verify round is processed as if the
drafts before it had been appended to the row's output. Min-p against numpy: the tokens kept,
and the tokens `sample` draws, as an independent float64 implementation finds them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eaglebatch.sampling.logits_processing import LogitsControls

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


def plan_of(rows, min_tokens, end_ids=(3, 7), min_p=None, temperature=None):
    """A plan-like object for rows of (prompt, output, rep, freq, pres); rows below their
    min_tokens carry `end_ids` (as the scheduler's plans do)."""
    ids, cu, plens, ends, cu_ends = [], [0], [], [], [0]
    for (prompt, output, rep, freq, pres), m in zip(rows, min_tokens):
        on = rep != 1 or freq != 0 or pres != 0
        ids += (list(prompt) + list(output)) if on else []
        cu.append(len(ids))
        plens.append(len(prompt) if on else 0)
        ends += list(end_ids) if m > len(output) else []
        cu_ends.append(len(ends))
    b = len(rows)
    return SimpleNamespace(
        kind="verify",  # grammar masks, if any, come with the round (none here)
        min_tokens=np.asarray(min_tokens, np.int32),
        end_ids=np.asarray(ends, np.int64),
        cu_end_ids=np.asarray(cu_ends, np.int32),
        min_p=np.zeros(b, np.float32) if min_p is None else np.asarray(min_p, np.float32),
        temperature=(np.zeros(b, np.float32) if temperature is None
                     else np.asarray(temperature, np.float32)),  # fmt: skip
        top_k=np.zeros(b, np.int32),
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
    end_ids = [3, 7]
    logits = torch.randn(len(rows), q, V) * 3
    drafts = torch.from_numpy(rng.integers(0, V // 2, (len(rows), q - 1)))
    controls = LogitsControls.from_plan(plan_of(rows, min_tokens), "cpu")
    got = controls.apply(logits, drafts if q > 1 else None)
    for i, (prompt, output, rep, freq, pres) in enumerate(rows):
        want = reference(logits[i], prompt, output, drafts[i].tolist(), rep, freq, pres,
                         min_tokens[i], end_ids)  # fmt: skip
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits, logits.clone())  # the input is left alone


def test_nothing_asked_is_none():
    rows = [([1, 2], [3], 1.0, 0.0, 0.0)]
    assert LogitsControls.from_plan(plan_of(rows, [1]), "cpu") is None
    assert LogitsControls.from_plan(plan_of(rows, [2]), "cpu") is not None
    assert LogitsControls.from_plan(plan_of(rows, [2], end_ids=()), "cpu") is None
    # min-p filters sampled rows only: a greedy row's logits are its own
    assert LogitsControls.from_plan(plan_of(rows, [0], min_p=[0.5]), "cpu") is None
    sampled = plan_of(rows, [0], min_p=[0.5], temperature=[0.7])
    assert LogitsControls.from_plan(sampled, "cpu") is not None


def test_rows_end_ids_are_their_own():
    """Each row masks its own end ids (one ignores EOS, one has a stop token id)."""
    rows = [([1], [], 1.0, 0.0, 0.0), ([1], [], 1.0, 0.0, 0.0)]
    plan = plan_of(rows, [2, 2])
    plan.end_ids, plan.cu_end_ids = np.array([5, 9, 2]), np.array([0, 2, 3], np.int32)
    out = LogitsControls.from_plan(plan, "cpu").apply(torch.zeros(2, 1, V))[:, 0]
    assert torch.isinf(out[0, [5, 9]]).all() and torch.isinf(out[1, 2])
    assert torch.isinf(out).sum() == 3


def min_p_reference(logits: np.ndarray, min_p: float, temperature: float) -> np.ndarray:
    """vLLM's min-p in float64: the renormalised probabilities of the tokens whose probability
    after temperature is at least min_p times the largest (0 elsewhere)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    kept = np.where(p >= min_p * p.max(), p, 0.0)
    return kept / kept.sum()


@pytest.mark.parametrize("seed", range(4))
def test_min_p_keeps_what_numpy_keeps_and_samples_from_it(seed):
    from eaglebatch.sampling.sampler import sample, uniform_from_counter

    rng = np.random.default_rng(seed)
    b = 6
    logits = torch.from_numpy(rng.normal(0, 3, (b, V)).astype(np.float32))
    min_p = np.array([0.0, 0.05, 0.1, 0.3, 0.9, 1.0], np.float32)
    temperature = np.array([0.8, 0.5, 1.0, 1.7, 1.0, 0.6], np.float32)
    rows = [([1], [], 1.0, 0.0, 0.0)] * b
    plan = plan_of(rows, [0] * b, min_p=min_p, temperature=temperature)
    out = LogitsControls.from_plan(plan, "cpu").apply(logits[:, None])[:, 0]
    for i in range(b):
        want = min_p_reference(logits[i].numpy(), min_p[i], temperature[i])
        kept = torch.isfinite(out[i]).numpy()
        assert (kept == (want > 0)).all(), i
        got = torch.softmax(out[i].double() / float(temperature[i]), dim=-1).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    # the sampler draws from that distribution: the inverse CDF of the reference at its u
    draws = 200
    seeds = torch.arange(draws, dtype=torch.int64) + 1000 * seed
    counters = torch.zeros(draws, dtype=torch.int32)
    u = uniform_from_counter(seeds, counters).numpy()
    for i in range(b):
        temp = torch.full((draws,), float(temperature[i]))
        top_p, top_k = torch.ones(draws), torch.zeros(draws, dtype=torch.int32)
        tokens = sample(out[i].expand(draws, V).contiguous(), temp, top_p, top_k, seeds, counters)
        cdf = np.cumsum(min_p_reference(logits[i].numpy(), min_p[i], temperature[i]))
        want = np.minimum(np.searchsorted(cdf, u * cdf[-1], side="right"), V - 1)
        assert (tokens.numpy() == want).mean() > 0.99, i  # boundaries may round apart
    # greedy rows are never filtered
    greedy = plan_of(rows, [0] * b, min_p=min_p)
    assert LogitsControls.from_plan(greedy, "cpu") is None


def test_grammar_masks_leave_only_allowed_tokens_per_row_and_position():
    """Packed masks (bit t % 32 of word t // 32) from a decode plan and from a verify round:
    the masked rows keep exactly their allowed tokens at each position, other rows untouched."""
    from eaglebatch.sampling.logits_processing import GrammarMask

    rng = np.random.default_rng(0)
    v, words = 70, 3
    allowed = rng.random((2, 3, words * 32)) < 0.3  # [R, Q, 96]
    allowed[..., v:] = False
    packed = np.packbits(allowed, axis=-1, bitorder="little").view(np.uint32)  # [R, Q, words]
    logits = torch.randn(4, 3, v)
    grammar = GrammarMask.of_drafts(np.array([1, 3]), packed, "cpu")
    out = logits.clone()
    grammar.apply(out)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    for i, row in enumerate((1, 3)):
        keep = torch.from_numpy(allowed[i, :, :v])
        assert torch.equal(out[row][keep], logits[row][keep])
        assert bool(torch.isneginf(out[row][~keep]).all())
    plan = SimpleNamespace(kind="decode", mask_rows=np.array([-1, 0, -1, 1], np.int32),
                           token_masks=packed[:, 0, :])  # fmt: skip
    one = logits[:, :1].clone()
    GrammarMask.of_plan(plan, "cpu").apply(one)
    assert torch.equal(one, out[:, :1])
