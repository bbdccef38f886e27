"""A fake CUDA runtime binding: stands in for ``torch.cuda.cudart()`` on machines without a GPU.

It implements the calls :mod:`resilient_rl.page_lock` makes (``cudaHostRegister``,
``cudaHostUnregister``, ``cudaGetLastError``) with CUDA's semantics where they matter: a failed
call also becomes the thread's last error, which stays until ``cudaGetLastError`` reads it, and
unregistering memory that was never registered fails. It records what is registered, so a test
can check how many bytes were page-locked, and in how many registrations::

    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    ... allocate ...
    assert [size for _, size, _ in cudart.registered] == [expected]

Only the registration is fake: the host memory is allocated, written and read for real.
"""

from __future__ import annotations


class FakeCudart:
    """``code``: what ``cudaHostRegister`` returns (0: success; e.g. 2, cudaErrorMemoryAllocation,
    for a node that lets the process lock no more)."""

    def __init__(self, code: int = 0):
        self.code, self.registered, self.last_error = code, [], 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if self.code:
            self.last_error = self.code
            return self.code
        self.registered.append((ptr, size, flags))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        if not any(r[0] == ptr for r in self.registered):
            self.last_error = 713  # cudaErrorHostMemoryNotRegistered
            return 713
        self.registered = [r for r in self.registered if r[0] != ptr]
        return 0

    def cudaGetLastError(self) -> int:
        code, self.last_error = self.last_error, 0
        return code
