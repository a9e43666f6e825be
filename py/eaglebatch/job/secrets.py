"""Credentials a job's `storage` section may carry, kept out of every record of the job.

A job may hold credentials in two places: `storage.options` (the crate's keys, e.g.
`aws_secret_access_key`) and the user information of `storage.endpoint`
(`http://KEY:SECRET@host`). The job's record (part footers, bench reports) shows every option
value as `***` and the endpoint without its user information; the resume identity leaves the
storage section out altogether (where the data lives and how it is reached decides no output),
so a rerun resumes whatever credentials it is given. The Rust side redacts the same values from
its messages (rust/src/storage.rs `secrets`); which option names are credentials' is its rule
alone (`is_secret_name`), used here through the extension.
"""

from __future__ import annotations

import re

MASK = "***"


def _split_userinfo(endpoint: str) -> tuple[str, str | None, str]:
    """(what precedes the user information, the user information or None, the rest)."""
    scheme, sep, rest = endpoint.partition("://")
    head = f"{scheme}{sep}" if sep else ""
    rest = rest if sep else endpoint
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" not in authority:
        return head, None, rest
    userinfo, _ = authority.rsplit("@", 1)
    return head, userinfo, rest[len(userinfo) + 1:]


def endpoint_has_credentials(endpoint: str | None) -> bool:
    return endpoint is not None and _split_userinfo(endpoint)[1] is not None


def masked_endpoint(endpoint: str | None) -> str | None:
    """`endpoint` with its user information, if any, as `***` (`http://***@host:9000`)."""
    if not endpoint_has_credentials(endpoint):
        return endpoint
    head, _, rest = _split_userinfo(endpoint)
    return f"{head}{MASK}@{rest}"


def is_secret_option(key: str) -> bool:
    """Whether `storage.options` key `key` names a credential (access key, secret, token...):
    the rule the Rust side redacts its messages by."""
    # lazy: the extension, only where option names are judged (job records mask every value)
    from eaglebatch._native import is_secret_name

    return is_secret_name(key)


def masked_storage(storage: dict) -> dict:
    """The storage section (as JSON values) as every record of the job shows it: each option
    value `***`, the endpoint without credentials."""
    return {**storage, "endpoint": masked_endpoint(storage.get("endpoint")),
            "options": {k: MASK for k in storage.get("options") or {}}}  # fmt: skip
