"""`RemotePath`: an object-store "directory" or object in the shape of `pathlib.Path`.

Object stores have objects and key prefixes, not directories: a RemotePath is a directory when
some object's key continues it with `/`, and it exists when it is an object or a directory.
Creating a directory writes a hidden marker object under it (a prefix exists once an object is
written under it); removing one does nothing. Renames, symlinks and locks do not exist
(output/remote_dir.py keeps its runs apart with a lease object instead).

A listing is one request per call (`iterdir`, `is_dir`); objects listed carry their size, so
`stat()` of a listed object asks nothing more.
"""

from __future__ import annotations

import fnmatch
import functools
import io
import os
from types import SimpleNamespace

from eaglebatch.errors import StorageFailed
from eaglebatch.storage.remote_file import RemoteFile

SCHEMES = ("s3://", "gs://", "az://", "abfs://", "abfss://")
DIR_MARKER = ".eaglebatch.dir"  # RemotePath.mkdir


def is_remote(path) -> bool:
    return isinstance(path, RemotePath) or str(path).startswith(SCHEMES)


_SETTINGS: dict[int, tuple] = {}  # id(native store) -> its _store arguments (pickling)


@functools.lru_cache(maxsize=8)
def _store(endpoint, options: tuple, unconditional: bool):
    from eaglebatch import _native  # lazy: validate and status need it only for remote paths

    store = _native.ObjectStore(endpoint, dict(options), unconditional)
    _SETTINGS[id(store)] = (endpoint, options, unconditional)
    return store


def _rebuild(url: str, settings: tuple, size, is_object, e_tag, listed_dir) -> RemotePath:
    path = RemotePath(url, _store(*settings), size, is_object, e_tag)
    path._listed_dir = listed_dir
    return path


def store_for(storage):
    """The native store for the job's `storage` section (None: the defaults)."""
    if storage is None:
        return _store(None, (), False)
    return _store(storage.endpoint, tuple(sorted(storage.options.items())),
                  storage.unsafe_no_conditional_writes)  # fmt: skip


def checked(fn, *args):
    """A store call whose permanent failures (denied, missing bucket, out of retries) become
    StorageFailed; not found and name-taken stay FileNotFoundError / FileExistsError."""
    try:
        return fn(*args)
    except (FileNotFoundError, FileExistsError):
        raise
    except OSError as e:
        raise StorageFailed(str(e)) from None


class RemotePath:
    """An object-store URL (`scheme://bucket/key`), without a trailing slash."""

    def __init__(self, url: str, store, size: int | None = None, is_object: bool | None = None,
                 e_tag: str | None = None):  # fmt: skip
        scheme, rest = url.split("://", 1)
        self.url = f"{scheme}://{rest.rstrip('/')}"
        self.store = store
        self._size = size
        self._is_object = is_object
        self.e_tag = e_tag  # of a listed object
        self._listed_dir = False  # seen as a directory by the listing that made it

    def __reduce__(self):
        """Pickled (a Ray actor's job) with its store's settings, not the native store."""
        settings = _SETTINGS[id(self.store)]
        return _rebuild, (self.url, settings, self._size, self._is_object, self.e_tag,
                          self._listed_dir)  # fmt: skip

    # naming
    @property
    def name(self) -> str:
        rest = self.url.split("://", 1)[1]
        return rest.rsplit("/", 1)[-1] if "/" in rest else ""

    @property
    def parent(self) -> RemotePath:
        head = self.url.rsplit("/", 1)[0]
        return RemotePath(head, self.store) if "://" in head and head != self.url else self

    @property
    def suffix(self) -> str:
        return os.path.splitext(self.name)[1]

    def __truediv__(self, other: str) -> RemotePath:
        return RemotePath(f"{self.url}/{str(other).strip('/')}", self.store)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __lt__(self, other) -> bool:
        return self.url < other.url

    def __hash__(self) -> int:
        return hash(self.url)

    def match(self, pattern: str) -> bool:
        return fnmatch.fnmatchcase(self.name, pattern)

    def resolve(self) -> RemotePath:
        return self

    def expanduser(self) -> RemotePath:
        return self

    @property
    def parents(self) -> list[RemotePath]:
        out, p = [], self
        while (q := p.parent) != p:
            out.append(q)
            p = q
        return out

    # listing
    def walk_objects(self) -> list[RemotePath]:
        """Every object under this directory, at any depth, sorted."""
        entries = checked(self.store.list, self.url + "/")
        return [RemotePath(u, self.store, size, True, tag) for u, size, tag, _ in entries]

    def iterdir(self) -> list[RemotePath]:
        """The objects and directories directly under this one, sorted."""
        children: dict[str, RemotePath] = {}
        prefix = self.url + "/"
        for obj in self.walk_objects():
            rest = obj.url[len(prefix):]
            head = rest.split("/", 1)[0]
            if "/" in rest and head not in children:
                children[head] = RemotePath(prefix + head, self.store, None, False)
                children[head]._listed_dir = True
            elif "/" not in rest:
                children[head] = obj
        return [children[k] for k in sorted(children)]

    def glob(self, pattern: str) -> list[RemotePath]:
        return [c for c in self.iterdir() if c.match(pattern)]

    # kinds
    def is_file(self) -> bool:
        if self._is_object is None:
            try:
                self._size = checked(self.store.head, self.url)[1]
                self._is_object = True
            except FileNotFoundError:
                self._is_object = False
        return self._is_object

    def is_dir(self) -> bool:
        """Whether objects lie under this prefix (as of the listing that found it, if one
        did: a directory seen by a scan stays one for that scan)."""
        if self._listed_dir:
            return True
        if self._is_object:
            return False
        return bool(checked(self.store.list, self.url + "/"))

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_symlink(self) -> bool:
        return False

    def is_absolute(self) -> bool:
        return True

    def stat(self) -> SimpleNamespace:
        if self._size is None:
            self._size = checked(self.store.head, self.url)[1]
        return SimpleNamespace(st_size=self._size)

    # contents
    def open(self, mode: str = "rb"):
        if mode != "rb":
            raise ValueError(f"{self.url}: remote objects open for reading only")
        raw = RemoteFile(checked(self.store.open_file, self.url), self.url)
        return io.BufferedReader(raw, buffer_size=1 << 20)

    def read_bytes(self) -> bytes:
        return checked(self.store.get, self.url)[0]

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            checked(self.store.delete, self.url)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Makes the prefix exist: a hidden, empty marker object `.eaglebatch.dir` under it
        (scans skip hidden names). A Ray driver creates its unit directories so."""
        checked(self.store.put, f"{self.url}/{DIR_MARKER}", b"", "overwrite")

    def rmdir(self) -> None:
        """Nothing to do: a prefix without objects does not exist."""
