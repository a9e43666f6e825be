"""The user-facing error type, shared by every module that checks a job, and how a value is
echoed in its messages."""

from __future__ import annotations

import reprlib
from typing import Any

_ECHO_CHARS = 100  # the most characters of a value echoed in an error message


class JobError(Exception):
    """A problem in the job the user can fix. The CLI prints it and exits with status 2."""


class StorageFailed(Exception):
    """An object-store request failed for good (403, a missing bucket, out of retries). The CLI
    prints it (it names the URL, never a credential) and exits with status 1."""


def native_error(e: BaseException) -> str | None:
    """"user" for the extension's UserInputError (the user can fix it: exit 2), "native" for its
    other errors (NativeError), None for anything else. The one place that tells them apart."""
    try:
        # lazy: every module imports errors.py; the extension only when mapping its error
        from eaglebatch import _native
    except ImportError:  # no extension: nothing it raised
        return None
    if isinstance(e, _native.UserInputError):
        return "user"
    return "native" if isinstance(e, _native.NativeError) else None


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 2, 4, 6, 6
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = _ECHO_CHARS, _ECHO_CHARS, 40


def echo(value: Any) -> str:
    """A value for an error message: its repr, cut to about _ECHO_CHARS characters with a
    marker saying so (a job's values can be huge)."""
    if isinstance(value, str) and len(value) > _ECHO_CHARS:
        return f"{value[:_ECHO_CHARS]!r}... (cut: {len(value):,} characters in all)"
    try:
        text = _REPR.repr(value)
    except Exception:  # a repr that fails must not hide the message
        text = f"<{type(value).__name__}>"
    if len(text) > _ECHO_CHARS:
        text = f"{text[:_ECHO_CHARS]}... (cut at {_ECHO_CHARS} characters)"
    return text
