"""Sampling: greedy, filters, reproducibility and the sampled distribution."""

from __future__ import annotations

import torch

from eaglebatch.sampling.sampler import argmax, sample, uniform_from_counter


def call(logits, temperature=1.0, top_p=1.0, top_k=0, seeds=None, num_generated=None):
    b = logits.shape[0]

    def col(x, dtype):
        return x if isinstance(x, torch.Tensor) else torch.full((b,), x, dtype=dtype)

    return sample(
        logits,
        col(temperature, torch.float32),
        col(top_p, torch.float32),
        col(top_k, torch.int32),
        torch.arange(b, dtype=torch.int64) if seeds is None else seeds,
        torch.zeros(b, dtype=torch.int32) if num_generated is None else num_generated,
    )


def test_argmax_is_torchs_with_ties_nans_and_strides() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (3, 4, 300), generator=gen).float()  # many tied maxima
    x[1, 2, 7] = float("nan")
    x[2, 0, 299] = float("inf")
    for t in (x, x[:, 1], x[0, 0], x.transpose(0, 1), x[..., ::3]):
        got = argmax(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(-1))
    assert torch.equal(argmax(x.double()), x.argmax(-1))  # other dtypes: torch's own


def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 1000)
    assert torch.equal(call(logits, temperature=0.0), logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch() -> None:
    logits = torch.randn(8, 500)
    temperature = torch.tensor([0.0, 1.0] * 4)
    out = call(logits, temperature=temperature, top_p=0.9)
    assert torch.equal(out[::2], logits[::2].argmax(-1))


def test_rows_told_by_host_arrays_sample_as_by_the_tensors() -> None:
    """`host` (a plan's arrays) only decides which rows sample where: the same tokens."""
    torch.manual_seed(1)
    logits = torch.randn(6, 400)
    temperature = torch.tensor([0.0, 0.9, 1.2, 0.0, 0.7, 1.0])
    top_p = torch.tensor([1.0, 1.0, 0.8, 1.0, 1.0, 0.9])
    top_k = torch.tensor([0, 0, 0, 5, 1, 30], dtype=torch.int32)
    seeds, counters = torch.arange(6) * 977, torch.arange(6, dtype=torch.int32)
    args = (logits, temperature, top_p, top_k, seeds, counters)
    host = tuple(t.numpy() for t in (temperature, top_p, top_k))
    assert torch.equal(sample(*args, host=host), sample(*args))
    assert torch.equal(sample(*args)[[0, 3, 4]], logits[[0, 3, 4]].argmax(-1))


def test_top_k_one_is_argmax() -> None:
    logits = torch.randn(16, 1000)
    assert torch.equal(call(logits, temperature=1.5, top_k=1), logits.argmax(-1))


def test_same_seed_and_counter_same_token_regardless_of_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(12, 300)
    seeds = torch.randint(0, 2**62, (12,))
    counters = torch.randint(0, 100, (12,), dtype=torch.int32)
    for kwargs in ({}, {"top_p": 0.8}, {"top_k": 20}, {"top_k": 20, "top_p": 0.5}):
        full = call(logits, seeds=seeds, num_generated=counters, **kwargs)
        perm = torch.randperm(12)
        shuffled = call(logits[perm], seeds=seeds[perm], num_generated=counters[perm], **kwargs)
        assert torch.equal(shuffled, full[perm])
        alone = [
            int(
                call(
                    logits[i : i + 1],
                    seeds=seeds[i : i + 1],
                    num_generated=counters[i : i + 1],
                    **kwargs,
                )
            )
            for i in range(3)
        ]
        assert alone == full[:3].tolist()


def test_counter_changes_the_draw() -> None:
    logits = torch.zeros(1, 1000)  # uniform
    seeds = torch.tensor([42])
    draws = {int(call(logits, seeds=seeds, num_generated=torch.tensor([n]))) for n in range(50)}
    assert len(draws) > 40


def test_uniform_from_counter_matches_python_splitmix() -> None:
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    seeds = [0, 1, 2**63 - 1, -5, 123456789]
    counters = [0, 7, 1 << 30, 3, 99]
    got = uniform_from_counter(torch.tensor(seeds), torch.tensor(counters, dtype=torch.int32))
    for i, (s, c) in enumerate(zip(seeds, counters, strict=True)):
        h = mix((mix(s & mask) + c) & mask)
        assert got[i].item() == (h >> 11) / 2**53
    assert ((got >= 0) & (got < 1)).all()


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log().repeat(400, 1)
    out = call(logits, top_p=0.75, seeds=torch.arange(400))
    assert set(out.tolist()) == {0, 1}  # 0.5 < 0.75, 0.5 + 0.3 >= 0.75
    out = call(logits, top_p=0.85, seeds=torch.arange(400))
    assert set(out.tolist()) == {0, 1, 2}


def test_top_k_then_top_p() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().repeat(400, 1)
    out = call(logits, top_k=3, seeds=torch.arange(400))
    assert set(out.tolist()) == {0, 1, 2}
    # renormalised top-2: 0.4/0.7 = 0.57 >= 0.5, so only token 0 survives top_p = 0.5
    out = call(logits, top_k=2, top_p=0.5, seeds=torch.arange(400))
    assert set(out.tolist()) == {0}


def test_top_p_on_a_flat_distribution_needs_more_candidates() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 5000) * 0.1  # near uniform: the top 256 hold ~5% of the mass
    out = call(logits, top_p=0.5, seeds=torch.arange(4))
    order = logits.argsort(dim=-1, descending=True)
    rank = (order == out[:, None]).float().argmax(-1)
    assert (rank < 2600).all()  # inside the nucleus (~half the vocabulary)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_one_matches_softmax() -> None:
    # 6 categories -> 5 degrees of freedom; P(chi2 > 20.52) = 0.001.
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n = 20000
    out = call(logits.repeat(n, 1), seeds=torch.arange(n) * 7919 + 13)
    counts = torch.bincount(out, minlength=6).double()
    assert chi_square(counts, torch.softmax(logits.double(), -1)) < 20.52


def test_temperature_and_top_k_distribution() -> None:
    # temperature 2 and top_k 4: renormalised softmax(logits / 2) over the top 4 (3 dof,
    # P(chi2 > 16.27) = 0.001); varying the counter instead of the seed.
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0, -1.0, 2.5])
    n = 20000
    out = call(
        logits.repeat(n, 1),
        temperature=2.0,
        top_k=4,
        seeds=torch.full((n,), 5),
        num_generated=torch.arange(n, dtype=torch.int32),
    )
    counts = torch.bincount(out, minlength=6).double()
    kept = torch.tensor([0, 5, 2, 1])  # the 4 largest logits
    assert counts.sum() == counts[kept].sum()
    probs = torch.softmax(logits[kept].double() / 2.0, -1)
    assert chi_square(counts[kept], probs) < 16.27
