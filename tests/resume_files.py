"""What tests/test_resume_moved_files.py and test_resume_files_in_place.py share: a prompt file, the
overrides that resume a :class:`~resilient_rl.testing.run_folder.FakeRun`, the warnings logged."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from resilient_rl.testing.run_folder import FakeRun

TINY_TOKENIZER = Path(__file__).resolve().parents[1] / "resilient_rl" / "data" / "tiny_tokenizer"
ANSWERS = tuple(str(n) for n in range(10, 74))  # one batch of data.batch_size (64)


def prompts(path: Path, answers=ANSWERS) -> Path:
    """A prompt file at ``path``: one prompt per answer."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": f"{a}=", "answer": a}) + "\n" for a in answers))
    return path


def resume_args(run: FakeRun, base: Path) -> list[str]:
    """The overrides that resume ``run`` (written under ``base``) as it was trained."""
    return [f"trainer.run_name={run.name}", f"trainer.output_dir={base / 'runs'}", f"checkpoint.root={base / 'ckpt'}",
            f"trainer.total_steps={run.total_steps}", f"checkpoint.save_every={run.save_every}"]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
