"""The task events Ray's GCS holds, read from the GCS itself (no dashboard needed), for
``tests/test_task_events_ray.py`` and ``bench/task_events.py``.

Every process reports its task events to the GCS about once a second
(``RAY_task_events_report_interval_ms``), so :func:`settled` reads until two reads a report
interval apart agree.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import ray

#: More than the GCS keeps by default (``RAY_task_events_max_num_task_in_gcs``: 100,000).
_LIMIT = 1_000_000


@dataclass(frozen=True)
class TaskEvents:
    """What the GCS holds: ``stored`` task attempts in all (its own count), ``by_name`` the attempts
    of each task or actor method (``Class.method``; the driver's own entry is left out), ``bytes``
    their events serialized (a floor on the GCS memory they take)."""

    stored: int
    by_name: Counter
    bytes: int = 0

    def count(self, *names: str) -> int:
        """Attempts held of the tasks named ``names`` (all of them when none is named)."""
        return sum(n for name, n in self.by_name.items() if not names or name in names)

    def minus(self, earlier: "TaskEvents") -> "TaskEvents":
        """What was added since ``earlier``."""
        return TaskEvents(self.stored - earlier.stored, self.by_name - earlier.by_name, self.bytes - earlier.bytes)


def read(timeout_s: float = 30.0) -> TaskEvents:
    """The task events the connected cluster's GCS holds now."""
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2_grpc
    from ray.core.generated.gcs_service_pb2 import GetTaskEventsRequest

    channel = init_grpc_channel(ray.get_runtime_context().gcs_address)
    try:
        reply = gcs_service_pb2_grpc.TaskInfoGcsServiceStub(channel).GetTaskEvents(
            GetTaskEventsRequest(limit=_LIMIT), timeout=timeout_s)
    finally:
        channel.close()
    named = [e for e in reply.events_by_task if e.task_info.name]
    return TaskEvents(int(reply.num_total_stored), Counter(e.task_info.name for e in named),
                      sum(e.ByteSize() for e in named))


def settled(interval_s: float = 2.5, timeout_s: float = 60.0) -> TaskEvents:
    """:func:`read` once the processes' reports have arrived: two reads ``interval_s`` apart (more
    than a report interval) that agree, or the last read after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = read()
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        now = read()
        if now == last:
            return now
        last = now
    return last
