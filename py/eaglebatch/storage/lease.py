"""A run's lease on an object-store directory: the object-store stand-in for flock.

Protocol (docs/scale-out.md "Object storage"):
- the lease is the object `<dir>/.eaglebatch.lease`, a small JSON record naming its holder
  (host, pid, a random id) and when it expires (`expires_at`, the holder's clock + ttl);
- taking it is a create-only PUT; a lease that exists is taken over only when it is expired,
  released, or held by a process of this host that no longer runs, and then by a
  compare-and-swap on the version read (two runs racing for it: one wins, the other is refused);
- the holder renews it every ttl / 3 by compare-and-swap; a renewal that loses means another
  run took it over: `lost` is set and reported (the part names still fence the two writers:
  rust/src/writer/remote_parts.rs);
- releasing writes `released: true` by compare-and-swap (no delete: some stores' emulators
  lack it, and a release must not remove another holder's lease).
Expiry compares the holder's clock with the reader's: hosts sharing an output need clocks
within a small part of the ttl (NTP).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid

from eaglebatch.storage.paths import RemotePath, checked

LEASE_NAME = ".eaglebatch.lease"


class LeaseHeld(Exception):
    """Another live run holds the lease; the message names it."""


def _record(ttl: float, holder: str, released: bool = False) -> bytes:
    return json.dumps({
        "holder": holder, "host": socket.gethostname(), "pid": os.getpid(),
        "ttl_s": ttl, "expires_at": time.time() + ttl, "released": released,
    }).encode()  # fmt: skip


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OSError):
        return False
    return False


def describe(held: dict) -> str | None:
    """Why the lease record `held` still excludes others, or None when it may be taken over."""
    if held.get("released"):
        return None
    left = float(held.get("expires_at", 0)) - time.time()
    same_host = held.get("host") == socket.gethostname()
    if left <= 0 or (same_host and _pid_gone(int(held.get("pid", 0)))):
        return None
    return (f"held by process {held.get('pid')} on {held.get('host')}, renewed until "
            f"{left:.0f} s from now")  # fmt: skip


class Lease:
    def __init__(self, obj: RemotePath, ttl: float, unconditional: bool):
        self.obj, self.ttl, self.unconditional = obj, ttl, unconditional
        self.holder = uuid.uuid4().hex
        self.version: tuple = (None, None)  # (e_tag, version) of our last write
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, obj: RemotePath, ttl: float, unconditional: bool) -> Lease:
        """Takes the lease or raises LeaseHeld; starts renewing it."""
        lease = cls(obj, ttl, unconditional)
        lease._take()
        lease._thread = threading.Thread(target=lease._renew, daemon=True,
                                         name="eaglebatch-lease")  # fmt: skip
        lease._thread.start()
        return lease

    def _put(self, mode: str, body: bytes, version: tuple = (None, None)) -> None:
        if self.unconditional:
            mode, version = "overwrite", (None, None)
        self.version = checked(self.obj.store.put, self.obj.url, body, mode, *version)

    def _take(self) -> None:
        from eaglebatch._native import StorageConflict  # lazy: only remote runs take leases

        body = _record(self.ttl, self.holder)
        try:
            if self.unconditional:
                raise FileExistsError  # read first: the store would not refuse
            self._put("create", body)
            return
        except FileExistsError:
            pass
        try:
            data, e_tag, version = checked(self.obj.store.get, self.obj.url)
        except FileNotFoundError:  # released and gone meanwhile
            return self._put("create", body)
        why = describe(json.loads(data or b"{}"))
        if why is not None:
            raise LeaseHeld(f"{self.obj.parent}: another eaglebatch run is writing it ({why})")
        try:
            self._put("replace", body, (e_tag, version))
        except (StorageConflict, FileNotFoundError):
            raise LeaseHeld(f"{self.obj.parent}: another eaglebatch run took it over just "
                            f"now") from None  # fmt: skip

    def _renew(self) -> None:
        from eaglebatch._native import StorageConflict  # lazy: as in _take

        while not self._stop.wait(self.ttl / 3):
            try:
                self._put("replace", _record(self.ttl, self.holder), self.version)
            except StorageConflict:
                self.lost = f"{self.obj}: this run's lease was taken over by another run"
                print(f"eaglebatch: warning: {self.lost}; a part it writes now fails rather "
                      f"than duplicate rows", file=sys.stderr)  # fmt: skip
                return
            except Exception as e:  # noqa: BLE001 - beyond the retries: try again next period
                print(f"eaglebatch: warning: cannot renew {self.obj}: {e}", file=sys.stderr)

    def release(self) -> None:
        """Stops renewing and marks the lease released (best effort: it expires anyway)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)  # a renewal retrying a slow store: it expires anyway
            if self._thread.is_alive():
                return
        if self.lost is None:
            try:
                self._put("replace", _record(0, self.holder, released=True), self.version)
            except Exception:  # noqa: BLE001 - expiry frees it in any case
                pass


def live_holder(obj: RemotePath) -> str | None:
    """Why the lease object `obj` excludes others now (None: absent, released or expired)."""
    try:
        data = checked(obj.store.get, obj.url)[0]
    except FileNotFoundError:
        return None
    return describe(json.loads(data or b"{}"))
