"""bench/gpu.py's account of a run: each step as it ends and each recovery event as it happens,
stamped with the seconds since the run started, and after each measured step the figures of the
measured steps so far. A run stopped at its time limit (``bench/gpu_figures.sh``) still shows what
it measured and where it stood: the report at the end is printed only by a run that finishes, and
ends with the recovery's summary (:func:`recovery_lines`).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable

from resilient_rl.events.kinds import (Aborted, CheckpointCommitted, DecodeEager, FailureDuringRecovery,
                                       FailureEvent, KillHung, KillUnresponsive, LeaveCollectives, Recovered,
                                       RecoveryStateEntered, SnapshotRestored, SnapshotUnusable, SpareAdopted,
                                       WorkerRestarted)
from resilient_rl.runtime.worker_output import WORKER_LOG
from resilient_rl.telemetry import PHASES
from resilient_rl.trainer.hooks import TrainerHook

#: The events printed as they happen: a recovery's course (within its restart phase too: a rank
#: killed for not answering its probe, survivors told to leave their collectives, the hand-over to
#: a spare), a checkpoint's commit, the decode step's fallback.
PRINTED_EVENTS = (FailureEvent, FailureDuringRecovery, RecoveryStateEntered, KillUnresponsive, KillHung,
                  LeaveCollectives, SpareAdopted, WorkerRestarted, SnapshotRestored, SnapshotUnusable, Recovered,
                  Aborted, CheckpointCommitted, DecodeEager)
#: At most this many characters of an event's fields (a failure's message can be long).
EVENT_CHARS = 300
#: The lines of the rank processes' logs printed as they arrive (the packed-attention kernel each
#: process chose, compiled code loaded from the run's cache, a decode step traced in every process,
#: each role's build and its wait for the start-up imports: most of a recovery's rejoin, each
#: rank's restore of a snapshot, its check and its writing: the restore phase, and a spare's
#: taking of a rank, in parts: the end of the restart phase).
WORKER_LINES = ("packed attention:", "compile cache:", "rollout engine:", "of it waiting for the start-up imports",
                "GB: checked in", "the CUDA caching allocator", "held outside this process",
                "a warm spare took its place in")


def stamp(elapsed: float) -> str:
    return f"[{elapsed:7.1f} s]"


def step_line(row: dict, elapsed: float) -> str:
    """One finished step's metrics row: its time, the phases that took 0.05 s or more, tokens and
    the decode step's compiles and compactions, and the engine's prefill and decode loop (seconds,
    steps, time a step)."""
    phases = ", ".join(f"{p} {row[f'timing/{p}_s']:.1f}" for p in PHASES if row.get(f"timing/{p}_s", 0.0) >= 0.05)
    step_s = row.get("timing/step_s", 0.0)
    tokens = row.get("tokens", 0)
    rate = f", {tokens / step_s:.0f} tokens/s" if step_s > 0 else ""
    decode = ""
    if "perf/decode_compiles" in row:
        decode = (f"; decode step: {row['perf/decode_compiles']:.0f} compiles, "
                  f"{row.get('perf/decode_compactions', 0.0):.0f} compactions")
        if row.get("perf/decode_steps"):  # the engine's own time: the rest of gen is outside it
            decode += (f", prefill {row.get('perf/decode_prefill_s', 0.0):.2f} s, {row['perf/decode_steps']:.0f} "
                       f"steps in {row.get('perf/decode_loop_s', 0.0):.2f} s "
                       f"({1e3 * row.get('perf/decode_loop_s', 0.0) / row['perf/decode_steps']:.2f} ms a step)")
    return f"{stamp(elapsed)} step {row['step']}: {step_s:.1f} s ({phases}); {tokens:.0f} tokens{rate}{decode}"


def event_line(event, elapsed: float) -> str:
    """One event: its kind and fields, cut to :data:`EVENT_CHARS`."""
    fields = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in event.payload().items())
    if len(fields) > EVENT_CHARS:
        fields = fields[:EVENT_CHARS] + " ..."
    return f"{stamp(elapsed)} {event.kind}: {fields}"


class _WorkerLines(logging.Handler):
    """Hands ``out`` each line the rank processes log that holds one of :data:`WORKER_LINES`."""

    def __init__(self, out: Callable[[str], None]):
        super().__init__()
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if any(part in line for part in WORKER_LINES):
            self.out(line)


class Progress(TrainerHook):
    """Prints each step's :func:`step_line` once it has ended (at the next step's start, and at
    :meth:`finish`), every event of :data:`PRINTED_EVENTS` as it is written, and, after each step of
    ``first``..``last``, ``figures(rows)`` of the measured steps ended so far."""

    def __init__(self, first: int, last: int, figures: Callable[[list[dict]], list[str]] | None = None,
                 out: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic):
        self.first, self.last, self.figures, self.out, self.clock = first, last, figures, out, clock
        self.t0 = clock()
        self.printed: set[int] = set()
        self.unsubscribe: Callable[[], None] | None = None
        self.worker_lines = _WorkerLines(lambda line: self.out(f"{stamp(self.clock() - self.t0)} {line}"))

    def attach(self, run_dir) -> None:
        """Print ``run_dir``'s events of :data:`PRINTED_EVENTS`, and the rank processes' log lines
        of :data:`WORKER_LINES`, from now on."""
        self.unsubscribe = run_dir.subscribe(lambda ev: self.out(event_line(ev, self.clock() - self.t0)),
                                             *PRINTED_EVENTS)
        WORKER_LOG.addHandler(self.worker_lines)

    def on_step_start(self, trainer, step: int) -> None:
        self.steps(trainer.run_dir.read_metrics())

    def finish(self, run_dir) -> None:
        """The steps not printed yet; stops printing events."""
        if self.unsubscribe is not None:
            self.unsubscribe()
        WORKER_LOG.removeHandler(self.worker_lines)
        self.steps(run_dir.read_metrics())

    def steps(self, rows: list[dict]) -> None:
        """Print the rows of ``rows`` not printed yet, then the figures if a measured step was among them."""
        new = [r for r in rows if r["step"] not in self.printed]
        for row in new:
            self.out(step_line(row, self.clock() - self.t0))
            self.printed.add(row["step"])
        measured = [r for r in rows if self.first <= r["step"] <= self.last]
        if self.figures is not None and measured and any(self.first <= r["step"] <= self.last for r in new):
            self.out(f"{stamp(self.clock() - self.t0)} figures of measured steps "
                     f"{measured[0]['step']}..{measured[-1]['step']} so far:")
            for line in self.figures(measured):
                self.out(line)


def recovery_lines(recovered: list[dict], history: list[dict], measured: list[dict]) -> list[str]:
    """The recovery after the bench's SIGKILL: its time, phases and the steps it replayed, and the
    failed step's retry against the measured steps (a restarted process compiles its decode step
    again: the retry's time is the rest of what the SIGKILL cost)."""
    if not recovered:
        return ["recovery: none recorded (the SIGKILL did not fail a step?)"]
    lines = []
    rows = {r["step"]: r for r in history}
    usual = statistics.median(r["timing/step_s"] for r in measured) if measured else None
    for e in recovered:
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in (e.get("phases") or {}).items())
        lines.append(f"recovery after a SIGKILL of the actor worker: {e['duration_s']:.2f} s to the failed step's "
                     f"retry, {e['steps_replayed']} steps replayed" + (f" ({phases})" if phases else ""))
        retry = rows.get(e["failed_step"])
        if retry is not None:
            against = f" against a median {usual:.1f} s of the measured steps" if usual else ""
            lines.append(f"  the retried step {e['failed_step']}: {retry['timing/step_s']:.1f} s (generation "
                         f"{retry.get('timing/gen_s', 0.0):.1f} s, {retry.get('perf/decode_compiles', 0.0):.0f} "
                         f"decode-step compiles){against}")
    steps = [r["step"] for r in history]
    lines.append(f"steps in the history: {steps[0]}..{steps[-1]}, each once: {len(steps) == len(set(steps))}")
    return lines
