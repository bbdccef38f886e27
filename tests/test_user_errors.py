"""The user's mistakes are named as the user's: a folder that cannot be written, a setting past its
limit, a reward function that raises, a prompt the tokenizer cannot spell. Each ends with the README's
exit code for bad input (2) or a run-time failure (4), never 70 ("internal error, please report it").

Runs use the in-process roles (:class:`~resilient_rl.trainer.local_roles.LocalRoles`) and never
start Ray: what is checked here happens in the controller.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import pytest

from resilient_rl import cli
from resilient_rl.config.runtime import MAX_RUN_NAME
from resilient_rl.errors import UserCodeError
from resilient_rl.testing.run_folder import tree_state

SMALL = ["trainer.total_steps=1", "data.batch_size=4", "actor.mini_batch_size=4", "critic.mini_batch_size=4",
         "actor.world_size=1", "data.num_prompts=8", "checkpoint.save_every=0", "telemetry.enabled=false",
         "trainer.progress_bar=false", "model.hidden_size=16", "model.num_layers=1", "model.intermediate_size=32",
         "actor.ppo_epochs=1", "critic.ppo_epochs=1"]


@pytest.fixture
def in_process(monkeypatch):
    """``resilient-rl train`` with every role in this process and no Ray cluster."""
    import resilient_rl.runtime.cluster as cluster
    from resilient_rl.trainer import ppo
    from resilient_rl.trainer.local_roles import LocalRoles

    real = ppo.PPOTrainer.__init__

    def local(self, cfg, roles_factory=None, hooks=None):
        real(self, cfg, roles_factory=LocalRoles, hooks=hooks)
    monkeypatch.setattr(ppo.PPOTrainer, "__init__", local)
    monkeypatch.setattr(cluster, "connect", lambda _cfg: False)
    monkeypatch.setattr(cluster, "disconnect", lambda _owned: None)


def _train(tmp_path, *overrides: str) -> int:
    return cli.main(["-q", "train", *SMALL, f"trainer.output_dir={tmp_path / 'runs'}",
                     f"checkpoint.root={tmp_path / 'ckpt'}", *overrides])


def _unwritable(tmp_path):
    """A folder this process may not create anything in (as root, permissions do not stop it: /sys)."""
    if os.geteuid() == 0:
        return "/sys/rrl-unwritable/runs", "Operation not permitted"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return str(ro / "runs"), "Permission denied"


def test_an_unwritable_output_dir_is_bad_input_naming_the_path(tmp_path, capsys):
    output_dir, reason = _unwritable(tmp_path)
    assert cli.main(["-q", "train", f"trainer.output_dir={output_dir}", f"checkpoint.root={tmp_path / 'ckpt'}"]) == 2
    err = capsys.readouterr().err
    assert f"trainer.output_dir={output_dir!r}" in err and reason in err and "/rrl-unwritable" in err
    assert "internal error" not in err and "Traceback" not in err


@pytest.mark.parametrize("make", ["no_parent", "symlink_loop"])
def test_an_output_dir_that_cannot_exist_is_bad_input_naming_the_path(tmp_path, capsys, make):
    """A parent that cannot be created (mkdir says ENOENT: here inside /proc) or a symlink loop is
    the user's path, like an unwritable one: exit 2 naming trainer.output_dir, not 4 (run time)."""
    if make == "no_parent":
        output_dir, reason = "/proc/rrl-missing/runs", "No such file or directory"
    else:
        (tmp_path / "loop").symlink_to(tmp_path / "loop")
        output_dir, reason = str(tmp_path / "loop" / "runs"), "Too many levels of symbolic links"
    assert cli.main(["-q", "train", f"trainer.output_dir={output_dir}", f"checkpoint.root={tmp_path / 'ckpt'}"]) == 2
    err = capsys.readouterr().err
    assert f"trainer.output_dir={output_dir!r}" in err and "cannot create the run folder" in err and reason in err
    assert "internal error" not in err and "Traceback" not in err


def test_a_run_name_past_its_limit_is_refused_naming_the_key_and_the_limit(tmp_path, capsys):
    assert _train(tmp_path, "trainer.run_name=" + "r" * 300) == 2
    err = capsys.readouterr().err
    assert "trainer.run_name" in err and f"at most {MAX_RUN_NAME} characters" in err and "(300 characters)" in err
    assert "internal error" not in err and not (tmp_path / "runs").exists()
    assert _train(tmp_path, "trainer.run_name=" + "r" * MAX_RUN_NAME, "trainer.total_steps=0") == 2  # the limit passes
    assert "trainer.total_steps" in capsys.readouterr().err


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module ``user_rewards`` on sys.path whose ``score`` raises on one answer."""
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent("""\
        def helper(answer):
            return {"12": 1.0}[answer]  # KeyError for any other answer


        def score(response, answer):
            return helper(answer)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards:score"
    sys.modules.pop("user_rewards", None)


def test_a_reward_function_that_raises_is_named_with_its_own_traceback(tmp_path, capsys, in_process, user_module):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{n}=", "answer": str(n)}) + "\n" for n in (12, 34, 56, 78)))
    run = tmp_path / "runs" / "user-fn"
    code = _train(tmp_path, "trainer.run_name=user-fn", "data.task=jsonl", f"data.path={data}",
                  f"data.reward_fn={user_module}", "rollout.max_new_tokens=3")
    err = capsys.readouterr().err
    assert code == 4, err[-3000:]
    assert re.search(r"data.reward_fn='user_rewards:score' raised KeyError: '(34|56|78)' while scoring response", err)
    assert "user_rewards.py\", line 6, in score" in err and "line 2, in helper" in err  # the user's frames
    assert "tasks.py" not in err.split("raised KeyError", 1)[1]  # and none of ours
    assert "internal error" not in err
    assert json.loads((run / "controller.json").read_text())["state"] == "failed"


def test_a_reward_function_error_is_a_run_time_failure():
    assert cli.exit_code(UserCodeError("x")) == cli.EXIT_RUNTIME


def test_a_reward_module_that_fails_to_import_is_bad_input(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("import os\nvalue = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "12=", "answer": "12"}) + "\n")
    try:
        assert _train(tmp_path, "data.task=jsonl", f"data.path={data}", "data.reward_fn=broken_rewards:score") == 2
    finally:
        sys.modules.pop("broken_rewards", None)
    err = capsys.readouterr().err
    assert "importing module 'broken_rewards' raised ZeroDivisionError" in err and "line 2, in <module>" in err


def test_a_prompt_the_tokenizer_cannot_spell_is_bad_input_naming_file_and_row(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "12=", "answer": "12"}) + "\n"
                    + json.dumps({"prompt": "1Z=", "answer": "1"}) + "\n")
    run = tmp_path / "runs" / "alphabet"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = tree_state(run)
    assert _train(tmp_path, "trainer.run_name=alphabet", "data.task=jsonl", f"data.path={data}",
                  "data.reward_fn=exact_match") == 2
    err = capsys.readouterr().err
    assert f"{data}:2" in err and "'Z'" in err and "internal error" not in err
    assert tree_state(run) == before


def test_a_file_sd_path_that_cannot_be_written_is_named(tmp_path):
    from resilient_rl.errors import TelemetryError
    from resilient_rl.telemetry import FileSDWriter

    (tmp_path / "a-file").write_text("")
    writer = FileSDWriter(tmp_path / "a-file" / "targets.json")
    with pytest.raises(TelemetryError, match=r"cannot write file_sd targets .*a-file/targets.json"):
        writer.add("127.0.0.1:9400", {"job": "resilient-rl"})
