"""The output directory on an object store: directory.py's rules without flock or rename.

- exclusivity: a lease object per directory a run owns (storage/lease.py): a run over every
  row holds output.path's, a shard its own directory's. A run over every row refuses while a
  shard's lease is live, a shard while output.path's is: each takes its own lease first, then
  looks for the other's, so of two racing runs at least one sees the other (the store is
  strongly consistent: S3, GCS and Azure are);
- the store must refuse a create-only write of an existing name (probed once per run), unless
  the job set `storage.unsafe_no_conditional_writes`;
- parts are written whole under their final names by the Rust writer (no temporary objects
  to clean); `--restart` deletes only parts whose footer carries this job's marker.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from eaglebatch.errors import JobError
from eaglebatch.storage.lease import LEASE_NAME, Lease, LeaseHeld, live_holder
from eaglebatch.storage.paths import RemotePath, checked

_held: dict[str, Lease] = {}  # directory URL -> this process's lease on it


def check_conditional_writes(own: RemotePath, unsafe: bool) -> None:
    """Refuses (JobError) a store that overwrites on a create-only write, unless `unsafe`."""
    if unsafe:
        return
    probe = own / f".eaglebatch.probe-{uuid.uuid4().hex}"
    try:
        checked(probe.store.put, probe.url, b"probe", "create")
        checked(probe.store.put, probe.url, b"probe", "create")
        honoured = False  # the second create overwrote the first
    except FileExistsError:
        honoured = True
    except NotImplementedError:  # e.g. S3 with `aws_conditional_put: disabled`
        honoured = False
    finally:
        try:
            probe.unlink(missing_ok=True)
        except Exception:  # noqa: BLE001 - a hidden leftover is harmless (scans skip '.x')
            pass
    if not honoured:
        raise _no_create_only(own)


def _no_create_only(own: RemotePath) -> JobError:
    return JobError(
        f"output.path: {own} is on a store that does not refuse create-only writes of an "
        f"existing name, which exactly-once needs (docs/scale-out.md, Object storage); "
        f"set storage.unsafe_no_conditional_writes: true to run without that guarantee"
    )


def _take(d: RemotePath, job_storage) -> None:
    try:
        _held[d.url] = Lease.acquire(d / LEASE_NAME, job_storage.lease_ttl_s,
                                     job_storage.unsafe_no_conditional_writes)  # fmt: skip
    except NotImplementedError:  # no create-only PUT at all (S3 with conditional puts off)
        raise _no_create_only(d) from None


def _others_live(path: RemotePath, subdir: str | None, dirs: list[RemotePath]) -> str | None:
    """A live lease this run must not run beside: a shard's (a run over every row), or
    output.path's (a shard). `dirs`: the shard and unit directories under output.path."""
    if subdir is not None:
        why = live_holder(path / LEASE_NAME)
        return None if why is None else f"{path} is in use by a run over every row ({why})"
    for d in dirs:
        if why := live_holder(d / LEASE_NAME):
            return f"{d} is in use by another run ({why})"
    return None


def prepare_remote(
    path: RemotePath, restart: bool, subdir: str | None, admit: Callable[[], None] | None,
    job_storage, scan: Callable[[], dict], unit: bool = False,
) -> None:  # fmt: skip
    """directory.prepare_output_dir for an object store (module doc). `scan`: the checked tree
    (directory -> DirContents, output.path first; a Ray `unit`: its own directory, which its
    driver created and whose output.path lease the driver holds). Raises LeaseHeld while
    another run holds what this one needs."""
    own = path if subdir is None else path / subdir
    if unit and not own.is_dir():
        raise JobError(f"output.path: {own} does not exist: a Ray unit runs only in a "
                       f"directory its driver created")  # fmt: skip
    _take(own, job_storage)  # first: the lease object makes `own` exist while this run lasts
    try:
        check_conditional_writes(own, job_storage.unsafe_no_conditional_writes)
        if admit is not None:
            admit()
        tree = scan()
        why = None if unit else _others_live(path, subdir, [d for d in tree if d != path])
        if why is not None:
            raise LeaseHeld(why)
        if restart:
            for d in list(tree) if own == path else [own]:
                for part in tree[d].ours if d in tree else ():
                    part.unlink(missing_ok=True)
    except BaseException:
        release_remote(path, subdir)
        raise
def release_remote(path: RemotePath, subdir: str | None = None) -> None:
    """Releases the leases this process holds on `path` (and its subdirectories)."""
    top = path.url
    for url in [u for u in _held if u == top or u.startswith(top + "/")]:
        if subdir is None or url == f"{top}/{subdir}":
            _held.pop(url).release()


def lease_lost(path: RemotePath) -> str | None:
    """Why a lease this process holds under `path` was lost (None: all held)."""
    return next((lease.lost for u, lease in _held.items()
                 if u.startswith(path.url) and lease.lost), None)  # fmt: skip
