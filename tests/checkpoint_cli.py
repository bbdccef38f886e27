"""The checkpoint commands of the CLI as test_cli.py and test_cli_real_run.py call them: in this
process with their output read back, a ``checkpoints list|verify`` table parsed, and a tiny model
loaded from ``export``. Here rather than in resilient_rl.testing, whose layer sits below the CLI's
(tests/test_layers.py); pytest puts tests/ on the import path of the files in it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from safetensors.torch import load_file

from resilient_rl.cli import main
from resilient_rl.models.tiny import TinyCausalLM, TinyLMConfig


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``resilient-rl -q argv...`` in this process: its exit code, stdout and stderr (``capsys``: pytest's)."""
    code = main(["-q", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def checkpoint_table(out: str) -> dict[int, list[str]]:
    """{step: columns} of a checkpoints table (columns split on runs of 2+ spaces)."""
    rows = {}
    for line in out.splitlines():
        cols = re.split(r"\s{2,}", line.strip())
        if cols[0].isdigit():
            rows[int(cols[0])] = cols
    return rows


def load_tiny_export(out: Path) -> TinyCausalLM:
    """The loading recipe the README documents."""
    model = TinyCausalLM(TinyLMConfig(**json.loads((out / "config.json").read_text())))
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    return model.eval()
