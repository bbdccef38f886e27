"""``resilient-rl status RUN``: what an operator asks first about a run, from its folder.

:func:`gather_status` reads the run folder (:mod:`resilient_rl.run.info`) and the run's checkpoints
(through :func:`resilient_rl.checkpoint.inspect.inspect_run`, the reader of ``checkpoints list``)
into a :class:`RunStatus`: whether it runs or how it ended (and whether its controller process is
alive), step and rate, the newest committed checkpoint and its age, failures with their causes and
recoveries, goodput, and where its metrics are served. :meth:`RunStatus.format_text` is the
human view; :meth:`RunStatus.to_json` the one for scripts.

States: ``running`` (the recorded controller process is alive), ``running?`` (it runs on
another host, so it cannot be checked from here), ``stopped`` (the record says running but the
process is gone: the controller died without a clean exit), ``finished``, ``failed``,
``interrupted``, ``preempted`` (stopped by SIGTERM/SIGUSR1; the same command continues it), and ``unknown`` (no controller record: a run from before records existed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from resilient_rl.errors import RRLError
from resilient_rl.run.info import FailureEpisode, RunFiles, failure_episodes, goodput, last_write_time, open_run
from resilient_rl.run.record import controller_alive
from resilient_rl.telemetry.training_time import read_ledger

#: Steps whose mean duration is reported as the recent step time.
RECENT_STEPS = 10


@dataclass
class ControllerInfo:
    """The controller of the latest ``fit`` and whether it is alive (None: cannot tell from here)."""

    pid: int
    host: str
    started_at: float
    ended_at: float | None
    alive: bool | None


@dataclass
class CheckpointInfo:
    """The newest committed checkpoint of the run (``step`` None when there is none)."""

    root: str
    url: str | None = None
    step: int | None = None
    age_s: float | None = None
    check: str | None = None      # "ok" or why its files do not match the manifest (sizes only)
    committed: int = 0
    error: str | None = None      # the checkpoints could not be read
    lease: str | None = None      # who holds (or last held) the run's writer lease, and until when
    lease_live: bool | None = None


@dataclass
class MetricsEndpoint:
    """Where Prometheus finds the run: the file_sd targets file and the endpoints it lists."""

    targets_file: str
    urls: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    note: str | None = None


@dataclass
class RunStatus:
    """The answer to ``resilient-rl status RUN``."""

    run: str
    path: str
    state: str
    detail: str | None
    controller: ControllerInfo | None
    step: int | None
    total_steps: int | None
    last_step_s: float | None
    recent_step_s: float | None       # mean of the last RECENT_STEPS steps
    steps_per_min: float | None       # kept steps per minute of this fit's wall time, recoveries included
    last_write_age_s: float | None    # since the run last wrote a metrics row or an event
    checkpoint: CheckpointInfo
    failures: list[FailureEpisode]
    recoveries: int
    steps_replayed: int
    recovery_s: float
    goodput: float | None
    useful_s: float | None
    wall_s: float | None
    ettr: float | None                # over the run's whole life, from ettr.json (as of its last write)
    lost_s: dict[str, float]          # seconds lost by cause over the run's whole life
    metrics: MetricsEndpoint
    as_of: float                      # when the run folder was read (Unix time); ages count from here

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def format_text(self) -> str:
        lines = [f"run:         {self.run}  ({self.path})"]
        state = self.state + (f" ({self.detail})" if self.detail else "")
        c = self.controller
        if c is not None and c.ended_at is not None:
            state += (f"; controller pid {c.pid} on {c.host} ran {_dur(c.ended_at - c.started_at)}, "
                      f"ended {_ago(self.as_of - c.ended_at)}")
        elif c is not None:
            alive = {True: "alive", False: "not running", None: "cannot check from this host"}[c.alive]
            state += f"; controller pid {c.pid} on {c.host}, {alive}, started {_ago(self.as_of - c.started_at)}"
        lines.append(f"state:       {state}")
        if self.step is None:
            lines.append("step:        no step finished yet")
        else:
            total = f" / {self.total_steps}" if self.total_steps else ""
            parts = [f"{self.step}{total}"]
            if self.steps_per_min is not None:
                parts.append(f"{self.steps_per_min:.1f} steps/min")
            if self.recent_step_s is not None:
                parts.append(f"step time {self.last_step_s:.2f} s (mean of last {RECENT_STEPS}: "
                             f"{self.recent_step_s:.2f} s)")
            if self.last_write_age_s is not None:
                parts.append(f"last write {_ago(self.last_write_age_s)}")
            lines.append("step:        " + ", ".join(parts))
        lines.append("checkpoint:  " + self._checkpoint_text())
        if self.checkpoint.lease is not None:
            held = "held by" if self.checkpoint.lease_live else "last held by"
            lines.append(f"lease:       {held} {self.checkpoint.lease}")
        lines.extend(self._failure_lines())
        if self.goodput is not None:
            lines.append(f"goodput:     {self.goodput:.1%} (steps kept {_dur(self.useful_s)} of "
                         f"{_dur(self.wall_s)} wall time)")
        elif self.controller is None:
            lines.append("goodput:     unknown (no controller record)")
        else:
            lines.append("goodput:     unknown (training had not started)")
        if self.ettr is not None:
            lost = ", ".join(f"{cause} {_dur(s)}" for cause, s in sorted(self.lost_s.items(), key=lambda x: -x[1]))
            lines.append(f"ettr:        {self.ettr:.1%} over the run's life" + (f" (lost: {lost})" if lost else ""))
        m = self.metrics
        if m.urls:
            where = ", ".join(f"{u} ({n})" if n else u for u, n in zip(m.urls, m.nodes))
            lines.append(f"metrics:     {where}" + (f"  [{m.note}]" if m.note else ""))
        else:
            lines.append(f"metrics:     {m.note}")
        lines.append(f"             targets file: {m.targets_file}")
        return "\n".join(lines)

    def _checkpoint_text(self) -> str:
        ck = self.checkpoint
        if ck.error:
            return f"cannot read {ck.root}: {ck.error}"
        if ck.step is None:
            return f"none committed yet (under {ck.root})"
        check = "" if ck.check == "ok" else f", CHECK FAILED: {ck.check}"
        return f"step {ck.step}, committed {_ago(ck.age_s)}{check} ({ck.url}; {ck.committed} committed)"

    def _failure_lines(self) -> list[str]:
        if not self.failures:
            return ["failures:    none"]
        head = (f"failures:    {len(self.failures)}, {self.recoveries} recovered "
                f"({_dur(self.recovery_s)} recovering, {self.steps_replayed} step(s) replayed)")
        out = [head]
        for f in self.failures:
            if f.outcome == "recovered":
                what = (f"recovered in {f.recovery_s:.1f} s from step {f.restored_step}, "
                        f"replayed {f.steps_replayed}")
            elif f.outcome == "aborted":
                what = f"ABORTED: {f.abort_reason}"
            elif f.state is not None:  # a recovery in progress, or one the controller's end cut short
                what = f"no recovery recorded: the last state entered is {f.state}"
            else:
                what = "no recovery recorded"
            extra = []
            if f.restarted:  # the processes Ray restarted: the failed one, not only the rank that noticed
                extra.append("restarted " + ", ".join(f.restarted))
            if f.killed_unresponsive:
                extra.append("killed unresponsive " + ", ".join(f.killed_unresponsive))
            if f.failures_during_recovery:
                extra.append(f"{f.failures_during_recovery} more failure(s) during recovery")
            out.append(f"  step {f.step:<5} {f.cause:<10} {f.who:<16} {what}"
                       + (f"; {'; '.join(extra)}" if extra else ""))
            out.append(f"              {_clip(f.message, 100)}")
        return out


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 3] + "..."


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 60:
        return f"{s:.1f} s"
    m, s = divmod(int(s), 60)
    if m < 60:
        return f"{m}m {s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m"


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else f"{_dur(max(0.0, seconds))} ago"


def _state(run: RunFiles) -> tuple[str, str | None, ControllerInfo | None]:
    rec = run.controller
    if rec is None:
        return "unknown", "no controller.json: the controller of this run did not record itself", None
    alive = controller_alive(rec) if rec.state == "running" else False
    info = ControllerInfo(rec.pid, rec.host, rec.started_at, rec.ended_at, alive)
    if rec.state == "running":
        if alive is None:
            return "running?", f"controller on host {rec.host}", info
        if not alive:
            return "stopped", "controller not running: it exited without recording an end", info
        return "running", None, info
    if rec.state == "failed":
        return "failed", rec.reason, info
    if rec.state == "interrupted":
        return "interrupted", f"at step {rec.end_step}", info
    if rec.state == "preempted":
        return "preempted", rec.reason, info
    return "finished", None, info


def _checkpoint(run: RunFiles, root: str | None) -> CheckpointInfo:
    from resilient_rl.checkpoint.inspect import DEFAULT_ROOT, CheckpointLocation, inspect_run
    from resilient_rl.config.secrets import REDACTED, redact_text, without_redacted
    from resilient_rl.errors import CheckpointNotFoundError

    root = root or run.setting("checkpoint.root") or DEFAULT_ROOT
    info = CheckpointInfo(root=str(root))
    # Credentials were redacted when the config was saved: the storage is opened with this
    # user's own (environment, credential files), never with the "<redacted>" placeholder.
    options, redacted = without_redacted(run.setting("checkpoint.storage_options") or {},
                                         "checkpoint.storage_options")
    if REDACTED in str(root):
        info.error = (f"checkpoint.root {root} was saved with its credentials redacted; pass the root "
                      "(without credentials in it) with --root and the credentials through the environment")
        return info
    try:
        report = inspect_run(CheckpointLocation(str(root), run.name), deep=False, storage_options=options or None)
    except CheckpointNotFoundError:
        return info
    except (RRLError, OSError, ValueError) as exc:  # unreachable storage must not hide the rest
        info.error = redact_text(str(exc)) + (f" (the saved {', '.join(redacted)} were redacted; the storage was opened "
                                 "with this user's own credentials from the environment or credential files)"
                                 if redacted else "")
        return info
    if report.lease is not None:
        info.lease = report.lease.describe(run.read_at)
        info.lease_live = report.lease.live(run.read_at)
    newest = report.newest_committed()
    info.committed = sum(1 for r in report.rows if r.committed)
    if newest is not None:
        info.step, info.age_s, info.check = newest.step, newest.age_s, newest.status
        info.url = report.manager.step_dir(newest.step)
        try:  # age as of when the run folder was read, like every other age in the status
            info.age_s = max(0.0, run.read_at - report.manager.load_manifest(newest.step).created_at)
        except RRLError:
            pass  # a corrupt manifest: keep the listing's age (None), its check says why
    return info


def _endpoint(run: RunFiles, state: str) -> MetricsEndpoint:
    m = MetricsEndpoint(targets_file=str(run.targets_path))
    if run.targets is None:
        if not run.setting("telemetry.enabled", True):
            m.note = "not served (telemetry.enabled=false)"
        elif state in ("running", "running?"):
            m.note = "not published yet (the exporter starts with the workers)"
        else:
            m.note = "not served (the run is not running)"
        return m
    for group in run.targets:
        for target in group.get("targets", []):
            m.urls.append(f"http://{target}/metrics")
            m.nodes.append(str(group.get("labels", {}).get("node", "")))
    if state not in ("running", "running?"):
        m.note = "stale: the controller that served it is not running"
    return m


def gather_status(target: str, output_dir: str | None = None, checkpoint_root: str | None = None) -> RunStatus:
    """The status of the run named by ``target`` (a run name under ``output_dir`` or a folder path)."""
    run = open_run(target, output_dir)
    state, detail, controller = _state(run)
    rows = run.metrics
    step = int(rows[-1]["step"]) if rows else None
    times = [float(r["timing/step_s"]) for r in rows if "timing/step_s" in r]
    recent = times[-RECENT_STEPS:]
    last_write = last_write_time(run)
    # A dead controller stopped counting wall time when it last wrote, not now.
    until = last_write if state == "stopped" else None
    gp = goodput(run, until)
    rec = run.controller
    rate = None
    if gp is not None and step is not None and rec is not None and rec.start_step is not None and gp[2] > 0:
        rate = (step - rec.start_step) / gp[2] * 60
    episodes = failure_episodes(run.events, run.name)
    recovered = [f for f in episodes if f.outcome == "recovered"]
    total = run.setting("trainer.total_steps")
    ledger = read_ledger(run.path)
    ettr = (min(1.0, ledger["useful"][-1][1] / ledger["wall_s"])
            if ledger is not None and ledger["useful"] and ledger["wall_s"] > 0 else None)
    return RunStatus(
        run=run.name, path=str(run.path), state=state, detail=detail, controller=controller, step=step,
        total_steps=int(total) if total is not None else None,
        last_step_s=times[-1] if times else None, recent_step_s=sum(recent) / len(recent) if recent else None,
        steps_per_min=rate, last_write_age_s=None if last_write is None else max(0.0, run.read_at - last_write),
        checkpoint=_checkpoint(run, checkpoint_root), failures=episodes, recoveries=len(recovered),
        steps_replayed=sum(f.steps_replayed for f in recovered),
        recovery_s=sum(float(f.recovery_s or 0.0) for f in recovered),
        goodput=gp[0] if gp else None, useful_s=gp[1] if gp else None, wall_s=gp[2] if gp else None,
        ettr=ettr, lost_s=ledger["lost_s"] if ledger is not None else {}, metrics=_endpoint(run, state), as_of=run.read_at)
