"""Storage requests issued side by side: an object store answers each one in tens of milliseconds.

A step with hundreds of shards hashed one file at a time, or a run with hundreds of step folders
asked for their manifests one at a time, waits that round trip once per file or step: seconds to
minutes at every resume. :func:`map_ordered` runs the requests on a small bounded pool of threads
(fsspec's filesystems, s3fs included, may be called from several threads) and hands back what the
sequential loop would have: the results in the order of the items, and the error of the first item
that failed, in that order. Each request keeps its own retries (:func:`~resilient_rl.checkpoint.retry.
call_with_retry` runs inside it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["MAX_WORKERS", "QUERY_WORKERS", "iter_ordered", "map_ordered"]

T = TypeVar("T")
R = TypeVar("R")

#: Listings and metadata queries in flight at once: small answers, latency-bound.
QUERY_WORKERS = 16
#: A cap on every pool here; 1 makes the requests sequential (a bench's same-run baseline).
MAX_WORKERS: int | None = None


def iter_ordered(fn: Callable[[T], R], items: Iterable[T], workers: int = QUERY_WORKERS) -> Iterator[R]:
    """``fn(item)`` for each item, computed up to ``workers`` at a time, yielded in the order of
    ``items``; the first failure in that order is raised when its turn comes. A caller that stops
    early (a verdict found) leaves the requests not yet started undone."""
    todo = list(items)
    workers = workers if MAX_WORKERS is None else min(workers, MAX_WORKERS)
    if workers <= 1 or len(todo) <= 1:
        yield from map(fn, todo)
        return
    pool = ThreadPoolExecutor(max_workers=min(workers, len(todo)), thread_name_prefix="rrl-storage")
    try:
        futures: list[Future[R]] = [pool.submit(fn, item) for item in todo]
        for future in futures:
            yield future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def map_ordered(fn: Callable[[T], R], items: Iterable[T], workers: int = QUERY_WORKERS) -> list[R]:
    """The list of :func:`iter_ordered`'s results."""
    return list(iter_ordered(fn, items, workers))
