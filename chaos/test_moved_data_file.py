"""A run whose prompt file moved (another mount point) resumes, and a rank killed after the resume
is recovered from the run's own checkpoint: the config digest covers the path, so every
checkpoint before the move carries another digest than the resumed run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from suite import STORAGE_ONLY
from resilient_rl.faults.harness import check_invariants
from resilient_rl.faults.injectors import FaultSchedule


def _prompts(folder: Path) -> Path:
    folder.mkdir(parents=True)
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{n}=", "answer": str(n)}) + "\n" for n in range(10, 74)))
    return path


@pytest.mark.slow  # three runs; in process: tests/test_resume_moved_files.py (a resume, two recoveries)
def test_a_run_resumed_with_its_data_file_moved_recovers_from_its_own_checkpoint(chaos_dir, chaos_run):
    mount = Path(chaos_dir) / "moved-data"
    old = _prompts(mount / "mnt-a")
    # Colocated roles: two processes to start per run, not five (three runs here).
    colocated = ("trainer.placement=colocated", *(f"{role}.world_size=null" for role in ("critic", "ref", "rollout")))
    data = ("data.reward_fn=exact_match", "rollout.max_new_tokens=3", *colocated, *STORAGE_ONLY)
    reference = chaos_run(None, f"data.path={old}", *data, name="moved-data-reference")
    assert reference.error is None, reference.error
    first = chaos_run(None, f"data.path={old}", *data, "trainer.total_steps=2", name="moved-data")
    assert first.error is None and first.committed == [2], (first.error, first.committed)
    (mount / "mnt-a").rename(mount / "mnt-b")
    # Resumed from step 2 (before the move), it saves step 4 itself; a rank dies at the start of step 6.
    schedule = FaultSchedule().at_step(6).kill("actor", 1)
    result = chaos_run(schedule, f"data.path={mount / 'mnt-b' / 'prompts.jsonl'}", *data, name="moved-data")
    check_invariants(result, reference)
    recovered = result.events_of("recovered")
    assert recovered[0]["source"] == "checkpoint" and recovered[0]["restored_step"] == 4, recovered
