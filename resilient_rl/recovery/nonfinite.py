"""The controller's guard against NaN and Inf: detect on the step, act per policy, spend a budget.

Where non-finite values are caught (each on the step it appears):

- **loss / gradient norm** (actor, critic): the workers check both before ``optimizer.step()``
  (all ranks take the same decision) and skip the poisoned mini-batch; the metrics row carries
  ``{role}/nonfinite_skipped``.
- **reward**: a NaN/Inf score is replaced by 0 (scored as a failed response) in the step;
  ``reward/nonfinite`` counts them.
- **kl**: a NaN/Inf KL leaves the adaptive coefficient unchanged (``actor/reward_kl_nonfinite``);
  the step's rewards are NaN, so its updates are skipped by the workers.
- **metric**: any other value of the row that is not finite.
- **checkpoint**: a worker's saved tensors or the controller's state not finite: the save is
  refused by :class:`~resilient_rl.checkpoint.coordinator.CheckpointCoordinator`, never committed.

What happens then is ``trainer.nonfinite``:

- ``skip`` (default): the poisoned updates were not applied; the run carries on.
- ``rollback``: restore the newest *known-good* checkpoint (its manifest says no NaN was met in
  the interval before it; the initial weights when there is none) and go on with the *next* data,
  since replaying the same batch reproduces the same NaN. A zeroed reward needs no rollback.
- ``raise``: stop at once with a :class:`~resilient_rl.errors.NonFiniteError`.

Budget: ``trainer.max_nonfinite`` steps with non-finite values in a row are tolerated; the next
stops the run with a NonFiniteError naming the step and the quantities. "In a row" ends with a
clean step, or, once the run has rolled back, only with a known-good checkpoint committed (clean
steps after a rollback prove nothing while the same fault can come back). Every occurrence is an event
``nonfinite`` (step, quantity, role, action, count) and counts in ``rrl_nonfinite_total``.
The guard's counters are not checkpointed: a resumed run starts with a fresh budget.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

from resilient_rl.errors import NonFiniteError

logger = logging.getLogger(__name__)

#: Metrics-row key -> (quantity, role) of the counters the step and the workers report.
COUNTERS: dict[str, tuple[str, str | None]] = {
    "reward/nonfinite": ("reward", None),
    "actor/reward_kl_nonfinite": ("kl", None),
    "actor/nonfinite_skipped": ("loss", "actor"),
    "critic/nonfinite_skipped": ("loss", "critic"),
}
ACTIONS = ("skipped", "zeroed", "rolled_back", "raised", "refused", "reported")


@dataclass(frozen=True)
class Finding:
    """One kind of non-finite value met in a step."""

    quantity: str
    role: str | None
    count: float


def find_nonfinite(row: Mapping[str, Any]) -> list[Finding]:
    """The non-finite values a metrics row reports: the counters above, and any value that is
    itself NaN or Inf (``metric``)."""
    found = [Finding(q, role, float(row[k])) for k, (q, role) in COUNTERS.items()
             if k in row and float(row[k]) > 0]
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad and not found:  # a NaN loss mean is the symptom of a counted cause, not a new one
        found.append(Finding("metric", ",".join(sorted(bad))[:200], float(len(bad))))
    return found


class NonFiniteGuard:
    """Applies ``trainer.nonfinite`` to each step's row of a :class:`PPOTrainer`."""

    def __init__(self, trainer):
        tc = trainer.cfg.trainer
        self.trainer = trainer
        self.mode = tc.nonfinite
        self.budget = tc.max_nonfinite
        self.in_a_row = 0       # steps with non-finite values, see the module docstring
        self.dirty = False      # a non-finite value met since the last save started
        self.awaiting_good = False  # rolled back; only a known-good commit ends the row
        self.total = 0          # steps with non-finite values in this process

    # ------------------------------------------------------------------ reporting
    def _report(self, step: int, finding: Finding, action: str) -> None:
        tr = self.trainer
        tr.run_dir.event("nonfinite", step=step, quantity=finding.quantity, role=finding.role, action=action,
                         count=finding.count)
        logger.warning("step %d: non-finite %s%s (%g) -> %s", step, finding.quantity,
                       f" ({finding.role})" if finding.role else "", finding.count, action)

    def _action(self, finding: Finding) -> str:
        if self.mode == "raise":
            return "raised"
        if finding.quantity == "reward":
            return "zeroed"  # replaced in the step: nothing poisoned reached the state
        if self.mode == "rollback":
            return "rolled_back"
        return "skipped" if finding.quantity in ("loss", "kl") else "reported"

    # ------------------------------------------------------------------ hooks from the trainer
    def after_step(self, row: Mapping[str, Any]) -> bool:
        """Handle step ``row``; True when its state stands (checkpoint as usual), False after a
        rollback. Raises NonFiniteError per policy or when the budget is spent."""
        findings = find_nonfinite(row)
        if not findings:
            if not self.awaiting_good:
                self.in_a_row = 0
            return True
        step = int(row["step"])
        self.dirty = True
        self.total += 1
        self.in_a_row += 1
        what = ", ".join(f"{f.quantity}{f'/{f.role}' if f.role else ''}" for f in findings)
        over = self.in_a_row > self.budget
        actions = {f: ("raised" if over else self._action(f)) for f in findings}
        for f, action in actions.items():
            self._report(step, f, action)
        if over or self.mode == "raise":
            why = (f"{self.in_a_row} step(s) in a row with NaN/Inf (trainer.max_nonfinite={self.budget})"
                   if over else "trainer.nonfinite=raise")
            raise NonFiniteError(f"step {step}: non-finite {what}; stopping: {why}; the last committed "
                                 f"checkpoint is step {self.trainer.ckpt.last_committed}")
        if "rolled_back" in actions.values():
            self.rollback(step, what)
            return False
        return True

    def on_checkpoint_event(self, kind: str, fields: Mapping[str, Any]) -> None:
        """A refused save counts as a step with non-finite state; a known-good commit ends a row."""
        if kind == "checkpoint_refused":
            self.dirty = True
            self.in_a_row += 1
        elif kind == "checkpoint_committed" and fields.get("known_good") is not False:
            self.in_a_row = 0
            self.awaiting_good = False

    def take_known_good(self) -> bool:
        """Whether the save starting now is known good; starts a new interval."""
        good, self.dirty = not self.dirty, False
        return good

    # ------------------------------------------------------------------ rollback
    def rollback(self, step: int, what: str) -> None:
        """Restore the newest known-good checkpoint (or the initial weights) and keep the data
        position: the next step trains on the batch after the poisoned one."""
        tr = self.trainer
        if not tr.checkpoints_on:
            raise NonFiniteError(f"step {step}: non-finite {what}; trainer.nonfinite=rollback needs the Ray "
                                 "roles (checkpoints), use skip or raise with local roles")
        position = tr.loader.state_dict()
        tr.ckpt.wait(tr.roles)  # a save in flight commits first (or is refused if not finite)
        state = tr.ckpt.restore(tr.roles, "known_good")
        if state is None:
            tr.roles.init_models()  # no known-good checkpoint: back to the initial weights
            tr.state.load_state_dict(tr.initial_state)  # the data position is set back below
        else:
            tr.load_state_dict(state)
        tr.loader.load_state_dict(position)
        tr.roles.sync_weights(tr.step)
        tr.run_dir.truncate_metrics_after(tr.step)
        tr.history = tr.run_dir.read_metrics()
        if tr.snapshots is not None:  # the steps after the rollback point are not this timeline's
            tr.snapshots.drop_after(tr.step)
        self.dirty = False
        self.awaiting_good = True
        tr.run_dir.event("nonfinite_rollback", failed_step=step, restored_step=tr.step, quantity=what)
        logger.warning("step %d: non-finite %s; rolled back to step %d, continuing with the next data",
                       step, what, tr.step)
