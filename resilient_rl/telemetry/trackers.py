"""Experiment trackers: where a run's metrics and events go besides the run folder.

``trainer.loggers`` (verl's ``trainer.logger``) lists the backends:

- ``console``: a short summary line every ``trainer.log_every`` steps and a line per checkpoint
  restored or worker restarted, written through the progress bar. The full per-step line and a
  line per checkpoint committed go to ``train.log`` only, whatever the list holds.
- ``jsonl``: the run folder's ``metrics.jsonl`` and ``events.jsonl``. Always written, listed or not,
  because resume and recovery read them back.
- ``tensorboard``, ``wandb``, ``mlflow``: optional extras (``pip install 'resilient-rl[wandb]'``),
  imported only when chosen. Their files live under the run folder unless the library's own
  environment says otherwise (``WANDB_MODE``, ``MLFLOW_TRACKING_URI``).

Every tracker receives each step's metrics row and every run event (failure, worker_restarted,
recovered, checkpoint_committed, checkpoint_restored, aborted, ...) through one subscription on
:meth:`RunDir.subscribe`, so an event shows up in the trackers however it was produced. After a
recovery the replayed steps are logged again with the same step numbers.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from typing import Any, Callable, Protocol

from resilient_rl.errors import ConfigError
from resilient_rl.events import AnyEvent
from resilient_rl.log_route import FILE_ONLY
from resilient_rl.run.log import STEP_LOG

logger = logging.getLogger(__name__)

#: Names accepted in ``trainer.loggers``.
BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
#: Shown in the console summary when present, in this order: (metric, label).
SUMMARY_KEYS = (("reward/mean", "reward"), ("actor/pg_loss", "pg_loss"), ("critic/vf_loss", "vf_loss"),
                ("actor/ppo_kl", "ppo_kl"), ("actor/kl_loss", "kl_loss"), ("actor/entropy", "entropy"),
                ("val/reward_mean", "val_reward"), ("val/accuracy", "val_accuracy"))
#: Events the console reports (failures and recoveries are already logged as warnings where they happen).
CONSOLE_EVENTS = ("checkpoint_committed", "checkpoint_restored", "checkpoint_corrupt", "worker_restarted",
                  "kill_unresponsive", "kill_hung")
#: Of those, the ones every checkpoint makes: logged to train.log only (a long run would fill the
#: console with them; they are in events.jsonl too).
FILE_ONLY_EVENTS = ("checkpoint_committed",)
#: Events of every checkpoint: the full event log (wandb table, MLflow artifact) is rewritten for them
#: only with the next other event or at close, so a long run does not write one copy per checkpoint.
ROUTINE_EVENTS = ("checkpoint_started", "checkpoint_committed")
#: Rows of that event log: the newest events only. A week-long run makes tens of thousands, and the
#: log is rewritten whole each time; the run folder's events.jsonl holds every one of them, and the
#: ``events/<kind>`` counts count them all.
EVENT_LOG_ROWS = 1000


class Tracker(Protocol):
    """One destination for a run's metrics and events."""

    def log_metrics(self, step: int, row: dict[str, Any]) -> None: ...

    def log_event(self, step: int, kind: str, fields: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics row (the step itself excluded)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _require_extra(module: str, extra: str):
    """Import ``module`` for the ``extra`` backend, or raise a ConfigError naming the pip extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"trainer.loggers includes {extra!r} but {module.split('.')[0]!r} is not installed "
                          f"({exc}); install it with: pip install 'resilient-rl[{extra}]'") from exc


class ConsoleTracker:
    """A short summary every ``log_every`` steps (and at the last step) and checkpoint/restart lines."""

    def __init__(self, log_every: int, total_steps: int):
        self.log_every = log_every
        self.total_steps = total_steps

    def log_metrics(self, step: int, row: dict[str, Any]) -> None:
        if step % self.log_every and step != self.total_steps:
            return
        parts = [f"{label} {row[key]:.4g}" for key, label in SUMMARY_KEYS if key in row]
        if "timing/step_s" in row:
            parts.append(f"{row['timing/step_s']:.2f} s/step")
        logger.info("step %d/%d | %s", step, self.total_steps, " | ".join(parts))

    def log_event(self, step: int, kind: str, fields: dict[str, Any]) -> None:
        if kind in CONSOLE_EVENTS:
            level = logging.WARNING if kind == "checkpoint_corrupt" else logging.INFO
            logger.log(level, "%s %s", kind.replace("_", " "),
                       " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()),
                       extra=FILE_ONLY if kind in FILE_ONLY_EVENTS else None)

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """Scalars per step; each event as a text entry and an ``events/<kind>`` count at its step."""

    def __init__(self, log_dir: str):
        tb = _require_extra("torch.utils.tensorboard", "tensorboard")
        self.writer = tb.SummaryWriter(log_dir=log_dir)
        self.counts: dict[str, int] = {}

    def log_metrics(self, step: int, row: dict[str, Any]) -> None:
        for key, value in _scalars(row).items():
            self.writer.add_scalar(key, value, global_step=step)

    def log_event(self, step: int, kind: str, fields: dict[str, Any]) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.writer.add_scalar(f"events/{kind}", self.counts[kind], global_step=step)
        self.writer.add_text(f"events/{kind}", "`" + json.dumps(fields, default=str) + "`", global_step=step)
        self.writer.flush()  # events are rare and worth seeing at once

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run (``dir`` = the run folder); the step is the ``trainer/step`` metric, so replays plot right.

    wandb's own step must only grow, and a recovery replays steps, so every row carries
    ``trainer/step`` and all charts use it as their x axis. Events are ``events/<kind>`` counts
    and a table ``event_log`` (step, event, fields) of the newest ``EVENT_LOG_ROWS`` events, re-logged
    with each event (see ROUTINE_EVENTS).
    """

    def __init__(self, run_dir: str, project: str, name: str, config: dict, mode: str | None = None):
        wandb = _require_extra("wandb", "wandb")
        self.wandb = wandb
        try:
            # No system metadata (it holds the command line, sys.argv: a key given as an override
            # would be stored even with the config redacted) and no code capture.
            self.run = wandb.init(dir=run_dir, project=project, name=name, config=config, mode=mode,
                                  settings=wandb.Settings(silent=True, console="off", x_disable_meta=True,
                                                          x_disable_machine_info=True, save_code=False,
                                                          disable_code=True, program="resilient-rl"))
        except Exception as exc:  # not logged in (no TTY to ask), no network, bad settings
            raise ConfigError(f"trainer.loggers: wandb could not start a run: {exc}; log in with `wandb login` "
                              "or set WANDB_MODE=offline (then `wandb sync` the run folder's wandb/ later)") from exc
        self.run.define_metric("trainer/step")
        self.run.define_metric("*", step_metric="trainer/step")
        self.counts: dict[str, int] = {}
        self.events: collections.deque[list] = collections.deque(maxlen=EVENT_LOG_ROWS)
        self.dirty = False  # events not yet in a logged event_log table

    def log_metrics(self, step: int, row: dict[str, Any]) -> None:
        self.run.log({**_scalars(row), "trainer/step": step})

    def log_event(self, step: int, kind: str, fields: dict[str, Any]) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.events.append([step, kind, json.dumps(fields, default=str)])
        row: dict[str, Any] = {f"events/{kind}": self.counts[kind], "trainer/step": step}
        self.dirty = kind in ROUTINE_EVENTS
        if not self.dirty:
            row["event_log"] = self._table()
        self.run.log(row)

    def _table(self):
        return self.wandb.Table(columns=["step", "event", "fields"], data=list(self.events))

    def close(self) -> None:
        if self.dirty:
            self.run.log({"event_log": self._table(), "trainer/step": self.events[-1][0]})
        self.run.finish()


class MlflowTracker:
    """An MLflow run: metrics by step, events as ``events/<kind>`` counts plus an ``events.jsonl``
    artifact of the newest ``EVENT_LOG_ROWS`` events.

    With no ``MLFLOW_TRACKING_URI`` the store is a local file store in the run folder (``mlruns/``),
    which needs no server and no network; mlflow keeps that backend only behind
    ``MLFLOW_ALLOW_FILE_STORE``, which is set for this process in that case.
    """

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, params: dict[str, Any]):
        mlflow = _require_extra("mlflow", "mlflow")
        from mlflow.entities import Metric, Param

        self._metric = Metric
        self.client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        flat = [Param(k, str(v)[:500]) for k, v in params.items()]
        for i in range(0, len(flat), 100):  # mlflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=flat[i:i + 100])
        self.counts: dict[str, int] = {}
        self.events: collections.deque[str] = collections.deque(maxlen=EVENT_LOG_ROWS)
        self.dirty = False  # events not yet in the events.jsonl artifact

    def _now_ms(self) -> int:
        import time

        return int(time.time() * 1000)

    def log_metrics(self, step: int, row: dict[str, Any]) -> None:
        now = self._now_ms()
        metrics = [self._metric(k, v, now, step) for k, v in _scalars(row).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_event(self, step: int, kind: str, fields: dict[str, Any]) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.client.log_metric(self.run_id, f"events/{kind}", self.counts[kind], self._now_ms(), step)
        self.events.append(json.dumps({"step": step, "event": kind, **fields}, default=str))
        self.dirty = kind in ROUTINE_EVENTS
        if not self.dirty:
            self._write_events()

    def _write_events(self) -> None:
        self.client.log_text(self.run_id, "\n".join(self.events) + "\n", "events.jsonl")

    def close(self) -> None:
        if self.dirty:
            self._write_events()
        self.client.set_terminated(self.run_id)


class TrackerSet:
    """The chosen trackers; forwards metrics and run events to each, with the step an event belongs to.

    An event's step is its ``step`` field (checkpoints, failures), else ``failed_step``
    (recoveries), else the last step logged.
    """

    def __init__(self, trackers: list[Tracker]):
        self.trackers = list(trackers)
        self.last_step = 0
        self._unsubscribe: Callable[[], None] | None = None
        self._closing = threading.Lock()

    def log_metrics(self, step: int, row: dict[str, Any]) -> None:
        """Send ``row`` to every tracker, and all its metrics as one line to ``train.log``."""
        self.last_step = step
        STEP_LOG.info("step %d %s", step, " ".join(f"{k}={v:.6g}" for k, v in _scalars(row).items()))
        for t in self.trackers:
            t.log_metrics(step, row)

    def log_event(self, event: AnyEvent) -> None:
        kind, fields = event.kind, event.payload()
        step = fields.get("step", fields.get("failed_step", self.last_step))
        step = step if isinstance(step, int) else self.last_step
        for t in self.trackers:
            try:
                t.log_event(step, kind, fields)
            except Exception:  # a tracker's hiccup must not break recovery, which emits most events
                logger.exception("tracker %s could not record event %s", type(t).__name__, kind)

    def attach(self, run_dir) -> "TrackerSet":
        """Receive every event the run folder records from now on."""
        self._unsubscribe = run_dir.subscribe(self.log_event)
        return self

    def close(self) -> None:
        """Close every tracker once, also where two threads close the set (the signal watch's end
        of a stuck run, and the main thread getting out of its call)."""
        with self._closing:
            unsubscribe, self._unsubscribe = self._unsubscribe, None
            trackers, self.trackers = self.trackers, []
        if unsubscribe is not None:
            unsubscribe()
        for t in trackers:
            try:
                t.close()
            except Exception:
                logger.exception("tracker %s did not close cleanly", type(t).__name__)


def validate_loggers(names: list[str]) -> None:
    """Raise a ConfigError naming ``trainer.loggers`` for an unknown backend."""
    for name in names:
        if name not in BACKENDS:
            raise ConfigError(f"trainer.loggers: unknown logger {name!r}; choose from {', '.join(BACKENDS)}")


#: The package each optional backend needs (its pip extra has the backend's name).
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_available(names: list[str]) -> None:
    """Fail early, before any worker starts, when a chosen backend's package is not installed."""
    import importlib.util

    for name in names:
        package = PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(f"trainer.loggers includes {name!r} but {package!r} is not installed; "
                              f"install it with: pip install 'resilient-rl[{name}]'")


def build_trackers(cfg, run_dir) -> TrackerSet:
    """The trackers ``cfg.trainer.loggers`` names, writing under ``run_dir``, subscribed to its events."""
    from resilient_rl import env

    t = cfg.trainer
    validate_loggers(list(t.loggers))
    made: list[Tracker] = []
    try:
        for name in dict.fromkeys(t.loggers):  # in order, once each
            if name == "console":
                made.append(ConsoleTracker(t.log_every, t.total_steps))
            elif name == "tensorboard":
                made.append(TensorBoardTracker(str(run_dir.path / "tensorboard")))
            elif name == "wandb":
                made.append(WandbTracker(str(run_dir.path), t.project_name, t.run_name, _flat_config(cfg)))
            elif name == "mlflow":
                uri = env.mlflow_tracking_uri()
                if uri is None:
                    uri = (run_dir.path / "mlruns").resolve().as_uri()
                    env.allow_mlflow_file_store()
                made.append(MlflowTracker(uri, t.project_name, t.run_name, _flat_config(cfg)))
    except BaseException:
        TrackerSet(made).close()
        raise
    return TrackerSet(made).attach(run_dir)


def _flat_config(cfg) -> dict[str, Any]:
    """The resolved config, credentials redacted (:func:`~resilient_rl.config.schema.redacted_config_dict`),
    as ``{"section.key": value}`` (hyperparameters for the trackers)."""
    from resilient_rl.config.schema import redacted_config_dict

    out: dict[str, Any] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj):
            for k, v in obj.items():
                walk(f"{prefix}{k}.", v)
        else:
            out[prefix[:-1]] = obj if isinstance(obj, (int, float, str, bool)) or obj is None else str(obj)

    walk("", redacted_config_dict(cfg))
    return out
