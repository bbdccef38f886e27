"""A barrier between the processes of one host over named pipes (FIFOs).

A gloo barrier hands each arrival from the socket's I/O thread to the group's work thread to the
caller: three thread wake-ups per process, which on a busy host cost most of a millisecond, often
several. Here a rank writes one byte into a pipe to each peer and reads one byte from each peer's
pipe to it: the caller itself is woken by the kernel, about 30 us.

Each ordered pair of ranks has its own pipe, so a peer that dies is named at once: the kernel
closes its ends, its pipe to this rank reads end-of-file and the pipe from this rank breaks. A
peer that hangs is given up on after the group's timeout. Either raises
:class:`~resilient_rl.errors.CollectiveError`, as a failed gloo collective does.

The bytes carry no data; a rank is at most one barrier ahead of a peer, so a pipe never holds
more than two. The pipes also order memory: what a rank wrote before its barrier (a slot of a
shared-memory segment) is visible to a peer once the peer has read that rank's byte.
"""

from __future__ import annotations

import errno
import os
import select
import time

from resilient_rl.errors import CollectiveError


def fifo_path(prefix: str, src: int, dst: int) -> str:
    """The pipe that carries rank ``src``'s arrivals to rank ``dst``."""
    return f"{prefix}-{src}to{dst}"


def create_fifos(prefix: str, world: int) -> list[str]:
    """Make the pipes of every ordered pair of ``world`` ranks; their paths (made so far, on error)."""
    made = []
    try:
        for src in range(world):
            for dst in range(world):
                if src != dst:
                    os.mkfifo(fifo_path(prefix, src, dst), 0o600)
                    made.append(fifo_path(prefix, src, dst))
    except OSError:
        for path in made:
            unlink_quietly(path)
        raise
    return made


def unlink_quietly(path: str) -> None:
    """Remove ``path``; one already gone (or never made) is no error."""
    try:
        os.unlink(path)
    except OSError:
        pass


class PipeBarrier:
    """One rank's ends of the pipes made by :func:`create_fifos`.

    Opening is two-phased, each phase followed by a barrier of the group in the caller: read ends
    first (a write end cannot be opened without a reader), then write ends.
    """

    def __init__(self, prefix: str, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._prefix = prefix
        self._readers: dict[int, int] = {}  # fd -> peer
        self._writers: dict[int, int] = {}  # peer -> fd
        self._poll = select.poll()

    def open_readers(self) -> bool:
        """Open this rank's read ends (not blocking); whether they all opened."""
        try:
            for peer in self._peers():
                fd = os.open(fifo_path(self._prefix, peer, self.rank), os.O_RDONLY | os.O_NONBLOCK)
                self._readers[fd] = peer
                self._poll.register(fd, select.POLLIN)
        except OSError:
            return False
        return True

    def open_writers(self) -> bool:
        """Open this rank's write ends, once every peer's read ends are open; whether they all opened."""
        try:
            for peer in self._peers():
                self._writers[peer] = os.open(fifo_path(self._prefix, self.rank, peer), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return False
        return True

    def _peers(self) -> list[int]:
        return [r for r in range(self.world) if r != self.rank]

    def wait(self) -> None:
        """Return once every rank has called :meth:`wait` as many times as this one."""
        for peer, fd in self._writers.items():
            try:
                os.write(fd, b"\0")
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    self._left(peer)
                raise
        pending = dict(self._readers)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveError(f"barrier on rank {self.rank}: rank(s) {sorted(pending.values())} did not "
                                      f"arrive within {self.timeout_s:g}s", rank=self.rank, cause="collective")
            for fd, _ in self._poll.poll(max(1, int(left * 1000))):
                if fd not in pending:
                    continue  # already arrived this round; its next byte is read next round
                try:
                    got = os.read(fd, 1)
                except BlockingIOError:
                    continue
                if not got:
                    self._left(pending[fd])
                del pending[fd]

    def _left(self, peer: int) -> None:
        raise CollectiveError(f"barrier on rank {self.rank}: rank {peer} left the group (its process ended)",
                              rank=self.rank, cause="collective")

    def close(self) -> None:
        for fd in list(self._readers) + list(self._writers.values()):
            try:
                os.close(fd)
            except OSError:
                pass
        self._readers, self._writers = {}, {}
