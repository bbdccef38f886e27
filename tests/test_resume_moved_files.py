"""A resume whose data file, tokenizer folder or reward file moved to another path is told from one
whose content changed: each checkpoint records the sha256 of what those keys named.

The runs are written by :class:`~resilient_rl.testing.run_folder.FakeRun` (committed checkpoints
holding the trainer state and config, no training), or trained by a controller over in-process
checkpointing roles; Ray is never started.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

import resilient_rl.config.file_digests as file_digests
from resilient_rl.cli import main
from resilient_rl.config.file_digests import RECORD_KEY, content_digest
from resilient_rl.config.schema import config_digest, load_config
from resilient_rl.errors import ConfigError
from resilient_rl.recovery.rollback import AFTER_FAILURE, checkpoint
from resilient_rl.testing.checkpoint_roles import LocalCheckpointRoles
from resilient_rl.testing.run_folder import FakeRun, tree_state
from resilient_rl.trainer.ppo import PPOTrainer
from resilient_rl.trainer.resume_check import CONFIG_KEY, check_resume, checkpoint_config
from resume_files import ANSWERS, TINY_TOKENIZER, prompts, resume_args, warnings_of


def _file_run(base: Path, data: Path, **kwargs) -> FakeRun:
    run = FakeRun(base, total_steps=12, save_every=3,
                  sections={"data": {"path": str(data), "reward_fn": "exact_match"}}, **kwargs)
    run.train(6)
    return run


@pytest.mark.parametrize("key", ["data.path", "custom_reward_function.path"])
def test_a_file_moved_with_its_content_resumes_warning_with_both_paths(tmp_path, caplog, key):
    """A run moved to another cluster (another mount point) resumes: before, the changed path was refused."""
    def place(root: Path) -> dict:
        data = prompts(root / "data" / "prompts.jsonl") if key == "data.path" else tmp_path / "prompts.jsonl"
        if key == "data.path":
            return {"data": {"path": str(data), "reward_fn": "exact_match"}}
        reward = root / "rewards" / "reward.py"
        if not reward.exists():
            reward.parent.mkdir(parents=True)
            reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                              "    return float(solution_str == ground_truth)\n")
        return {"data": {"path": str(data)}, "custom_reward_function": {"path": str(reward)}}

    prompts(tmp_path / "prompts.jsonl")
    sections = place(tmp_path / "mnt-a")
    run = FakeRun(tmp_path, total_steps=12, save_every=3, sections=sections)
    run.train(6)
    (tmp_path / "mnt-a").rename(tmp_path / "mnt-b")
    moved = place(tmp_path / "mnt-b")
    overrides = [f"{section}.{k}={v}" for section, values in moved.items() for k, v in values.items()]
    cfg = load_config(None, [*resume_args(run, tmp_path), *overrides])
    with caplog.at_level(logging.WARNING):
        accepted = check_resume(cfg, run.manager, run.path, config_digest(cfg))
    assert accepted == run.manager.load_manifest(6).config_digest  # the restore does not warn again
    section, name = key.split(".")
    old_path, new_path = sections[section][name], moved[section][name]
    assert warnings_of(caplog) == [f"resuming checkpoint {run.manager.step_dir(6)} with {key} moved: '{old_path}' "
                                   f"-> '{new_path}' holds the same content (sha256 {content_digest(new_path, key)})"]


def test_a_moved_file_whose_content_changed_is_refused_naming_key_paths_and_content(tmp_path, capsys, no_ray):
    old = prompts(tmp_path / "mnt-a" / "prompts.jsonl")
    run = _file_run(tmp_path, old)
    new = prompts(tmp_path / "mnt-b" / "prompts.jsonl", answers=ANSWERS[:-1] + ("99",))
    before = {p: tree_state(p) for p in (run.path, tmp_path / "ckpt")}
    assert main(["-q", "train", *resume_args(run, tmp_path), f"data.path={new}", "data.reward_fn=exact_match"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert f"data.path: '{old}' -> '{new}' (the content differs: sha256" in err, err
    assert content_digest(str(old), "data.path") in err and content_digest(str(new), "data.path") in err
    assert "original content" in err and "checkpoint.resume=off" in err and "trainer.run_name" in err
    assert "step_00000006" in err and "Traceback" not in err
    assert {p: tree_state(p) for p in before} == before  # refused before anything was written


@pytest.mark.parametrize("record_config", [True, False])
def test_a_checkpoint_without_content_digests_refuses_a_moved_file_as_before(tmp_path, capsys, no_ray,
                                                                             record_config):
    """Written before content digests were recorded (with its config, or older still without it,
    the run folder's config.yaml standing in): a moved file cannot be told from a changed one."""
    old = prompts(tmp_path / "mnt-a" / "prompts.jsonl")
    run = _file_run(tmp_path, old, record_config=record_config, record_digests=False)
    new = tmp_path / "mnt-b" / "prompts.jsonl"
    new.parent.mkdir()
    shutil.copyfile(old, new)  # the same content
    assert main(["-q", "train", *resume_args(run, tmp_path), f"data.path={new}", "data.reward_fn=exact_match"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"data.path: '{old}' -> '{new}' (the checkpoint predates content digests" in err, err
    assert "checkpoint.resume=off" in err


def test_a_tokenizer_folder_moved_resumes_and_one_changed_is_refused(tmp_path, caplog):
    old = tmp_path / "mnt-a" / "tok"
    shutil.copytree(TINY_TOKENIZER, old)
    run = FakeRun(tmp_path, total_steps=12, save_every=3, sections={"data": {"tokenizer": str(old)}})
    run.train(6)
    new = tmp_path / "mnt-b" / "tok"
    shutil.copytree(old, new)
    cfg = load_config(None, [*resume_args(run, tmp_path), f"data.tokenizer={new}"])
    with caplog.at_level(logging.WARNING):
        assert check_resume(cfg, run.manager, run.path, config_digest(cfg)) is not None
    assert [w for w in warnings_of(caplog) if f"data.tokenizer moved: '{old}' -> '{new}' holds the same" in w]
    config = json.loads((new / "tokenizer_config.json").read_text())
    (new / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    with pytest.raises(ConfigError, match=r"data.tokenizer: .* \(the content differs: sha256"):
        check_resume(cfg, run.manager, run.path, config_digest(cfg))


def test_a_tokenizer_named_by_its_hub_name_is_compared_by_name(tmp_path):
    run = FakeRun(tmp_path, total_steps=12, save_every=3, sections={"data": {"tokenizer": "org/tok-a"}})
    run.train(3)
    assert run.manager.load_trainer_state(3)[CONFIG_KEY][RECORD_KEY] == {}
    cfg = load_config(None, [*resume_args(run, tmp_path), "data.tokenizer=org/tok-b"])
    with pytest.raises(ConfigError, match=r"data.tokenizer: 'org/tok-a' -> 'org/tok-b': the checkpoint"):
        check_resume(cfg, run.manager, run.path, config_digest(cfg))


def test_a_folder_digest_covers_names_and_contents_not_its_place_hidden_entries_or_weights(tmp_path):
    a = tmp_path / "a"
    shutil.copytree(TINY_TOKENIZER, a)
    digest = content_digest(str(a), "data.tokenizer")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    (b / "model.safetensors").write_bytes(b"weights")  # a model folder used as the tokenizer folder
    (b / ".cache").mkdir()
    (b / ".cache" / "lock").write_text("x")
    assert content_digest(str(b), "data.tokenizer") == digest
    (b / "tokenizer.json").rename(b / "tokenizer2.json")
    assert content_digest(str(b), "data.tokenizer") != digest
    assert content_digest(str(tmp_path / "nowhere"), "data.tokenizer") is None


def test_the_files_are_read_once_per_start(tmp_path, monkeypatch):
    """The config is recorded at start and again checked before a resume: one read of each file
    (a data file can be large); a file changed since is read again."""
    data = prompts(tmp_path / "prompts.jsonl")
    cfg = load_config(None, [f"data.path={data}", "data.reward_fn=exact_match", f"data.tokenizer={TINY_TOKENIZER}"])
    reads = []
    hash_file = file_digests._hash_file
    monkeypatch.setattr(file_digests, "_hash_file", lambda path, h: (reads.append(path), hash_file(path, h)))
    monkeypatch.setattr(file_digests, "_cache", {})
    first = checkpoint_config(cfg)[RECORD_KEY]
    assert set(first) == {"data.path", "data.tokenizer"} and len(reads) == 3  # the file, the folder's two
    assert checkpoint_config(cfg)[RECORD_KEY] == first and len(reads) == 3
    prompts(data, answers=("99",))
    assert checkpoint_config(cfg)[RECORD_KEY]["data.path"] != first["data.path"] and len(reads) == 4


class _CheckpointingRoles:
    """A roles factory whose pool saves checkpoints: the test hands the trainer its roles."""

    writes_checkpoints = True

    def __call__(self, cfg, tokenizer):
        raise AssertionError("the test hands the trainer its roles")


def _trainer(tmp_path: Path, data: Path) -> PPOTrainer:
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}/runs", f"checkpoint.root={tmp_path}/ckpt",
                             "trainer.run_name=moved", "telemetry.enabled=false", "trainer.total_steps=10",
                             "checkpoint.save_every=2", "checkpoint.async_save=false", f"data.path={data}",
                             "data.reward_fn=exact_match"])
    return PPOTrainer(cfg, roles_factory=_CheckpointingRoles())


def _save(trainer: PPOTrainer, roles, step: int) -> None:
    roles.train_step(step)
    trainer.step = step
    trainer.save_checkpoint()  # checkpoint.async_save=false: committed before it returns


def test_a_run_resumed_with_a_moved_data_file_recovers_from_its_checkpoints(tmp_path, caplog):
    """The config digest differs (it covers the path): restoring the resumed checkpoint after a
    worker failure, then the run's own, and a later start on the moved file all go through."""
    old = prompts(tmp_path / "mnt-a" / "prompts.jsonl")
    first = _trainer(tmp_path, old)
    with LocalCheckpointRoles() as roles:
        roles.sync_weights = lambda version: {}
        first.claim()
        first.roles = roles
        _save(first, roles, 2)
    first.claim_.release()
    (tmp_path / "mnt-a").rename(tmp_path / "mnt-b")
    new = tmp_path / "mnt-b" / "prompts.jsonl"
    resumed = _trainer(tmp_path, new)
    assert resumed.digest != first.digest
    with caplog.at_level(logging.WARNING):
        resumed.claim()  # before: ConfigError, data.path changed
        with LocalCheckpointRoles() as roles:
            roles.sync_weights = lambda version: {}
            resumed.roles = roles
            assert resumed.rollback.roll_back_to(roles, checkpoint("auto")) == 2  # the resume
            assert resumed.rollback.roll_back_to(roles, *AFTER_FAILURE) == 2  # a rank dies before the next save
            _save(resumed, roles, 4)
            assert resumed.rollback.roll_back_to(roles, *AFTER_FAILURE) == 4  # and after it
        resumed.claim_.release()
        recorded = resumed.ckpt.manager.load_trainer_state(4)[CONFIG_KEY]
        assert recorded["data"]["path"] == str(new) and set(recorded[RECORD_KEY]) == {"data.path"}
        assert not [w for w in warnings_of(caplog) if "different config" in w], warnings_of(caplog)
        caplog.clear()
        again = _trainer(tmp_path, new)  # a later start resumes the run's own checkpoint of step 4
        again.claim()
        again.claim_.release()
    assert warnings_of(caplog) == []
