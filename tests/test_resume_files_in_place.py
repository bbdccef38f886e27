"""A resume whose config names its data file, tokenizer folder or reward file at the same path as
the checkpoint's, but whose content changed since (regenerated, updated, edited in place), is
told from one whose files are unchanged: the config digests are equal, and the content digests
the checkpoint recorded are compared all the same.

The runs are written by :class:`~resilient_rl.testing.run_folder.FakeRun` (committed checkpoints
holding the trainer state and config, no training); Ray is never started.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

import resilient_rl.config.file_digests as file_digests
from resilient_rl.cli import main
from resilient_rl.config.file_digests import content_digest
from resilient_rl.config.schema import config_digest, load_config
from resilient_rl.errors import ConfigError
from resilient_rl.testing.run_folder import FakeRun, tree_state
from resilient_rl.trainer.ppo import PPOTrainer
from resilient_rl.trainer.resume_check import check_resume
from resume_files import ANSWERS, TINY_TOKENIZER, prompts, resume_args, warnings_of

REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    return float(solution_str == ground_truth)\n")


def _run(base: Path, sections: dict) -> tuple[FakeRun, list[str]]:
    """A run with checkpoints of steps 3 and 6, and the overrides that resume it with the same config."""
    run = FakeRun(base, total_steps=12, save_every=3, sections=sections)
    run.train(6)
    overrides = [f"{section}.{k}={v}" for section, values in sections.items() for k, v in values.items()]
    return run, [*resume_args(run, base), *overrides]


def _resume(run: FakeRun, args: list[str]):
    """check_resume of ``args``; the config digest is the checkpoint's, so only the files can differ."""
    cfg = load_config(None, args)
    assert config_digest(cfg) == run.manager.load_manifest(6).config_digest
    return check_resume(cfg, run.manager, run.path, config_digest(cfg))


def test_a_data_file_changed_in_place_is_refused_naming_key_path_and_both_digests(tmp_path, capsys, no_ray):
    """The loader's saved position indexes the prompts the checkpoint recorded: before, the equal
    config digests let the resume train on other prompts under the same run name."""
    data = prompts(tmp_path / "prompts.jsonl")
    recorded = content_digest(str(data), "data.path")
    run, args = _run(tmp_path, {"data": {"path": str(data), "reward_fn": "exact_match"}})
    prompts(data, answers=ANSWERS[:-1] + ("99",))  # regenerated at the same path
    before = {p: tree_state(p) for p in (run.path, tmp_path / "ckpt")}
    assert main(["-q", "train", *args]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    now = content_digest(str(data), "data.path")
    assert (f"data.path '{data}' (sha256 {recorded} recorded with the checkpoint, {now} now) changed in place since "
            f"the checkpoint was written") in err, err
    assert "step_00000006" in err and "Restore the original file" in err
    assert "checkpoint.resume=off" in err and "trainer.run_name" in err and "Traceback" not in err
    assert {p: tree_state(p) for p in before} == before  # refused before anything was written


def test_a_tokenizer_folder_changed_in_place_is_refused(tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(TINY_TOKENIZER, tok)
    run, args = _run(tmp_path, {"data": {"tokenizer": str(tok)}})
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    with pytest.raises(ConfigError, match=rf"data.tokenizer '{tok}' \(sha256 \w+ recorded with the checkpoint, "
                                          r"\w+ now\) changed in place"):
        _resume(run, args)


def test_unchanged_files_at_the_same_path_resume_without_a_warning_reading_each_once_per_start(
        tmp_path, caplog, monkeypatch):
    """Touched (another modification time, the same content), a file is hashed again and matches;
    a start (the trainer records its config, then checks the resume) reads each file once."""
    data = prompts(tmp_path / "prompts.jsonl")
    tok = tmp_path / "tok"
    shutil.copytree(TINY_TOKENIZER, tok)
    run, args = _run(tmp_path, {"data": {"path": str(data), "reward_fn": "exact_match", "tokenizer": str(tok)},
                                "telemetry": {"enabled": False}})
    os.utime(data, ns=(1, 1))
    reads = []
    hash_file = file_digests._hash_file
    monkeypatch.setattr(file_digests, "_hash_file", lambda path, h: (reads.append(path), hash_file(path, h)))
    monkeypatch.setattr(file_digests, "_cache", {})
    with caplog.at_level(logging.WARNING):
        trainer = PPOTrainer(load_config(None, args), roles_factory=_CheckpointingRoles())
        assert config_digest(trainer.cfg) == run.manager.load_manifest(6).config_digest
        trainer.claim()
        trainer.claim_.release()
    assert warnings_of(caplog) == []
    assert sorted(reads) == sorted([str(data), str(tok / "tokenizer.json"), str(tok / "tokenizer_config.json")])


class _CheckpointingRoles:
    """A roles factory whose pool saves checkpoints (the resume is checked); it never starts one."""

    writes_checkpoints = True

    def __call__(self, cfg, tokenizer):
        raise AssertionError("no roles are started here")


def test_a_reward_file_edited_in_place_resumes_warning_with_both_digests(tmp_path, caplog):
    """A reward fixed mid-run is a common, legitimate change: the reward's code is not part of the
    saved state (nor is data.reward_fn's, compared by its import path only). Other content at
    another path stays refused, as another data.reward_fn is."""
    data = prompts(tmp_path / "prompts.jsonl")
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    recorded = content_digest(str(reward), "custom_reward_function.path")
    run, args = _run(tmp_path, {"data": {"path": str(data)}, "custom_reward_function": {"path": str(reward)}})
    reward.write_text(REWARD.replace("float(solution_str == ground_truth)",
                                     "float(solution_str.strip() == ground_truth)"))
    now = content_digest(str(reward), "custom_reward_function.path")
    with caplog.at_level(logging.WARNING):
        assert _resume(run, args) is None
    assert warnings_of(caplog) == [
        f"resuming checkpoint {run.manager.step_dir(6)} with custom_reward_function.path '{reward}' edited in place "
        f"since the checkpoint was written (sha256 {recorded} recorded with the checkpoint, {now} now): a reward's "
        f"code is not part of the saved state, so the resumed steps are scored by the file as it is now"]
    moved = tmp_path / "elsewhere" / "reward.py"
    moved.parent.mkdir()
    shutil.copyfile(reward, moved)
    cfg = load_config(None, [*args, f"custom_reward_function.path={moved}"])
    with pytest.raises(ConfigError, match=r"custom_reward_function.path: .* \(the content differs: sha256"):
        check_resume(cfg, run.manager, run.path, config_digest(cfg))


def test_another_change_does_not_hide_a_data_file_changed_in_place(tmp_path):
    """The config digests differ (a key that may change, or one that may not): the files at the
    same path are compared too, and one refusal names every key to put back."""
    data = prompts(tmp_path / "prompts.jsonl")
    run, args = _run(tmp_path, {"data": {"path": str(data), "reward_fn": "exact_match"}})
    prompts(data, answers=ANSWERS[:-1] + ("99",))
    cfg = load_config(None, [*args, "trainer.total_steps=20"])  # allowed on resume
    with pytest.raises(ConfigError, match=rf"data.path '{data}' \(sha256 \w+ recorded with the checkpoint, \w+ now\) "
                                          r"changed in place"):
        check_resume(cfg, run.manager, run.path, config_digest(cfg))
    cfg = load_config(None, [*args, "algorithm.gamma=0.5"])  # refused on resume
    with pytest.raises(ConfigError, match=rf"algorithm.gamma: 1.0 -> 0.5; and data.path '{data}' \(sha256 \w+ "
                                          r"recorded with the checkpoint, \w+ now\) changed in place"):
        check_resume(cfg, run.manager, run.path, config_digest(cfg))


def test_a_checkpoint_without_content_digests_cannot_tell_and_resumes_as_before(tmp_path, caplog):
    data = prompts(tmp_path / "prompts.jsonl")
    run = FakeRun(tmp_path, total_steps=12, save_every=3, record_digests=False,
                  sections={"data": {"path": str(data), "reward_fn": "exact_match"}})
    run.train(6)
    prompts(data, answers=ANSWERS[:-1] + ("99",))
    with caplog.at_level(logging.WARNING):
        assert _resume(run, [*resume_args(run, tmp_path), f"data.path={data}", "data.reward_fn=exact_match"]) is None
    assert warnings_of(caplog) == []


def test_a_data_file_edited_while_the_start_reads_it_is_recorded_as_it_was_before(tmp_path, monkeypatch):
    """The digests are taken before the trainer reads the files: a file edited between its digest
    and its read is recorded by what it held before (and a resume after that is refused), not by
    the edit, beside prompts read before it."""
    from resilient_rl.data.loader import PromptDataset

    data = prompts(tmp_path / "prompts.jsonl")
    before = content_digest(str(data), "data.path")
    read = PromptDataset.from_config.__func__

    def read_then_edit(cls, *args, **kwargs):
        dataset = read(cls, *args, **kwargs)
        prompts(data, answers=ANSWERS[::-1])
        return dataset

    monkeypatch.setattr(PromptDataset, "from_config", classmethod(read_then_edit))
    monkeypatch.setattr(file_digests, "_cache", {})
    args = [f"data.path={data}", "data.reward_fn=exact_match", f"trainer.output_dir={tmp_path / 'runs'}",
            f"checkpoint.root={tmp_path / 'ckpt'}", "telemetry.enabled=false"]
    trainer = PPOTrainer(load_config(None, args), roles_factory=_CheckpointingRoles())
    assert content_digest(str(data), "data.path") != before
    assert trainer._checkpoint_config["file_sha256"] == {"data.path": before}
