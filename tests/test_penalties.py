"""sampling.repetition_penalty / frequency_penalty / presence_penalty / min_new_tokens end to
end: against transformers' generate where it has the processor (repetition, min new tokens),
against a greedy loop over transformers' logits applying vLLM's definition (frequency,
presence), and greedy speculative decoding equals plain decoding with all of them on."""

from __future__ import annotations

import pytest
import torch

from eaglebatch.speculative import init_random_draft
from support.tiny import byte_tokenizer
from test_runner import EOS, MAX_NEW, hf_model, random_prompts, run_job  # noqa: F401 (fixture)

pytest.importorskip("eaglebatch._native")


def hf_generate(model, prompt: str, **kwargs) -> list[int]:
    ids = byte_tokenizer().encode(prompt).ids
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS, pad_token_id=EOS,
            **kwargs,
        )  # fmt: skip
    new = out[0, len(ids) :].tolist()
    return new[: new.index(EOS) + 1] if EOS in new else new


def hf_penalised_greedy(model, prompt: str, freq: float, pres: float) -> list[int]:
    """Greedy decoding with vLLM's frequency / presence penalties over the output tokens."""
    ids = byte_tokenizer().encode(prompt).ids
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < MAX_NEW:
            logits = model(torch.tensor([ids + out])).logits[0, -1].double()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                    minlength=logits.shape[0]).double()  # fmt: skip
            logits = logits - freq * counts - pres * (counts > 0).double()
            out.append(int(logits.argmax()))
            if out[-1] == EOS:
                break
    return out


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(10, seed=21)


def tokens(tmp, model, prompts, name, overrides):
    table, res = run_job(tmp, model, prompts, overrides=overrides, name=name)
    return table.column("output_token_ids").to_pylist(), res


def test_repetition_penalty_equals_transformers(tmp_path, tiny_model_dir, prompts,
                                                hf_model):  # noqa: F811
    for r in (1.5, 0.7):
        got, _ = tokens(tmp_path, tiny_model_dir, prompts, f"rep{r}",
                        [f"sampling.repetition_penalty={r}"])  # fmt: skip
        want = [hf_generate(hf_model, p, repetition_penalty=r) for p in prompts]
        assert got == want
    plain, _ = tokens(tmp_path, tiny_model_dir, prompts, "plain", [])
    assert plain != got  # the penalty changes outputs


def test_min_new_tokens_equals_transformers(tmp_path, tiny_model_dir, prompts,
                                            hf_model):  # noqa: F811
    plain, _ = tokens(tmp_path, tiny_model_dir, prompts, "plain", [])
    early = [t for t in plain if t[-1] == EOS and len(t) < 12]
    assert early, "some row must stop on EOS early for the test to mean anything"
    got, _ = tokens(tmp_path, tiny_model_dir, prompts, "min", ["sampling.min_new_tokens=12"])
    assert got == [hf_generate(hf_model, p, min_new_tokens=12) for p in prompts]
    assert all(len(t) >= 12 for t in got)


def test_frequency_and_presence_penalties_equal_the_definition(tmp_path, tiny_model_dir,
                                                               prompts, hf_model):  # noqa: F811
    for freq, pres in ((0.8, 0.0), (0.0, 1.2), (-0.5, 0.6)):
        got, _ = tokens(tmp_path, tiny_model_dir, prompts, f"fp{freq}_{pres}",
                        [f"sampling.frequency_penalty={freq}",
                         f"sampling.presence_penalty={pres}"])  # fmt: skip
        assert got == [hf_penalised_greedy(hf_model, p, freq, pres) for p in prompts]


PENALTIES = {
    "mild": ["sampling.repetition_penalty=0.8", "sampling.frequency_penalty=-0.3",
             "sampling.presence_penalty=0.2", "sampling.min_new_tokens=6"],
    "strong": ["sampling.frequency_penalty=-1.5", "sampling.presence_penalty=0.5"],
}  # fmt: skip


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("penalties", sorted(PENALTIES))
def test_greedy_speculative_equals_plain_with_penalties(tmp_path, tiny_model_dir, prompts,
                                                        batch, penalties):
    """Penalties that favour repeats make prompt lookup accept drafts, so positions after
    accepted drafts are exercised (and a verify that ignored the drafts before a position
    would differ from plain decoding)."""
    over = [*PENALTIES[penalties], f"engine.max_batch_size={batch}"]
    plain, _ = tokens(tmp_path, tiny_model_dir, prompts, "plain", over)
    head = init_random_draft(tmp_path / "head", tiny_model_dir, kind="eagle3", seed=2,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    spec_over = [*over, f"draft={head}", "speculative.adaptive=false",
                 "speculative.prompt_lookup_min=1", "speculative.num_steps=4"]  # fmt: skip
    spec, res = tokens(tmp_path, tiny_model_dir, prompts, "spec", spec_over)
    assert spec == plain
    assert res.stats["accepted_tokens"] >= 10, res.stats
