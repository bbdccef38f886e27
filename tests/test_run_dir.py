"""The run folder survives a writer killed mid-append; restores cut the history without rewriting it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from resilient_rl.errors import RunFolderError
from resilient_rl.run.info import reward_summary
from resilient_rl.trainer.ppo import HISTORY_WINDOW
from resilient_rl.run.folder import RunDir


def _rows(n: int) -> list[dict]:
    return [{"step": s, "reward/mean": s / 10, "x": 0.1 * s} for s in range(1, n + 1)]


def _filled(tmp_path, n: int) -> RunDir:
    rd = RunDir(str(tmp_path), "run")
    for row in _rows(n):
        rd.append_metrics(row)
    return rd


def _tear(path, nbytes: int = 7) -> None:
    """What a kill in the middle of an append leaves: part of a line, no newline."""
    with open(path, "ab") as f:
        f.write(b'{"step": 99, "reward/mean": 0.12345'[:nbytes])


def test_torn_tail_is_skipped_with_a_warning(tmp_path, caplog):
    rd = _filled(tmp_path, 3)
    _tear(rd.metrics_path, 20)
    with caplog.at_level(logging.WARNING, logger="resilient_rl.run.folder"):
        assert rd.read_metrics() == _rows(3)
    assert "torn last line" in caplog.text and str(rd.metrics_path) in caplog.text


def test_a_terminated_line_that_is_not_json_is_an_error_naming_file_and_line(tmp_path):
    rd = _filled(tmp_path, 3)
    text = rd.metrics_path.read_text().splitlines()
    text[1] = text[1][:10]
    rd.metrics_path.write_text("\n".join(text) + "\n")
    with pytest.raises(RunFolderError, match=r"metrics\.jsonl: line 2 is not valid JSON"):
        rd.read_metrics()


def test_resume_after_a_torn_tail_truncates_and_appends_cleanly(tmp_path):
    rd = _filled(tmp_path, 4)
    _tear(rd.metrics_path)
    again = RunDir(str(tmp_path), "run")  # a new process resuming the run
    assert again.truncate_metrics_after(2) == 2
    again.append_metrics({"step": 3, "reward/mean": 0.3, "x": 0.30000000000000004})
    assert again.read_metrics() == _rows(3)


def test_first_append_after_a_crash_cuts_the_torn_tail(tmp_path):
    rd = _filled(tmp_path, 2)
    _tear(rd.metrics_path)
    _tear(rd.events_path)
    again = RunDir(str(tmp_path), "run")
    again.append_metrics(_rows(3)[2])
    again.event("checkpoint_started", step=3, stall_s=0.1)
    assert again.read_metrics() == _rows(3)
    assert [e["event"] for e in again.read_events()] == ["checkpoint_started"]


def test_truncate_keeps_the_prefix_bytes_and_never_rewrites_them(tmp_path):
    rd = _filled(tmp_path, 50)
    before = rd.metrics_path.read_bytes()
    inode = os.stat(rd.metrics_path).st_ino
    assert rd.truncate_metrics_after(30) == 20  # rows dropped
    after = rd.metrics_path.read_bytes()
    assert before.startswith(after) and len(after) < len(before)
    assert os.stat(rd.metrics_path).st_ino == inode, "cut in place, not replaced by a rewritten copy"
    assert [r["step"] for r in rd.read_metrics()] == list(range(1, 31))
    assert rd.truncate_metrics_after(0) == 30 and rd.metrics_path.read_bytes() == b""


def test_appends_are_single_writes_of_whole_lines(tmp_path):
    """Two processes appending long rows at once never interleave inside a line. (Each skips the
    first append's cut of a torn tail: a run has one writer, and here the other writer's line in
    progress would look torn.)"""
    rd = RunDir(str(tmp_path), "run")
    code = ("import sys; from resilient_rl.run.folder import RunDir\n"
            "rd = RunDir(sys.argv[1], 'run')\n"
            "rd._repaired.add(rd.metrics_path)\n"
            "for i in range(200): rd.append_metrics({'step': i, 'who': sys.argv[2], 'pad': sys.argv[2] * 20000})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), who], env=env) for who in "ab"]
    for p in procs:
        assert p.wait(timeout=120) == 0
    rows = rd.read_metrics()
    assert len(rows) == 400 and all(r["pad"] == r["who"] * 20000 for r in rows)


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 16])
def test_lines_read_backward_are_the_lines_read_forward_reversed(tmp_path, block):
    from resilient_rl.jsonl import iter_lines, iter_lines_backward

    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"a": 1}\n\n' + b'{"long": "' + b"x" * 300 + b'"}\n{"b": 2}\n{"torn": ')
    assert list(iter_lines_backward(path, block=block)) == list(iter_lines(path))[::-1]
    path.write_bytes(b"")
    assert list(iter_lines_backward(path, block=block)) == []


def test_a_rollback_reads_the_end_of_a_long_history_only(tmp_path):
    """The rows a rollback drops and the rows it keeps in memory are read from the file's end: a
    damaged line early in a long history (never read) does not stop it, where a read from the
    start would have raised on it."""
    rd = _filled(tmp_path, 2000)
    text = rd.metrics_path.read_bytes().split(b"\n")
    text[1] = b"not json"
    rd.metrics_path.write_bytes(b"\n".join(text))
    _tear(rd.metrics_path)
    assert rd.truncate_metrics_after(1990) == 10
    assert [r["step"] for r in rd.read_metrics(last=3)] == [1988, 1989, 1990]
    with pytest.raises(RunFolderError, match=r"metrics\.jsonl: line 2 is not valid JSON"):
        rd.read_metrics()


def test_read_metrics_last_and_column(tmp_path):
    rd = _filled(tmp_path, 30)
    assert [r["step"] for r in rd.read_metrics(last=3)] == [28, 29, 30]
    assert rd.read_column("reward/mean") == [r["reward/mean"] for r in _rows(30)]
    assert reward_summary(rd.read_column("reward/mean")) == reward_summary(_rows(30)) == pytest.approx((0.2, 2.9))


def test_history_window_is_bounded(tmp_path):
    from resilient_rl.config.schema import load_config
    from resilient_rl.trainer.ppo import PPOTrainer

    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", f"checkpoint.root={tmp_path}/ckpt",
                             "telemetry.enabled=false"])
    trainer = PPOTrainer(cfg)
    for row in _rows(HISTORY_WINDOW + 5):
        trainer.history.append(row)
    assert len(trainer.history) == HISTORY_WINDOW and trainer.history[0]["step"] == 6
