"""Verification of drafts: greedy prefix acceptance and speculative sampling (distribution,
reproducibility, no softmax on the greedy path)."""

from __future__ import annotations

import math

import pytest
import torch

from eaglebatch.sampling.distribution import filtered_probs
from eaglebatch.sampling.sampler import sample
from eaglebatch.speculative import verify, verify_greedy, verify_sampling


def cols(b: int, temperature=1.0, top_p=1.0, top_k=0, seed0=0, num_generated=0):
    return (
        torch.full((b,), temperature, dtype=torch.float32),
        torch.full((b,), top_p, dtype=torch.float32),
        torch.full((b,), top_k, dtype=torch.int32),
        torch.arange(seed0, seed0 + b, dtype=torch.int64),
        torch.full((b,), num_generated, dtype=torch.int32),
    )


def test_greedy_accepts_the_matching_prefix() -> None:
    logits = torch.full((4, 4, 10), -1.0)
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    logits.scatter_(2, target[..., None], 1.0)
    draft = torch.tensor([[1, 2, 3], [1, 0, 3], [0, 6, 7], [9, 9, 9]])
    tokens, accepted = verify_greedy(logits, draft)
    assert accepted.tolist() == [3, 1, 0, 3]
    assert torch.equal(tokens, target)  # accepted drafts then the correction / bonus


def test_greedy_path_never_calls_softmax(monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("softmax called on the greedy path")

    monkeypatch.setattr(torch, "softmax", boom)
    monkeypatch.setattr(torch.nn.functional, "softmax", boom)
    monkeypatch.setattr(torch.Tensor, "softmax", boom)
    logits = torch.randn(6, 3, 50)
    draft = logits[:, :2].argmax(-1)
    temperature, top_p, top_k, seeds, ng = cols(6, temperature=0.0, top_p=0.5)
    top_k[3] = 1  # temperature > 0 with top_k == 1 is greedy too
    temperature[3] = 0.7
    tokens, accepted = verify(logits, draft, temperature, top_p, top_k, seeds, ng)
    assert accepted.tolist() == [2] * 6 and torch.equal(tokens, logits.argmax(-1))


def test_filtered_probs_is_the_plain_samplers_distribution() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=gen) * 2
    n = 40000
    for temperature, top_p, top_k in [(1.0, 1.0, 0), (0.7, 0.8, 0), (1.3, 1.0, 4), (1.0, 0.6, 5)]:
        probs = filtered_probs(
            logits,
            torch.full((3,), temperature),
            torch.full((3,), top_k, dtype=torch.int32),
            torch.full((3,), top_p),
        )
        for row in range(3):
            rows = logits[row].expand(n, -1)
            drawn = sample(rows, *cols(n, temperature, top_p, top_k)[:3], *cols(n)[3:])
            freq = torch.bincount(drawn, minlength=12).float() / n
            assert bool((freq[probs[row] == 0] == 0).all())
            torch.testing.assert_close(freq, probs[row], atol=0.012, rtol=0)


def chi2_critical_001(dof: int) -> float:
    """Upper 0.1% point of chi-square(dof), Wilson-Hilferty (accurate to ~1% for dof >= 3)."""
    z = 3.0902323061678132
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(observed: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom; cells with expected count < 5 are pooled; an
    observation in a zero-probability cell fails at once."""
    n = float(observed.sum())
    expected = expected_probs.double() * n
    assert int(observed[expected_probs == 0].sum()) == 0, "sampled a zero-probability token"
    small = expected < 5
    obs = torch.cat([observed[~small].double(), observed[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize(
    "temperature,top_p,top_k", [(1.0, 1.0, 0), (0.8, 0.9, 0), (1.5, 1.0, 5), (1.2, 0.85, 6)]
)
def test_speculative_sampling_matches_the_target_distribution(temperature, top_p, top_k) -> None:
    """Fixed target logits at 3 positions, fixed drafts (one likely, one unlikely token); over
    many seeds the first token is distributed as p_0 and, when d_1 was accepted, the second
    as p_1 (the target's distribution after d_1)."""
    vocab, n, k = 8, 30000, 2
    gen = torch.Generator().manual_seed(int(temperature * 10 + top_k))
    base = torch.randn(k + 1, vocab, generator=gen) * 1.5  # [k+1, V]
    logits = base.expand(n, -1, -1).contiguous()
    p = filtered_probs(
        base,
        torch.full((k + 1,), temperature),
        torch.full((k + 1,), top_k, dtype=torch.int32),
        torch.full((k + 1,), top_p),
    )
    d1 = int(p[0].argmax())  # accepted often
    d2 = int(p[1].argsort()[-3])  # the third most likely: rejected often (or filtered out)
    draft = torch.tensor([d1, d2]).expand(n, -1)
    tokens, accepted = verify_sampling(logits, draft, *cols(n, temperature, top_p, top_k))
    assert 0 < int((accepted == 0).sum()) < n and int((accepted == 2).sum()) > 0
    first = torch.bincount(tokens[:, 0], minlength=vocab)
    stat, dof = chi_square(first, p[0])
    assert stat < chi2_critical_001(dof), (stat, dof)
    second = torch.bincount(tokens[accepted >= 1, 1], minlength=vocab)
    stat, dof = chi_square(second, p[1])
    assert stat < chi2_critical_001(dof), (stat, dof)
    # accepted drafts are emitted as drafted
    assert bool((tokens[accepted >= 1, 0] == d1).all())


def test_rows_are_independent_of_the_batch_and_k0_is_the_plain_sampler() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(16, 4, 30, generator=gen)
    draft = torch.randint(30, (16, 3), generator=gen)
    temperature, top_p, top_k, seeds, ng = cols(16, 0.9, 0.95, 20, seed0=100, num_generated=5)
    full = verify_sampling(logits, draft, temperature, top_p, top_k, seeds, ng)
    order = torch.randperm(16, generator=gen)[:7]
    part = verify_sampling(
        logits[order],
        draft[order],
        temperature[order],
        top_p[order],
        top_k[order],
        seeds[order],
        ng[order],
    )
    a = full[1][order]
    assert torch.equal(part[1], a)
    mask = torch.arange(4)[None, :] <= a[:, None]
    assert torch.equal(part[0][mask], full[0][order][mask])
    # k = 0: the bonus is exactly the plain sampler's token at the same counter
    tokens, accepted = verify_sampling(
        logits[:, :1], draft[:, :0], temperature, top_p, top_k, seeds, ng
    )
    assert accepted.eq(0).all()
    assert torch.equal(tokens[:, 0], sample(logits[:, 0], temperature, top_p, top_k, seeds, ng))


def test_mixed_batch_routes_rows() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 3, 40, generator=gen)
    draft = logits[:, :2].argmax(-1)
    temperature, top_p, top_k, seeds, ng = cols(6, 1.0)
    temperature[::2] = 0.0
    tokens, accepted = verify(logits, draft, temperature, top_p, top_k, seeds, ng)
    greedy_tokens, greedy_acc = verify_greedy(logits[::2], draft[::2])
    assert torch.equal(accepted[::2], greedy_acc) and torch.equal(tokens[::2], greedy_tokens)
    sampled = verify_sampling(
        logits[1::2],
        draft[1::2],
        temperature[1::2],
        top_p[1::2],
        top_k[1::2],
        seeds[1::2],
        ng[1::2],
    )
    assert torch.equal(accepted[1::2], sampled[1])


def test_rows_with_fewer_drafts_emit_what_a_round_of_their_own_width_would() -> None:
    # num_drafts: row i carries n_i <= k drafts, then padding that must never be accepted (the
    # padding here equals the target's argmax, so a greedy row would otherwise accept it)
    gen = torch.Generator().manual_seed(3)
    b, k, vocab = 12, 5, 24
    logits = 4.0 * torch.randn(b, k + 1, vocab, generator=gen)  # peaked: drafts often accepted
    draft = logits[:, :k].argmax(-1)
    draft[::3, 2] = (draft[::3, 2] + 1) % vocab  # some rejections too
    n = torch.tensor([0, 1, 2, 3, 4, 5] * 2)
    temperature, top_p, top_k, seeds, ng = cols(b, 0.8, 0.9, 0, seed0=40, num_generated=3)
    temperature[6:] = 0.0  # the second half greedy
    tokens, accepted = verify(logits, draft, temperature, top_p, top_k, seeds, ng, n)
    assert bool((accepted <= n).all()) and bool((accepted == n).any())
    for i in range(b):
        m = int(n[i])
        one = (temperature[i : i + 1], top_p[i : i + 1], top_k[i : i + 1], seeds[i : i + 1],
               ng[i : i + 1])
        t, a = verify(logits[i : i + 1, : m + 1], draft[i : i + 1, :m], *one)
        assert int(accepted[i]) == int(a[0])
        assert tokens[i, : int(a[0]) + 1].tolist() == t[0, : int(a[0]) + 1].tolist()
