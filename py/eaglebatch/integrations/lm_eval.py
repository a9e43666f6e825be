"""lm-evaluation-harness on eaglebatch: `EaglebatchLM`, registered as lm-eval's model
"eaglebatch" when this module is imported (`pip install 'eaglebatch[eval]'`).

    from eaglebatch.integrations.lm_eval import EaglebatchLM
    lm_eval.simple_evaluate(model=EaglebatchLM(model="builtin:smollm2-135m-instruct"), ...)

lm-eval has no plugin entry point for models, so its command line reaches this one through
this module: `python -m eaglebatch.integrations.lm_eval --model eaglebatch --model_args
model=...,draft=... --tasks ...` (lm-eval's own arguments, unchanged).

- `loglikelihood`: `Engine.score` (lm-eval's context/continuation split, contexts shared by
  several continuations computed once); `loglikelihood_rolling`: `Engine.score_rolling`,
  windows of `max_length` = engine.max_model_len - 1 tokens (the HF model's with that
  `max_length`); `generate_until`: `Engine.generate`, requests grouped by their generation
  arguments, speculative decoding on when a draft is given (outputs unchanged).
docs/evaluation.md.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from eaglebatch.api.engine import Engine
from eaglebatch.errors import JobError

log = logging.getLogger(__name__)

# lm-eval's generation arguments eaglebatch's sampling section takes (same meaning)
_SAMPLING_KEYS = {"top_p": "top_p", "top_k": "top_k", "seed": "seed", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty"}  # fmt: skip


@register_model("eaglebatch")
class EaglebatchLM(LM):
    """An lm-eval model on an eaglebatch `Engine`. `model`, `draft`: as the job's keys;
    `engine`, `speculative`, `sampling`: the job's sections (a dict, or dotted keyword
    arguments such as `engine.kv_cache_tokens=4096` from lm-eval's `--model_args`);
    `add_bos_token`: encode prompts with the tokenizer's special tokens (default: the
    tokenizer's own rule, as lm-eval's HF model)."""

    def __init__(self, model: str, draft: str | None = None, engine: dict | None = None,
                 speculative: dict | None = None, sampling: dict | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool | None = None,
                 model_chat_template: str | None = None, **kwargs: Any) -> None:  # fmt: skip
        super().__init__()
        sections = {"engine": dict(engine or {}), "speculative": dict(speculative or {}),
                    "sampling": dict(sampling or {})}  # fmt: skip
        _dotted(sections, kwargs)
        self._sampling = sections["sampling"]
        self.max_gen_toks = int(max_gen_toks)
        self.add_special = True if add_bos_token is None else bool(add_bos_token)
        self.engine = Engine(model, draft, engine=sections["engine"],
                             speculative=sections["speculative"],
                             model_chat_template=model_chat_template)  # fmt: skip

    @property
    def max_length(self) -> int:
        """The longest model input of a scored window (one token less than the sequence)."""
        return self.engine.max_model_len - 1

    @property
    def tokenizer_name(self) -> str:
        return str(self.engine.model_dir).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.engine.chat_template or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:  # fmt: skip
        # lazy: the extension, loaded with the engine already
        from eaglebatch import _native

        if self.engine.chat_template is None:
            raise JobError("apply_chat_template: the model has no chat template; pass "
                           "model_chat_template=path/to/template.jinja")  # fmt: skip
        messages = [{"role": m["role"], "content": m["content"]} for m in chat_history]
        return _native.render_chat_template(self.engine.chat_template, messages,
                                            add_generation_prompt, self.engine.bos_token,
                                            self.engine.eos_token)  # fmt: skip

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        args = [r.args for r in requests]
        table = self.engine.score([a[0] for a in args], [a[1] for a in args],
                                  add_special_tokens=self.add_special)  # fmt: skip
        out = []
        for a, row in zip(args, table.to_pylist(), strict=True):
            _check(row, "loglikelihood")
            result = (row["logprob"], bool(row["is_greedy"]))
            self.cache_hook.add_partial("loglikelihood", a, result)
            out.append(result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [r.args[0] for r in requests]
        table = self.engine.score_rolling(texts, add_special_tokens=self.add_special)
        out = []
        for text, row in zip(texts, table.to_pylist(), strict=True):
            _check(row, "loglikelihood_rolling")
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), row["logprob"])
            out.append(row["logprob"])
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their generation arguments, each group one Engine call."""
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str] = [""] * len(requests)
        for members in groups.values():
            gen_kwargs = requests[members[0]].args[1]
            contexts = [requests[i].args[0] for i in members]
            texts = self._generate(contexts, gen_kwargs)
            for i, text in zip(members, texts, strict=True):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        """One Engine call per kind of context: those that start with the BOS text (a chat
        template's) are encoded without special tokens, as lm-eval's hf model does."""
        sampling, bos = self.sampling_of(gen_kwargs), self.engine.bos_token
        has_bos = [bool(bos) and c.startswith(bos) for c in contexts]
        texts = [""] * len(contexts)
        for flag in (False, True):
            members = [i for i, h in enumerate(has_bos) if h == flag]
            if not members:
                continue
            keys = {"add_special_tokens": self.add_special and not flag}
            table = self.engine.generate([contexts[i] for i in members], sampling=sampling,
                                         input=keys)  # fmt: skip
            rows = table.select(["output_text", "error"]).to_pylist()
            for i, row in zip(members, rows, strict=True):
                if row["error"] is not None:
                    log.warning("generate_until: a request failed: %s", row["error"])
                texts[i] = row["output_text"] or ""
        return texts

    def sampling_of(self, gen_kwargs: dict) -> dict:
        """The job's sampling section for lm-eval's generation arguments: `until` as stop
        strings (the EOS token stops anyway), `max_gen_toks`, greedy unless `do_sample`."""
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
        sampling = {**self._sampling, "max_new_tokens": int(kwargs.pop("max_gen_toks")),
                    "stop": [s for s in until if s]}  # fmt: skip
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        sampling["temperature"] = temperature if kwargs.pop("do_sample", False) else 0.0
        for key, ours in _SAMPLING_KEYS.items():
            if key in kwargs:
                sampling[ours] = kwargs.pop(key)
        return sampling


def _dotted(sections: dict[str, dict], kwargs: dict[str, Any]) -> None:
    """lm-eval's --model_args keys: `section.key=value` into the sections; `device` and
    `batch_size` / `max_batch_size` (lm-eval's own) into the engine section."""
    for key, value in kwargs.items():
        section, _, name = key.partition(".")
        if name and section in sections:
            sections[section][name] = value
        elif key == "device" and value is not None:
            sections["engine"].setdefault("device", str(value).split(":")[0])
        elif key in ("batch_size", "max_batch_size") and isinstance(value, int):
            sections["engine"].setdefault("max_batch_size", value)
        elif key not in ("batch_size", "max_batch_size", "device"):
            raise JobError(f"EaglebatchLM: unknown argument {key!r} (job sections are spelt "
                           "engine.KEY, speculative.KEY, sampling.KEY)")  # fmt: skip


def _check(row: dict, what: str) -> None:
    if row["error"] is not None:
        raise JobError(f"{what}: a request failed: {row['error']}")


if __name__ == "__main__":
    # lazy: lm-eval's command line, only when this module runs as a program
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
