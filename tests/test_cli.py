"""The checkpoint commands of the CLI: ``checkpoints list|verify``, ``export`` and ``resume``.

The checkpoints here are written in-process, without Ray, through the same worker-side code a
Ray actor runs (:class:`RankCheckpointer` around a single-process :class:`PolicyEngine`) and
committed with :meth:`CheckpointManager.commit`. The same commands on a real ``resilient-rl train``
run (an FSDP2-sharded actor, ``resume``, ``status`` and ``plot``) are tested in test_cli_real_run.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from resilient_rl.checkpoint import CheckpointManager, FileRecord, Storage, step_dirname
from resilient_rl.checkpoint.inspect import locate
from resilient_rl.errors import ConfigError
from resilient_rl.models.hf import tiny_llama_config
from resilient_rl.config.schema import config_digest, config_from_dict
from resilient_rl.run.folder import RunDir
from resilient_rl.data.tasks import get_task
from resilient_rl.data.tokenizer import build_tokenizer
from resilient_rl.trainer.resume_check import checkpoint_config
from resilient_rl.workers.checkpointing import RankCheckpointer
from resilient_rl.workers.rank_state import states_of
from resilient_rl.workers.fsdp import plan_device
from resilient_rl.workers.policy import PolicyEngine

from checkpoint_cli import checkpoint_table as _table, load_tiny_export as _load_tiny_export, run_cli as _cli

RUN = "cli-run"


class _LocalActor:
    """The actor's checkpoint code hosted in this process (rank 0 of a world of 1)."""

    def __init__(self, engine: PolicyEngine):
        self.engine = engine
        self.checkpointer = RankCheckpointer(lambda: states_of(engine), lambda: (0, 1, None), "actor", staging=False)


def _train_a_little(engine: PolicyEngine, vocab: int, seed: int) -> None:
    """One AdamW step on a simple loss, so saved weights and optimizer state differ from init."""
    ids = torch.randint(3, vocab, (2, 6), generator=torch.Generator().manual_seed(seed))
    loss = engine.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().square().mean()
    loss.backward()
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    engine.scheduler.step()


def _make_run(base: Path, model: dict, steps=(1, 2), record_config: bool = False) -> dict:
    """A run with committed checkpoints at ``steps`` and its config.yaml; returns what a test needs.
    ``record_config``: each step records the run's config in its trainer state, as a trainer's do."""
    torch.set_num_threads(1)
    root, output_dir = base / "ckpt", base / "runs"
    cfg = config_from_dict({"model": model, "trainer": {"run_name": RUN, "output_dir": str(output_dir),
                                                        "total_steps": 4, "device": "cpu"},
                            "checkpoint": {"root": str(root)}})
    RunDir(str(output_dir), RUN).save_config(cfg)
    tokenizer = build_tokenizer(cfg.data, get_task(cfg.data))
    engine = PolicyEngine(cfg.model, tokenizer.vocab_size, cfg.trainer.seed, plan_device("cpu"),
                          actor_cfg=cfg.actor, total_steps=cfg.trainer.total_steps)
    actor = _LocalActor(engine)
    manager = CheckpointManager(str(root), RUN)
    weights = {}
    for step in steps:
        _train_a_little(engine, tokenizer.vocab_size, step)
        manager.begin_step(step)
        recorded = {"config": checkpoint_config(cfg)} if record_config else {}
        manager.write_trainer_state(step, {"step": step, **recorded})
        records = actor.checkpointer.save_checkpoint(str(root), None, Storage.join(RUN, step_dirname(step), "actor"), False)
        manager.commit(step, {"actor": [FileRecord.from_json(r) for r in records]}, {"actor": 1},
                       config_digest(cfg))
        weights[step] = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    return {"root": root, "output_dir": output_dir, "cfg": cfg, "engine": engine, "weights": weights,
            "vocab": tokenizer.vocab_size, "run_url": root / RUN}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return _make_run(tmp_path_factory.mktemp("tiny"), {"kind": "tiny", "hidden_size": 32, "num_layers": 2,
                                                       "num_heads": 4, "intermediate_size": 64})


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    hf_config = tiny_llama_config(vocab_size=0, hidden_size=32, num_heads=4, intermediate_size=64)
    del hf_config["vocab_size"]  # the trainer fills in the tokenizer's vocabulary, as in real runs
    return _make_run(tmp_path_factory.mktemp("hf"), {"kind": "hf", "hf_config": hf_config}, steps=(1,))


@pytest.fixture
def run_copy(tiny_run, tmp_path):
    """A private copy of the tiny run's checkpoints, free to damage."""
    shutil.copytree(tiny_run["root"], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- locate
def test_locate_accepts_names_run_folders_and_step_folders():
    assert locate("my-run") == locate("my-run", "checkpoints")
    assert locate("my-run", "s3://b/ck", 3) == locate("s3://b/ck/my-run", None, 3)
    loc = locate("s3://b/ck/my-run/step_00000020/")
    assert (loc.root, loc.run, loc.step) == ("s3://b/ck", "my-run", 20)
    assert locate("/abs/ck/my-run").root == "/abs/ck"
    with pytest.raises(ConfigError, match="contradicts"):
        locate("ck/my-run/step_00000020", step=3)
    with pytest.raises(ConfigError, match="--root"):
        locate("ck/my-run", root="other")
    with pytest.raises(ConfigError, match="run folder"):
        locate("s3://my-run")


# ----------------------------------------------------------------------------- list / verify
def test_list_shows_every_step_with_size_age_check_and_latest(tiny_run, capsys):
    code, out, _ = _cli(capsys, "checkpoints", "list", RUN, "--root", str(tiny_run["root"]))
    assert code == 0
    assert f"run: {tiny_run['run_url']}" in out
    rows = _table(out)
    assert sorted(rows) == [1, 2]
    assert rows[1][1:2] == ["yes"] and rows[2][1:2] == ["yes"]
    assert rows[1][4] == "sizes ok" and rows[2][4] == "sizes ok"
    assert rows[2][-1] == "latest" and "latest" not in rows[1]
    step2 = tiny_run["run_url"] / step_dirname(2)
    size = sum(p.stat().st_size for p in step2.rglob("*") if p.is_file())
    assert rows[2][2] == f"{size / 1024:.1f} KiB"
    # The run folder URL lists the same steps.
    code, out_url, _ = _cli(capsys, "checkpoints", "list", str(tiny_run["run_url"]))
    assert code == 0 and _table(out_url).keys() == rows.keys()


def test_verify_checks_sha256_of_every_step(tiny_run, capsys):
    code, out, err = _cli(capsys, "checkpoints", "verify", RUN, "--root", str(tiny_run["root"]))
    assert code == 0, err
    rows = _table(out)
    assert [rows[s][4] for s in (1, 2)] == ["sha256 ok", "sha256 ok"]
    code, out, _ = _cli(capsys, "checkpoints", "verify", str(tiny_run["run_url"] / step_dirname(1)))
    assert code == 0 and sorted(_table(out)) == [1]


def test_flipped_byte_fails_verify_naming_the_file(run_copy, capsys):
    shard = run_copy / RUN / step_dirname(2) / "actor" / "shard_00000.safetensors"
    _flip_byte(shard)
    # The cheap check of `list` only sees sizes: the damage needs the sha256 of `verify`.
    code, out, _ = _cli(capsys, "checkpoints", "list", RUN, "--root", str(run_copy))
    assert code == 0 and _table(out)[2][4] == "sizes ok"
    code, out, err = _cli(capsys, "checkpoints", "verify", RUN, "--root", str(run_copy))
    assert code == 1
    assert _table(out)[2][4] == "CORRUPT: actor/shard_00000.safetensors: sha256 mismatch"
    assert _table(out)[1][4] == "sha256 ok"
    assert f"{shard}: sha256 mismatch" in err and "falls back to step 1" in err
    assert _cli(capsys, "checkpoints", "verify", RUN, "--root", str(run_copy), "--step", "1")[0] == 0
    code, _, err = _cli(capsys, "checkpoints", "verify", RUN, "--root", str(run_copy), "--step", "2")
    assert code == 1 and str(shard) in err


def test_verify_warns_about_an_older_corrupt_step_but_passes(run_copy, capsys):
    trainer_state = run_copy / RUN / step_dirname(1) / "trainer_state.json"
    _flip_byte(trainer_state)
    code, out, err = _cli(capsys, "checkpoints", "verify", RUN, "--root", str(run_copy))
    assert code == 0  # a resume loads step 2, which is intact
    assert _table(out)[1][4] == "CORRUPT: trainer_state.json: sha256 mismatch"
    assert f"warning: {trainer_state}: sha256 mismatch" in err


def test_verify_passes_on_the_newest_committed_step_and_fails_on_an_uncommitted_one(run_copy, capsys):
    (run_copy / RUN / step_dirname(2) / "MANIFEST.json").unlink()
    code, out, _ = _cli(capsys, "checkpoints", "verify", RUN, "--root", str(run_copy))
    rows = _table(out)
    assert code == 0 and rows[2][1] == "no" and rows[2][4] == "uncommitted" and rows[1][4] == "sha256 ok"
    code, _, err = _cli(capsys, "checkpoints", "verify", RUN, "--root", str(run_copy), "--step", "2")
    assert code == 1 and "not committed" in err
    (run_copy / RUN / step_dirname(1) / "MANIFEST.json").unlink()
    code, _, err = _cli(capsys, "checkpoints", "verify", RUN, "--root", str(run_copy))
    assert code == 1 and "no committed checkpoint" in err


def test_missing_run_or_step_is_an_error_naming_it(tiny_run, capsys):
    code, _, err = _cli(capsys, "checkpoints", "list", "no-such-run", "--root", str(tiny_run["root"]))
    assert code == 2 and "'no-such-run'" in err and str(tiny_run["root"]) in err
    code, _, err = _cli(capsys, "checkpoints", "verify", RUN, "--root", str(tiny_run["root"]), "--step", "7")
    assert code == 2 and "no step 7" in err


# ----------------------------------------------------------------------------- export
def test_export_tiny_reloads_with_identical_weights(tiny_run, tmp_path, capsys):
    out = tmp_path / "export"
    step_url = tiny_run["run_url"] / step_dirname(2)
    code, stdout, err = _cli(capsys, "export", str(step_url), "--out", str(out),
                             "--output-dir", str(tiny_run["output_dir"]))
    assert code == 0, err
    assert "model.safetensors, config.json" in stdout
    model = _load_tiny_export(out)
    saved = tiny_run["weights"][2]
    assert model.state_dict().keys() == saved.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    assert not torch.equal(saved["embed_tokens.weight"], tiny_run["weights"][1]["embed_tokens.weight"])
    ids = torch.randint(3, tiny_run["vocab"], (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, tiny_run["engine"].model(input_ids=ids).logits)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["rrl_step"] == "2" and meta["rrl_role"] == "actor" and meta["rrl_source"] == str(step_url)


def test_export_to_a_folder_that_cannot_be_created_is_bad_input(tiny_run, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "export"
    code, _, err = _cli(capsys, "export", str(tiny_run["run_url"] / step_dirname(2)), "--out", str(out),
                        "--output-dir", str(tiny_run["output_dir"]))
    assert code == 2 and f"--out {str(out)!r}: cannot create the folder" in err and "internal error" not in err


def test_export_by_run_name_and_step_with_explicit_config(tiny_run, tmp_path, capsys):
    out = tmp_path / "export"
    code, _, err = _cli(capsys, "export", RUN, "--root", str(tiny_run["root"]), "--step", "1", "--out", str(out),
                        "--config", str(tiny_run["output_dir"] / RUN / "config.yaml"))
    assert code == 0, err
    model = _load_tiny_export(out)
    for key, value in model.state_dict().items():
        assert torch.equal(value, tiny_run["weights"][1][key]), key


def test_export_refuses_a_corrupt_checkpoint(run_copy, tiny_run, tmp_path, capsys):
    index = run_copy / RUN / step_dirname(2) / "actor" / "shard_00000.json"
    _flip_byte(index)
    out = tmp_path / "export"
    code, _, err = _cli(capsys, "export", str(run_copy / RUN), "--out", str(out),
                        "--output-dir", str(tiny_run["output_dir"]))
    assert code == 1 and "corrupt" in err and str(index) in err  # EXIT_CORRUPT, as verify
    assert not (out / "model.safetensors").exists()


def test_export_needs_the_run_config_and_checks_it_against_the_weights(tiny_run, tmp_path, capsys):
    step_url = str(tiny_run["run_url"] / step_dirname(2))
    code, _, err = _cli(capsys, "export", step_url, "--out", str(tmp_path / "a"), "--output-dir",
                        str(tmp_path / "elsewhere"))
    assert code == 2 and str(tmp_path / "elsewhere" / RUN / "config.yaml") in err and "--config" in err
    text = (tiny_run["output_dir"] / RUN / "config.yaml").read_text()
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(text.replace("num_layers: 2", "num_layers: 3"))
    code, _, err = _cli(capsys, "export", step_url, "--out", str(tmp_path / "b"), "--config", str(wrong))
    assert code == 2 and "do not fit" in err and "layers.2." in err


def test_export_takes_the_config_a_step_recorded_before_the_run_folders(tmp_path, capsys):
    """A step that records its config exports without the run folder, and a config.yaml that a later
    start rewrote (with another model shape, say, before its resume was refused) does not matter."""
    run = _make_run(tmp_path / "run", {"kind": "tiny", "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                                       "intermediate_size": 64}, steps=(1,), record_config=True)
    saved = run["output_dir"] / RUN / "config.yaml"
    saved.write_text(saved.read_text().replace("num_layers: 2", "num_layers: 3"))
    out = tmp_path / "export"
    code, stdout, err = _cli(capsys, "export", str(run["run_url"] / step_dirname(1)), "--out", str(out),
                             "--output-dir", str(run["output_dir"]))
    assert code == 0, err
    for key, value in _load_tiny_export(out).state_dict().items():
        assert torch.equal(value, run["weights"][1][key]), key


def test_export_hf_llama_loads_with_from_pretrained(hf_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    code, stdout, err = _cli(capsys, "export", RUN, "--root", str(hf_run["root"]), "--out", str(out),
                             "--output-dir", str(hf_run["output_dir"]))
    assert code == 0, err
    assert "model.kind=hf" in stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == hf_run["vocab"]
    assert config["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    saved = hf_run["weights"][1]
    loaded = model.state_dict()
    assert loaded.keys() == saved.keys()
    for key in saved:
        assert torch.equal(loaded[key], saved[key]), key
    ids = torch.randint(3, hf_run["vocab"], (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_run["engine"].model(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, expected)


# ----------------------------------------------------------------------------- resume
def test_resume_without_a_checkpoint_names_the_run_and_root(tmp_path, capsys):
    root, runs = tmp_path / "ckpt", tmp_path / "runs"
    code, _, err = _cli(capsys, "resume", "trainer.run_name=never-trained", f"checkpoint.root={root}",
                        f"trainer.output_dir={runs}")
    assert code == 2
    assert "'never-trained'" in err and str(root) in err and "no committed checkpoint" in err
    assert not (runs / "never-trained").exists()  # refused before any training started


def test_resume_refuses_another_resume_mode(tmp_path, capsys):
    code, _, err = _cli(capsys, "resume", "checkpoint.resume=off", f"checkpoint.root={tmp_path}")
    assert code == 2 and "checkpoint.resume=auto" in err
