"""Each way a command can end has its own exit code (README "Exit codes")."""

from __future__ import annotations

import pytest

from resilient_rl import cli
from resilient_rl.errors import (CheckpointCorruptError, CheckpointError, CheckpointNotFoundError,
                                 CheckpointTimeoutError, ConfigError, RecoveryError, StorageError, UserCodeError,
                                 WorkerDiedError)


def test_exit_codes_are_distinct():
    codes = [cli.EXIT_OK, cli.EXIT_CORRUPT, cli.EXIT_ERROR, cli.EXIT_RECOVERY, cli.EXIT_RUNTIME, cli.EXIT_INTERNAL,
             cli.EXIT_INTERRUPTED, cli.EXIT_PREEMPTED]
    assert len(set(codes)) == len(codes) and codes[:3] == [0, 1, 2]


@pytest.mark.parametrize("exc, code", [
    (CheckpointCorruptError("x"), cli.EXIT_CORRUPT), (ConfigError("x"), cli.EXIT_ERROR),
    (CheckpointNotFoundError("x"), cli.EXIT_ERROR), (RecoveryError("x"), cli.EXIT_RECOVERY),
    (StorageError("x"), cli.EXIT_RUNTIME), (WorkerDiedError("x"), cli.EXIT_RUNTIME),
    (CheckpointError("weights do not fit"), cli.EXIT_ERROR), (CheckpointTimeoutError("x"), cli.EXIT_RUNTIME),
    (KeyboardInterrupt(), cli.EXIT_INTERRUPTED), (TypeError("x"), cli.EXIT_INTERNAL),
    (UserCodeError("data.reward_fn raised"), cli.EXIT_RUNTIME),
])
def test_exit_code_of_each_error(exc, code):
    assert cli.exit_code(exc) == code


@pytest.mark.parametrize("raised, code, says", [
    (CheckpointCorruptError("/ck/run/step_00000002/actor/shard_00000.json: sha256 mismatch"), 1,
     "resilient-rl: corrupt: /ck/run/step_00000002/actor/shard_00000.json: sha256 mismatch"),
    (RecoveryError("giving up: budget spent"), 3, "resilient-rl: error: giving up"),
    (ZeroDivisionError("division by zero"), 70, "internal error (ZeroDivisionError"),
])
def test_main_maps_errors_to_codes(monkeypatch, capsys, raised, code, says):
    import resilient_rl.checkpoint.inspect as export

    def boom(*_a, **_k):
        raise raised
    monkeypatch.setattr(export, "inspect_run", boom)
    assert cli.main(["-q", "checkpoints", "list", "some-run"]) == code
    err = capsys.readouterr().err
    assert says in err
    assert ("Traceback" in err) == (code == 70)


def test_bad_config_is_exit_2_before_anything_starts(capsys):
    assert cli.main(["-q", "train", "actor.mini_batch_size=7"]) == 2
    assert "actor.mini_batch_size=7" in capsys.readouterr().err


@pytest.mark.parametrize("first,last,tail", [(0.1, 0.25, "(x2.5)"), (0.0, 0.25, "(+0.2500)"),
                                             (-0.5, -0.1, "(+0.4000)"), (0.0, 0.0, "(+0.0000)")])
def test_the_end_of_run_reward_line_never_prints_an_infinite_factor(first, last, tail):
    line = cli.reward_line(first, last)
    assert line.startswith(f"mean reward: first 10% of steps {first:.4f}, last 10% {last:.4f} ")
    assert line.endswith(tail) and "inf" not in line
