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

The guard's counters are part of the controller's state (``nonfinite`` in ``trainer_state.json``
and in every snapshot): a recovery or a resume that rolls the run back to a step rolls them back
too, so a replayed step that meets the same NaN counts it once, as the run without the failure
did, and spends the budget once. A rollback *past a NaN* keeps them (as it keeps the data
position): that rollback is part of the run's own timeline, and rewinding the budget there would
let the same fault roll the run back forever. ``rrl_nonfinite_total`` is a Prometheus counter and
never goes back: like ``rrl_tokens_total`` it counts what this process met, replayed steps included.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from resilient_rl.errors import NonFiniteError
from resilient_rl.events import AnyEvent
from resilient_rl.events.kinds import CheckpointCommitted, CheckpointRefused

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


@dataclass(frozen=True)
class Verdict:
    """A step's verdict: true when its state stands; else ``roll_back`` names the non-finite
    quantities and the trainer rolls the run back past the step."""

    roll_back: str | None = None

    def __bool__(self) -> bool:
        return self.roll_back is None


STANDS = Verdict()


class NonFiniteGuard:
    """Applies ``trainer.nonfinite`` to each step's metrics row; the trainer acts on its answer.

    Args:
        cfg: the ``trainer`` config section (``nonfinite``, ``max_nonfinite``).
        emit: ``emit(kind, **fields)`` records an event of the run.
        can_roll_back: whether the run's roles save checkpoints (a rollback restores one).
        last_committed: returns the newest committed step (None: none), read when state is loaded.
    """

    def __init__(self, cfg, emit: Callable[..., None], can_roll_back: bool,
                 last_committed: Callable[[], int | None] = lambda: None):
        self.mode = cfg.nonfinite
        self.budget = cfg.max_nonfinite
        self.emit = emit
        self.can_roll_back = can_roll_back
        self.in_a_row = 0       # steps with non-finite values, see the module docstring
        self.dirty = False      # a non-finite value met since the last save started
        self.awaiting_good = False  # rolled back; only a known-good commit ends the row
        self.total = 0          # steps with non-finite values in the run's timeline
        # The save started and not yet settled, as (step, known good); see load_state_dict.
        self.saving: tuple[int, bool] | None = None
        self.last_committed = last_committed

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The counters as of now (JSON), for checkpoints and snapshots."""
        return {"in_a_row": self.in_a_row, "dirty": self.dirty, "awaiting_good": self.awaiting_good,
                "total": self.total, "saving": None if self.saving is None else list(self.saving)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the counters of the point the run rolled back to.

        A state is taken while the save of its step (or an earlier one) is in flight; when that
        save has committed since (it is the checkpoint being restored, or was committed after the
        snapshot was taken), its commit ends a row here as it did the first time: a checkpoint is
        loaded only once committed, and its commit event is not heard again."""
        self.in_a_row = int(state["in_a_row"])
        self.dirty = bool(state["dirty"])
        self.awaiting_good = bool(state["awaiting_good"])
        self.total = int(state["total"])
        saving = state.get("saving")
        self.saving = None if saving is None else (int(saving[0]), bool(saving[1]))
        committed = self.last_committed()
        if self.saving is not None and committed is not None and committed >= self.saving[0]:
            self._committed(self.saving[1])

    # ------------------------------------------------------------------ reporting
    def _report(self, step: int, finding: Finding, action: str) -> None:
        self.emit("nonfinite", step=step, quantity=finding.quantity, role=finding.role, action=action,
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

    # ------------------------------------------------------------------ the trainer asks
    def after_step(self, row: Mapping[str, Any], last_committed: int | None = None) -> Verdict:
        """Judge step ``row``: :data:`STANDS` (checkpoint as usual), or a verdict naming what was
        non-finite, and the trainer rolls back (then calls :meth:`rolled_back`). Raises
        NonFiniteError per policy or when the budget is spent (naming ``last_committed``)."""
        findings = find_nonfinite(row)
        if not findings:
            if not self.awaiting_good:
                self.in_a_row = 0
            return STANDS
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
                                 f"checkpoint is step {last_committed}")
        if "rolled_back" not in actions.values():
            return STANDS
        if not self.can_roll_back:
            raise NonFiniteError(f"step {step}: non-finite {what}; trainer.nonfinite=rollback needs the Ray "
                                 "roles (checkpoints), use skip or raise with local roles")
        return Verdict(roll_back=what)

    def rolled_back(self, failed_step: int, restored_step: int, what: str) -> None:
        """The trainer rolled back to the newest known-good checkpoint (or the start) after
        ``failed_step``, keeping the data position: the next step trains on the batch after the
        poisoned one."""
        self.dirty = False
        self.awaiting_good = True
        self.emit("nonfinite_rollback", failed_step=failed_step, restored_step=restored_step, quantity=what)
        logger.warning("step %d: non-finite %s; rolled back to step %d, continuing with the next data",
                       failed_step, what, restored_step)

    def on_checkpoint_event(self, event: AnyEvent) -> None:
        """A refused save counts as a step with non-finite state; a known-good commit ends a row."""
        if not isinstance(event, (CheckpointRefused, CheckpointCommitted)):
            return
        if self.saving is not None and self.saving[0] == event.step:  # the save in flight has settled
            self.saving = None
        if isinstance(event, CheckpointRefused):
            self.dirty = True
            self.in_a_row += 1
        else:
            self._committed(event.known_good is not False)

    def _committed(self, known_good: bool) -> None:
        if known_good:
            self.in_a_row = 0
            self.awaiting_good = False

    def take_known_good(self, step: int) -> bool:
        """Whether the save of ``step`` starting now is known good; starts a new interval. Call it
        before the state saved with the checkpoint is taken, which then says the save is in flight."""
        good, self.dirty = not self.dirty, False
        self.saving = (step, good)
        return good
