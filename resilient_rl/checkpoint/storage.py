"""Checkpoint storage over fsspec: atomic writes, exclusive creates, deletes and upload cleanup.

:class:`Storage` adds the writes to :class:`~resilient_rl.checkpoint.storage_read.ReadableStorage`
(paths, retries, queries and ranged reads over one fsspec filesystem rooted at a URL); every call
is retried on transient errors and raises :class:`~resilient_rl.errors.StorageError` otherwise.

Writes are atomic: a reader sees the old file or the complete new one, never a torn one.
Locally that is a temp file + fsync + ``os.replace`` (+ fsync of the folder); on object stores a
single put or a multipart upload is published only when it completes; other filesystems get a
temp name and a rename. Streaming writes compute the sha256 while writing (no second read).

A write may carry a ``before_publish`` check (a writer's lease, a step not yet committed by
someone else): it runs after the last byte is durable and right before the write becomes
visible (the ``os.replace`` or ``mv`` of the temp file, the ``close`` that completes an
upload). A check made before the fsync would leave the fsync's seconds on network storage for
the condition to change, and the stale write would still be published.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Callable, Iterable

from resilient_rl.checkpoint.hashing import Sha256Pipe
from resilient_rl.checkpoint.manifest import FileRecord
from resilient_rl.checkpoint.retry import RetryPolicy, is_transient
from resilient_rl.checkpoint.storage_read import OBJECT_STORE_PROTOCOLS, Chunk, ReadableStorage, as_bytes_view
from resilient_rl.errors import StorageError

__all__ = ["OBJECT_STORE_PROTOCOLS", "TEMP_NAME_RE", "RetryPolicy", "Sha256Pipe", "Storage", "is_transient"]

#: Temp files of atomic writes are named ``{name}.tmp-{pid}-{8 hex}`` next to their target;
#: a writer killed before its rename leaves one behind (see ``CheckpointManager.cleanup_uncommitted``).
TEMP_NAME_RE = re.compile(r"\.tmp-(\d+)-[0-9a-f]{8}$")


#: A check run right before a write is published; it raises to stop the write.
Check = Callable[[], None]


def _nothing() -> None:
    pass


def _temp_name(full: str) -> str:
    return f"{full}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _fsync_dir(path: str) -> None:
    # Makes the rename itself durable; not every platform allows opening a folder.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Storage(ReadableStorage):
    """A retrying, atomically-writing view of one fsspec filesystem rooted at ``url``."""

    # ----------------------------------------------------------------- writes
    def write_bytes_atomic(self, path: str, data: Chunk, before_publish: Check | None = None) -> FileRecord:
        """Write ``data`` to ``path`` atomically; returns (path, size, sha256). See
        :meth:`write_stream` for ``before_publish``."""
        view = as_bytes_view(data)
        return self.write_stream(path, lambda: (view,), before_publish)

    def write_stream(self, path: str, chunks: Callable[[], Iterable[Chunk]],
                     before_publish: Check | None = None) -> FileRecord:
        """Write the concatenation of ``chunks()`` to ``path`` atomically, hashing on the way.

        ``chunks`` is a factory: a retried attempt calls it again to restart from the first
        byte. Chunks may be held until hashed, which can lag behind the write (locally, until
        the final fsync): yield views of existing memory rather than fresh large buffers.
        Returns (path as given, size, sha256).

        ``before_publish`` is called once the content is durable, as the last step before it
        takes its name (see the module docstring); when it raises, nothing is published, the
        temp file or upload is dropped and its error propagates unchanged (not retried, not
        wrapped in StorageError)."""
        full = self.full_path(path)
        writer = {"local": self._write_local, "put": self._write_put,
                  "rename": self._write_rename}[self.strategy]
        refused: list[BaseException] = []

        def publish_check() -> None:
            if before_publish is None:
                return
            try:
                before_publish()
            except BaseException as exc:
                refused.append(exc)
                raise

        try:
            size, digest = self._call("write", path, lambda: writer(full, chunks, publish_check))
        except StorageError as exc:
            if refused and exc is not refused[-1] and exc.__cause__ is refused[-1]:
                raise refused[-1] from None  # the check's own verdict, not a storage failure
            raise
        return FileRecord(path, size, digest)

    def _write_local(self, full: str, chunks: Callable[[], Iterable[Chunk]],
                     before_publish: Check = _nothing) -> tuple[int, str]:
        folder = os.path.dirname(full) or "."
        os.makedirs(folder, exist_ok=True)
        tmp = _temp_name(full)
        size = 0
        try:
            # The hash may lag behind the writes (the chunks are views of memory that outlives
            # this call), so it finishes while fsync waits for the device.
            with open(tmp, "wb", buffering=0) as f, Sha256Pipe(max_pending=None) as digest:
                for chunk in chunks():
                    view = as_bytes_view(chunk)
                    digest.update(view)
                    written = 0
                    while written < len(view):
                        written += f.write(view[written:])
                    size += len(view)
                os.fsync(f.fileno())
                hexdigest = digest.hexdigest()
            before_publish()
            os.replace(tmp, full)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(folder)
        return size, hexdigest

    def _stream_to(self, target: str, chunks: Callable[[], Iterable[Chunk]],
                   before_close: Check = _nothing) -> tuple[int, str]:
        size = 0
        f = self.fs.open(target, "wb")
        try:
            with Sha256Pipe() as digest:
                for chunk in chunks():
                    view = as_bytes_view(chunk)
                    digest.update(view)
                    f.write(view)
                    size += len(view)
                hexdigest = digest.hexdigest()
            before_close()
            f.close()
        except BaseException:
            # Abort without publishing: closing would commit a partial upload.
            with contextlib.suppress(Exception):
                f.discard()
            with contextlib.suppress(Exception):
                f.closed = True
            raise
        return size, hexdigest

    def _write_put(self, full: str, chunks: Callable[[], Iterable[Chunk]],
                   before_publish: Check = _nothing) -> tuple[int, str]:
        # Closing completes the upload (its last part goes out then): the check cannot be later.
        self._invalidate(full)
        return self._stream_to(full, chunks, before_publish)

    def _write_rename(self, full: str, chunks: Callable[[], Iterable[Chunk]],
                      before_publish: Check = _nothing) -> tuple[int, str]:
        parent = full.rsplit("/", 1)[0] if "/" in full else ""
        if parent:
            with contextlib.suppress(FileExistsError):
                self.fs.makedirs(parent, exist_ok=True)
        tmp = _temp_name(full)
        try:
            result = self._stream_to(tmp, chunks)
            before_publish()
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
        view = as_bytes_view(data)

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
