"""The checks of a job against its model's files that load no model: the chat template the
prompts go through (the job's file or the model's), sampling.response_format against the
tokenizer, output.reasoning's tags. `prepare` (prepare.py) runs them before any work; each
failure is a JobError naming the key or file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from eaglebatch.errors import JobError
from eaglebatch.job.config import JobConfig
from eaglebatch.job.model_files import ModelFiles


def read_chat_template(path: str) -> str:
    """The text of the job's model_chat_template file (JobError naming it when unreadable or
    empty)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        raise JobError(f"model_chat_template: cannot read {path}: {e}") from None
    if not text.strip():
        raise JobError(f"model_chat_template: {path} is empty")
    return text


def with_chat_template(mf: ModelFiles, path: str | None) -> ModelFiles:
    """The model's files with the job's chat template file, if it names one."""
    if path is None:
        return mf
    return dataclasses.replace(mf, chat_template=read_chat_template(path))


def renders_chat(job: JobConfig, batch_chat: bool) -> bool:
    """Whether the job's prompts (some of them, with batch input) go through the chat
    template (so it must compile)."""
    return job.input.renders_chat or batch_chat


def check_chat_template(text: str, origin: str) -> None:
    """Raises JobError naming `origin` (the job key and file, or the model's template) when the
    chat template does not compile: the check the reader's compile makes, before any model."""
    # lazy: the extension, loaded only when a template is checked
    from eaglebatch import _native

    try:
        _native.check_chat_template(text)
    except ValueError as e:
        raise JobError(f"{origin}: the chat template does not compile: {e}") from None


def check_response_format(job: JobConfig, mf: ModelFiles, vocab_size: int) -> None:
    """Raises JobError when the job's sampling.response_format does not compile for the model's
    tokenizer: before any model loads (a row's own format is that row's error instead)."""
    if job.sampling.response_format is None:
        return
    # lazy: the extension, loaded only when a job constrains its outputs
    from eaglebatch import _native

    try:
        _native.check_response_format(
            job.sampling.response_format, str(mf.tokenizer_file), vocab_size,
            list(mf.eos_token_ids),
        )  # fmt: skip
    except _native.UserInputError as e:
        raise JobError(str(e)) from None


def reasoning_ids(job: JobConfig, mf: ModelFiles) -> tuple[int, ...]:
    """output.reasoning's tag ids (start, end): each tag must be one token of the model's
    tokenizer (the scheduler watches for the end tag's id); () when reasoning is off."""
    if job.output.reasoning is None:
        return ()
    # lazy: the tokenizers library, loaded only for reasoning jobs
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(mf.tokenizer_file))
    ids = []
    for tag in job.output.reasoning_tags:
        got = tok.encode(tag, add_special_tokens=False).ids
        if len(got) != 1:
            raise JobError(f"output.reasoning_tags: {tag!r} is {len(got)} tokens of the model's "
                           "tokenizer; each tag must be one token (a reasoning model's own)")
        ids.append(got[0])
    return tuple(ids)


def template_origin(job: JobConfig, mf: ModelFiles) -> str:
    """Where the job's chat template comes from, for messages."""
    if job.model_chat_template is not None:
        return f"model_chat_template: {job.model_chat_template}"
    return f"model: {mf.dir}'s chat template"
