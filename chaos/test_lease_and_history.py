"""The run's lease and history under faults: lease storage flapping mid-run is survived; a
checkpoint of a newer format stops the resume without touching the run.

- Flapping: every read of the checkpoint lease fails (past the storage retries) from step 3 on,
  until a dozen reads have failed; the per-step lease check waits it out and the run ends
  identical to the fault-free run (before, the first failed read ended the run with exit 4).
- Newer format: a finished run's newest manifest claims a newer ``format_version``; resuming it
  stops with an error naming the version and the upgrade, and leaves the run folder and every
  committed step as they were (before, it was skipped as corrupt and the run went on from an
  older step, setting the newer one aside).
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from suite import chaos_overrides, storage_overrides
from resilient_rl.checkpoint import Storage
from resilient_rl.config.schema import load_config
from resilient_rl.errors import CheckpointFormatError
from resilient_rl.faults.harness import check_invariants, run_training
from resilient_rl.faults.storage import FaultPlan
from resilient_rl.trainer.hooks import TrainerHook
from resilient_rl.trainer.ppo import PPOTrainer


class _FlapLease(TrainerHook):
    """From the start of ``step``, the lease's reads fail until ``failures`` have been injected."""

    def __init__(self, step: int, failures: int):
        self.step, self.failures = step, failures
        self.injected = 0
        self._watch: threading.Thread | None = None

    def on_step_start(self, trainer, step):
        if step != self.step or self._watch is not None:
            return
        fs = trainer.ckpt.manager.storage.fs
        start = len(fs.injected)
        fs.plan.outage_reads = "/lease"

        def watch():
            while len(fs.injected) - start < self.failures:
                threading.Event().wait(0.02)
            fs.plan.outage_reads = ""
            self.injected = len(fs.injected) - start

        self._watch = threading.Thread(target=watch, daemon=True)
        self._watch.start()


def test_lease_storage_flapping_mid_run_is_survived(reference, chaos_ray, chaos_dir):
    name = "flapping"  # no "/lease" in any other path of the run
    flap = _FlapLease(step=3, failures=12)
    extra = storage_overrides(chaos_dir, name, FaultPlan())
    result = run_training(chaos_overrides(chaos_dir) + extra, name, hooks=(flap,))
    check_invariants(result, reference, expect_recoveries=0)
    assert flap.injected >= 12, "the lease's storage never failed"
    assert not result.events_of("failure")


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_newer_format_checkpoint_stops_the_resume_untouched(reference, chaos_ray, chaos_dir):
    name = "newer-format"
    root = Path(chaos_dir)
    # The finished reference run, as if a newer resilient-rl had written its last step.
    shutil.copytree(root / "ckpt" / "reference", root / "ckpt" / name)
    shutil.copytree(root / "runs" / "reference", root / "runs" / name)
    newest = reference.committed[-1]
    manifest = root / "ckpt" / name / f"step_{newest:08d}" / "MANIFEST.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 2}))
    before = {p: _tree(p) for p in (root / "ckpt" / name, root / "runs" / name)}

    cfg = load_config(None, chaos_overrides(chaos_dir) + ["trainer.total_steps=8", f"trainer.run_name={name}"])
    trainer = PPOTrainer(cfg)
    try:
        with pytest.raises(CheckpointFormatError) as info:
            trainer.fit()
    finally:
        trainer.shutdown()
    message = str(info.value)
    assert "format_version 2" in message and "pip install -U resilient-rl" in message
    after = {p: _tree(p) for p in before}
    ckpt, runs = root / "ckpt" / name, root / "runs" / name
    changed = {k for k in set(before[ckpt]) | set(after[ckpt]) if before[ckpt].get(k) != after[ckpt].get(k)}
    assert {k for k in changed if not k.startswith("lease/")} == set(), changed  # nothing set aside or written
    assert after[runs]["metrics.jsonl"] == before[runs]["metrics.jsonl"]  # no history cut
    assert not any(k.startswith("abandoned/") for k in after[runs])
    assert Storage(str(root / "ckpt")).exists(f"{name}/step_{newest:08d}/MANIFEST.json")
