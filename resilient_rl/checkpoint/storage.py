"""Checkpoint storage over fsspec: atomic writes, ranged reads and bounded retries.

:class:`Storage` wraps one fsspec filesystem rooted at a URL (a local path, ``file://``,
``memory://``, ``s3://``, ...). Paths given to its methods are relative to that root, or full
URLs / absolute paths under it. Every call is retried with exponential backoff (tenacity) when
the error is *transient* (connection drops, timeouts, ``EAGAIN``/``EIO``/``EBUSY``/...); permanent
errors (``ENOSPC``, ``EACCES``, a missing file, ...) and exhausted retries raise
:class:`~resilient_rl.errors.StorageError` naming the path and the cause.

Writes are atomic: a reader sees the old file or the complete new one, never a torn one.
Locally that is a temp file + fsync + ``os.replace`` (+ fsync of the folder); on object stores a
single put or a multipart upload is published only when it completes; other filesystems get a
temp name and a rename. Streaming writes compute the sha256 while writing (no second read).
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from resilient_rl import env
from resilient_rl.checkpoint.hashing import Sha256Pipe
from resilient_rl.checkpoint.manifest import FileRecord
from resilient_rl.checkpoint.retry import RetryPolicy, call_with_retry, is_transient
from resilient_rl.errors import StorageError

__all__ = ["OBJECT_STORE_PROTOCOLS", "TEMP_NAME_RE", "RetryPolicy", "Sha256Pipe", "Storage", "is_transient"]

T = TypeVar("T")
Chunk = bytes | bytearray | memoryview

#: Temp files of atomic writes are named ``{name}.tmp-{pid}-{8 hex}`` next to their target;
#: a writer killed before its rename leaves one behind (see ``CheckpointManager.cleanup_uncommitted``).
TEMP_NAME_RE = re.compile(r"\.tmp-(\d+)-[0-9a-f]{8}$")


def _temp_name(full: str) -> str:
    return f"{full}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"

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


def _as_bytes_view(chunk: Chunk) -> memoryview:
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


def _fsync_dir(path: str) -> None:
    # Makes the rename itself durable; not every platform allows opening a folder.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Storage:
    """A retrying, atomically-writing view of one fsspec filesystem rooted at ``url``."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy = RetryPolicy(),
                 fs: fsspec.AbstractFileSystem | None = None):
        if not url:
            raise ValueError("Storage needs a non-empty url")
        self.retry = retry
        self.storage_options = dict(storage_options or {})
        if fs is None:
            faulty = url.startswith("faulty://")
            if faulty and env.fault_injection():
                from resilient_rl.faults.storage import register

                register()
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
            return bool(self.fs.exists(full))
        return self._call("exists", path, _exists)

    def ls(self, path: str = "") -> list[str]:
        """Names (not paths) of the entries in folder ``path``, sorted; [] if it is absent."""
        full = self.full_path(path)

        def _ls() -> list[str]:
            self._invalidate(full)
            try:
                entries = self.fs.ls(full, detail=False)
            except FileNotFoundError:
                return []
            names = {self.fs._strip_protocol(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}
            names.discard("")
            return sorted(names)
        return self._call("ls", path, _ls)

    def find(self, path: str = "") -> dict[str, int]:
        """Every file below folder ``path`` as {path relative to it: size}; {} if absent."""
        full = self.full_path(path)

        def _find() -> dict[str, int]:
            self._invalidate(full)
            try:
                found = self.fs.find(full, detail=True)
            except FileNotFoundError:
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
        segs = [(start, _as_bytes_view(out)) for start, out in segments if len(out)]
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

    # ----------------------------------------------------------------- writes
    def write_bytes_atomic(self, path: str, data: Chunk) -> FileRecord:
        """Write ``data`` to ``path`` atomically; returns (path, size, sha256)."""
        view = _as_bytes_view(data)
        return self.write_stream(path, lambda: (view,))

    def write_stream(self, path: str, chunks: Callable[[], Iterable[Chunk]]) -> FileRecord:
        """Write the concatenation of ``chunks()`` to ``path`` atomically, hashing on the way.

        ``chunks`` is a factory: a retried attempt calls it again to restart from the first
        byte. Chunks may be held until hashed, which can lag behind the write (locally, until
        the final fsync): yield views of existing memory rather than fresh large buffers.
        Returns (path as given, size, sha256)."""
        full = self.full_path(path)
        writer = {"local": self._write_local, "put": self._write_put,
                  "rename": self._write_rename}[self.strategy]
        size, digest = self._call("write", path, lambda: writer(full, chunks))
        return FileRecord(path, size, digest)

    def _write_local(self, full: str, chunks: Callable[[], Iterable[Chunk]]) -> tuple[int, str]:
        folder = os.path.dirname(full) or "."
        os.makedirs(folder, exist_ok=True)
        tmp = _temp_name(full)
        size = 0
        try:
            # The hash may lag behind the writes (the chunks are views of memory that outlives
            # this call), so it finishes while fsync waits for the device.
            with open(tmp, "wb", buffering=0) as f, Sha256Pipe(max_pending=None) as digest:
                for chunk in chunks():
                    view = _as_bytes_view(chunk)
                    digest.update(view)
                    written = 0
                    while written < len(view):
                        written += f.write(view[written:])
                    size += len(view)
                os.fsync(f.fileno())
                hexdigest = digest.hexdigest()
            os.replace(tmp, full)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(folder)
        return size, hexdigest

    def _stream_to(self, target: str, chunks: Callable[[], Iterable[Chunk]]) -> tuple[int, str]:
        size = 0
        f = self.fs.open(target, "wb")
        try:
            with Sha256Pipe() as digest:
                for chunk in chunks():
                    view = _as_bytes_view(chunk)
                    digest.update(view)
                    f.write(view)
                    size += len(view)
                hexdigest = digest.hexdigest()
            f.close()
        except BaseException:
            # Abort without publishing: closing would commit a partial upload.
            with contextlib.suppress(Exception):
                f.discard()
            with contextlib.suppress(Exception):
                f.closed = True
            raise
        return size, hexdigest

    def _write_put(self, full: str, chunks: Callable[[], Iterable[Chunk]]) -> tuple[int, str]:
        self._invalidate(full)
        return self._stream_to(full, chunks)

    def _write_rename(self, full: str, chunks: Callable[[], Iterable[Chunk]]) -> tuple[int, str]:
        parent = full.rsplit("/", 1)[0] if "/" in full else ""
        if parent:
            with contextlib.suppress(FileExistsError):
                self.fs.makedirs(parent, exist_ok=True)
        tmp = _temp_name(full)
        try:
            result = self._stream_to(tmp, chunks)
            self.fs.mv(tmp, full)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise
        self._invalidate(full)
        return result

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` only if it does not exist; True when this call
        created it, False when it already existed (possibly written by an earlier attempt of
        this very call: a caller that must know reads it back).

        Exclusive where the backend can be: locally a hard link of a complete temp file
        (``link`` fails if the name exists, and a reader never sees a partial file); elsewhere
        mode ``"xb"`` (a conditional put, ``If-None-Match: *``, on S3; an ``O_EXCL`` open on
        files). A backend that knows no ``"xb"`` falls back to exists-then-write, which leaves a
        race window between two creators; callers verify by reading back."""
        full = self.full_path(path)
        view = _as_bytes_view(data)

        def _create() -> bool:
            if self.strategy == "local":
                folder = os.path.dirname(full) or "."
                os.makedirs(folder, exist_ok=True)
                tmp = f"{full}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                try:
                    with open(tmp, "wb") as f:
                        f.write(view)
                        f.flush()
                        os.fsync(f.fileno())
                    try:
                        os.link(tmp, full)
                    except FileExistsError:
                        return False
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                _fsync_dir(folder)
                return True
            self._invalidate(full)
            parent = full.rsplit("/", 1)[0] if "/" in full else ""
            if parent and self.strategy == "rename":
                with contextlib.suppress(FileExistsError):
                    self.fs.makedirs(parent, exist_ok=True)
            try:
                f = self.fs.open(full, "xb")
            except FileExistsError:
                return False
            except (ValueError, NotImplementedError, TypeError):
                if self.fs.exists(full):  # no exclusive mode here: see the docstring
                    return False
                self._write_rename(full, lambda: (view,)) if self.strategy == "rename" \
                    else self._write_put(full, lambda: (view,))
                return True
            try:
                f.write(view)
                f.close()
            except FileExistsError:  # object stores check the condition when publishing
                return False
            finally:
                self._invalidate(full)
            return True
        return self._call("create", path, _create)

    def copy_file(self, src: str, dst: str) -> None:
        """Copy one file (server-side where the backend can; else streamed, atomically)."""
        full_src, full_dst = self.full_path(src), self.full_path(dst)

        def _copy() -> None:
            parent = full_dst.rsplit("/", 1)[0] if "/" in full_dst else ""
            if parent and self.strategy in ("local", "rename"):
                with contextlib.suppress(FileExistsError):
                    self.fs.makedirs(parent, exist_ok=True)
            self.fs.cp_file(full_src, full_dst)
            self._invalidate(full_dst)
        try:
            self._call("copy", dst, _copy)
        except StorageError as exc:
            if not isinstance(exc.__cause__, NotImplementedError):
                raise
            size = self.size(src)
            step = 64 * 1024 * 1024
            self.write_stream(dst, lambda: (self.read_bytes(src, lo, min(size, lo + step))
                                            for lo in range(0, size, step)))

    def rename_local(self, src: str, dst: str) -> None:
        """Rename a file or folder on a local filesystem (one atomic ``rename``); the parent of
        ``dst`` is created. Only for ``strategy == "local"``."""
        if self.strategy != "local":
            raise StorageError(f"rename_local needs a local filesystem, {self.url!r} is not")
        full_src, full_dst = self.full_path(src), self.full_path(dst)

        def _rename() -> None:
            os.makedirs(os.path.dirname(full_dst) or ".", exist_ok=True)
            os.rename(full_src, full_dst)
            _fsync_dir(os.path.dirname(full_dst) or ".")
            _fsync_dir(os.path.dirname(full_src) or ".")
        self._call("rename", dst, _rename)

    # ----------------------------------------------------------------- deletes
    def rm(self, path: str, recursive: bool = False) -> None:
        """Delete a file (or a folder tree with ``recursive``); absent paths are fine."""
        full = self.full_path(path)

        def _rm() -> None:
            self._invalidate(full)
            try:
                self.fs.rm(full, recursive=recursive)
            except FileNotFoundError:
                pass
            self._invalidate(full)
        self._call("rm", path, _rm)

    # ----------------------------------------------------------------- housekeeping
    def check_writable(self, path: str = "") -> None:
        """Create and delete a small probe file in folder ``path``: a root that cannot be
        written is found before a run starts, not at its first checkpoint. Raises StorageError."""
        probe = Storage.join(path, f".rrl-write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.write_bytes_atomic(probe, b"resilient-rl write probe\n")
        self.rm(probe)

    def abort_incomplete_uploads(self, path: str, skip: Callable[[str], bool] = lambda rel: False) -> list[str]:
        """Abort the incomplete multipart uploads under folder ``path`` (S3 only: a writer killed
        mid-upload leaves its parts stored, and billed, until aborted), except those whose key
        relative to ``path`` satisfies ``skip`` (an upload in flight). Returns the aborted keys,
        relative to ``path``; [] on other filesystems."""
        call = getattr(self.fs, "call_s3", None)
        if call is None or not {"s3", "s3a"} & self._protocols:
            return []
        bucket, _, prefix = self.full_path(path).partition("/")
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        aborted: list[str] = []
        markers: dict[str, str] = {}
        while True:
            page = self._call("list uploads", path, lambda: call(
                "list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers))
            for upload in page.get("Uploads") or []:
                rel = upload["Key"][len(prefix):]
                if not upload["Key"].startswith(prefix) or skip(rel):
                    continue
                self._call("abort upload", path, lambda u=upload: call(
                    "abort_multipart_upload", Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]))
                aborted.append(rel)
            if not page.get("IsTruncated"):
                return aborted
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}
