"""Hashing that overlaps I/O: sha256 on a helper thread, in stream order."""

from __future__ import annotations

import hashlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor


class Sha256Pipe:
    """sha256 of a byte stream, computed on a helper thread so hashing overlaps the caller's
    I/O (hashlib releases the GIL on large buffers). Buffers are hashed in the order given and
    must stay unchanged until :meth:`hexdigest`. Small buffers are hashed inline. At most
    ``max_pending`` buffers wait (None: no bound, for views of memory that outlives the hash)."""

    _INLINE_BYTES = 1 << 20

    def __init__(self, max_pending: int | None = 4) -> None:
        self._max_pending = max_pending
        self._digest = hashlib.sha256()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future[None]] = deque()

    def update(self, view: memoryview) -> None:
        if len(view) < self._INLINE_BYTES:
            self._drain()
            self._digest.update(view)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rrl-sha256")
        self._pending.append(self._pool.submit(self._digest.update, view))
        while self._max_pending is not None and len(self._pending) > self._max_pending:
            self._pending.popleft().result()

    def _drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def hexdigest(self) -> str:
        self.close()
        return self._digest.hexdigest()

    def close(self) -> None:
        try:
            self._drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __enter__(self) -> "Sha256Pipe":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
