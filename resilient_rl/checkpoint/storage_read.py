"""The read side of checkpoint storage over fsspec: paths, retries, queries and ranged reads.

:class:`ReadableStorage` wraps one fsspec filesystem rooted at a URL (a local path, ``file://``,
``memory://``, ``s3://``, ...). Paths given to its methods are relative to that root, or full
URLs / absolute paths under it. Every call is retried with exponential backoff (tenacity) when
the error is *transient* (connection drops, timeouts, ``EAGAIN``/``EIO``/``EBUSY``/...); permanent
errors (``ENOSPC``, ``EACCES``, a missing file, ...) and exhausted retries raise
:class:`~resilient_rl.errors.StorageError` naming the path and the cause. It also decides the
write strategy of the filesystem; the writes themselves are in
:class:`resilient_rl.checkpoint.storage.Storage`, which adds them to this class.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from resilient_rl import env
from resilient_rl.checkpoint.fanout import map_ordered
from resilient_rl.checkpoint.retry import RetryPolicy, call_with_retry
from resilient_rl.errors import StorageError

__all__ = ["OBJECT_STORE_PROTOCOLS", "Chunk", "ReadableStorage", "as_bytes_view"]

T = TypeVar("T")
Chunk = bytes | bytearray | memoryview

OBJECT_STORE_PROTOCOLS = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss", "r2"})


def _write_strategy(fs: fsspec.AbstractFileSystem) -> str:
    """'local' (tmp + fsync + replace), 'put' (object store: a put is atomic) or 'rename'."""
    declared = getattr(fs, "rrl_write_strategy", None)
    if declared:
        return str(declared)
    if isinstance(fs, LocalFileSystem):
        return "local"
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "put" if OBJECT_STORE_PROTOCOLS.intersection(protocols) else "rename"


def as_bytes_view(chunk: Chunk) -> memoryview:
    view = chunk if isinstance(chunk, memoryview) else memoryview(chunk)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _read_local_segments(full: str, segments: list[tuple[int, memoryview]]) -> None:
    with open(full, "rb", buffering=0) as f:
        if len(segments) > 1 and hasattr(os, "posix_fadvise"):
            # Mostly forward reads: a larger readahead window helps cold files.
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for start, view in segments:
            f.seek(start)
            got = 0
            while got < len(view):
                k = f.readinto(view[got:])
                if not k:
                    raise EOFError(f"{full}: file ends at byte {start + got}, "
                                   f"expected {len(view) - got} more bytes")
                got += k


def _list_folder(fs: fsspec.AbstractFileSystem, folder: str) -> list[dict] | None:
    try:
        return fs.ls(folder, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _walk(fs: fsspec.AbstractFileSystem, full: str) -> dict[str, dict] | None:
    """{path: info} of every file below folder ``full``, None when it is absent. fsspec's
    generic walk leaves out a folder it cannot list (its subfolders ignore ``on_error``): one
    EIO made a committed step look empty, and a clean-up then deleted it. Here a subfolder
    gone meanwhile is left out; any other error is raised (and retried by the caller). The
    folders of one depth are listed side by side (a step's role folders): a round trip per
    depth, not per folder."""
    top = fs._strip_protocol(full).rstrip("/")
    found: dict[str, dict] = {}
    level = [top]
    while level:
        listed = map_ordered(lambda folder: _list_folder(fs, folder), level)
        below: list[str] = []
        for folder, entries in zip(level, listed):
            if entries is None:
                if folder == top:
                    return None
                continue
            for info in entries:
                name = info["name"].rstrip("/")
                if info.get("type") == "directory":
                    if name != folder:
                        below.append(name)
                else:
                    found[name] = info
        level = below
    return found


class ReadableStorage:
    """A retrying view of one fsspec filesystem rooted at ``url``: paths, queries and reads."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy = RetryPolicy(),
                 fs: fsspec.AbstractFileSystem | None = None):
        if not url:
            raise ValueError("Storage needs a non-empty url")
        self.retry = retry
        self.storage_options = dict(storage_options or {})
        if fs is None:
            faulty = url.startswith("faulty://")
            for protocol, cls in env.opt_in_filesystems().items():
                if url.startswith(f"{protocol}://"):
                    fsspec.register_implementation(protocol, cls, clobber=True)
            try:
                fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
            except (ImportError, ValueError, TypeError) as exc:
                hint = (f" (faulty:// is the chaos suite's fault-injecting filesystem; it opens only where "
                        f"{env.FAULT_INJECTION}=1)") if faulty else ""
                raise StorageError(f"cannot open storage {url!r}: {exc}{hint}") from exc
        else:
            root = fs._strip_protocol(url)
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/") or ("/" if root.startswith("/") else "")
        self.strategy = _write_strategy(fs)
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self._protocols = frozenset(protocols)
        # Local roots become absolute paths: another process may run in another folder.
        self.url = self.root if self.strategy == "local" else (url.rstrip("/") or url)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    # ----------------------------------------------------------------- paths
    @staticmethod
    def join(*parts: str) -> str:
        """Join path parts with '/'; empty and '.' parts are skipped, and the first part keeps
        its head (a leading '/' or a URL scheme)."""
        kept = [p for p in parts if p and p.strip("/") not in ("", ".")]
        if not kept:
            return ""
        return "/".join([kept[0].rstrip("/"), *(p.strip("/") for p in kept[1:])])

    def full_path(self, path: str) -> str:
        """The filesystem path for ``path`` (relative to the root, a URL or absolute)."""
        if "://" in path:
            scheme = path.split("://", 1)[0]
            if scheme not in self._protocols:
                raise StorageError(f"{path!r} is not on this storage ({self.url!r}, "
                                   f"protocols {sorted(self._protocols)})")
            return self.fs._strip_protocol(path).rstrip("/")
        if path.startswith("/") and self.strategy in ("local", "rename"):
            return path.rstrip("/") or "/"
        rel = path.strip("/")
        if not rel or rel == ".":
            return self.root
        return f"{self.root.rstrip('/')}/{rel}" if self.root else rel

    def location(self, path: str = "") -> str:
        """What ``path`` is, whatever its spelling: locally its real path (symlinks and ``..``
        resolved), elsewhere the filesystem's first protocol and the path (``s3a://b/k`` is
        ``s3://b/k``). Two spellings of one folder have the same location."""
        full = self.full_path(path)
        if self.strategy == "local":
            return os.path.realpath(full)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        return f"{protocols[0]}://{full.strip('/')}"

    def url_for(self, path: str) -> str:
        """A URL for ``path`` that another process can open with the same storage options."""
        if "://" in path:
            return path.rstrip("/")
        rel = path.strip("/")
        if not rel or rel == ".":
            return self.url
        return f"{self.url.rstrip('/')}/{rel}"

    def relative(self, full: str, base: str) -> str:
        """``full`` (a path from a listing) relative to ``base`` (a path given to this object)."""
        f = self.fs._strip_protocol(full).strip("/")
        b = self.full_path(base).strip("/")
        if b and f.startswith(b + "/"):
            return f[len(b) + 1:]
        return f.rsplit("/", 1)[-1]

    # ----------------------------------------------------------------- retry
    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        return call_with_retry(self.retry, f"storage {op}", self.url_for(path), fn)

    def _invalidate(self, full: str) -> None:
        # Listings are cached by some backends (s3fs); other processes write here too.
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(full)

    # ----------------------------------------------------------------- queries
    def exists(self, path: str) -> bool:
        full = self.full_path(path)

        def _exists() -> bool:
            self._invalidate(full)
            if self.strategy == "put":  # an object store's client raises what is not "no such key"
                return bool(self.fs.exists(full))
            try:  # fsspec's generic exists() reads any error (EIO, ESTALE on NFS) as "absent"
                self.fs.info(full)
            except (FileNotFoundError, NotADirectoryError):
                return False
            return True
        return self._call("exists", path, _exists)

    def ls(self, path: str = "", folders: bool = False) -> list[str]:
        """Names (not paths) of the entries in folder ``path``, sorted; [] if it is absent. Only
        its folders with ``folders`` (a file named like one is left out)."""
        full = self.full_path(path)

        def _ls() -> list[str]:
            self._invalidate(full)
            try:
                entries = self.fs.ls(full, detail=folders)
            except FileNotFoundError:
                return []
            if folders:
                entries = [e["name"] for e in entries if e.get("type") == "directory"]
            names = {self.fs._strip_protocol(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}
            names.discard("")
            return sorted(names)
        return self._call("ls", path, _ls)

    def find(self, path: str = "") -> dict[str, int]:
        """Every file below folder ``path`` as {path relative to it: size}; {} if absent."""
        full = self.full_path(path)

        def _find() -> dict[str, int]:
            self._invalidate(full)
            if self.strategy == "put":  # an object store's listing raises its errors
                try:
                    found = self.fs.find(full, detail=True)
                except FileNotFoundError:
                    return {}
            else:
                found = _walk(self.fs, full)
                if found is None:
                    return {}
            return {self.relative(p, path): int(info.get("size") or 0)
                    for p, info in found.items() if info.get("type", "file") == "file"}
        return self._call("find", path, _find)

    def size(self, path: str) -> int:
        full = self.full_path(path)
        return self._call("size", path, lambda: int(self.fs.size(full)))

    # ----------------------------------------------------------------- reads
    def read_bytes(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of a file (the whole file by default)."""
        full = self.full_path(path)
        return self._call("read", path, lambda: self.fs.cat_file(full, start=start, end=end))

    def try_read_bytes(self, path: str) -> bytes | None:
        """The whole file, or None when it does not exist."""
        full = self.full_path(path)

        def _read() -> bytes | None:
            try:
                return self.fs.cat_file(full)
            except FileNotFoundError:
                return None
        return self._call("read", path, _read)

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        """Fill the writable buffer ``out`` with the file's bytes from ``start`` on."""
        self.read_segments(path, [(start, out)])

    def read_segments(self, path: str, segments: Sequence[tuple[int, memoryview]],
                      span_bytes: int = 64 * 1024 * 1024) -> None:
        """Fill each writable buffer ``out`` of ``segments`` with the file's bytes from its
        ``start`` on. Locally every buffer is read straight into (no intermediate copy) through
        one open file; elsewhere contiguous segments are fetched as ranged reads of at most
        ``span_bytes`` (or one segment, if larger)."""
        full = self.full_path(path)
        segs = [(start, as_bytes_view(out)) for start, out in segments if len(out)]
        if not segs:
            return
        if self.strategy == "local":
            self._call("read", path, lambda: _read_local_segments(full, segs))
            return
        spans: list[list[tuple[int, memoryview]]] = []
        for start, view in sorted(segs, key=lambda s: s[0]):
            last = spans[-1] if spans else None
            if last and last[-1][0] + len(last[-1][1]) == start and \
                    start + len(view) - last[0][0] <= span_bytes:
                last.append((start, view))
            else:
                spans.append([(start, view)])

        def _read_remote() -> None:
            for span in spans:
                lo, hi = span[0][0], span[-1][0] + len(span[-1][1])
                data = memoryview(self.fs.cat_file(full, start=lo, end=hi))
                if len(data) != hi - lo:
                    raise EOFError(f"{full}: got {len(data)} bytes at offset {lo}, expected {hi - lo}")
                for start, view in span:
                    view[:] = data[start - lo:start - lo + len(view)]
        self._call("read", path, _read_remote)
