"""The CLI on a real run: ``resilient-rl train`` run once (a 2-rank FSDP2 actor and a critic, saved
at steps 1 and 2), then ``checkpoints verify`` and ``export`` consolidating its shards, ``resume``
continuing it from its latest checkpoint, and ``status`` and ``plot`` reading it. The same commands
on checkpoints written in-process are tested in test_cli.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from resilient_rl.checkpoint import CheckpointManager, step_dirname
from resilient_rl.checkpoint.inspect import inspect_run, locate
from resilient_rl.events import read_events

from checkpoint_cli import checkpoint_table as _table, load_tiny_export as _load_tiny_export, run_cli as _cli

_TRAIN_ARGS = ["trainer.total_steps=2", "checkpoint.save_every=1", "checkpoint.async_save=false",
               "data.batch_size=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8", "data.num_prompts=64",
               "trainer.progress_bar=false", "trainer.run_name=cli-ray",
               # Sharded, so that export has shards to consolidate (on CPU the default is a replica).
               "actor.strategy=fsdp", "critic.strategy=fsdp"]


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient_rl.cli", "-q", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real 2-step run: a 2-rank FSDP2 actor and a critic, saved at steps 1 and 2."""
    base = tmp_path_factory.mktemp("trained")
    proc = _run_cli("train", *_TRAIN_ARGS, f"checkpoint.root={base / 'ckpt'}", f"trainer.output_dir={base / 'runs'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base


@pytest.mark.ray
def test_export_consolidates_the_shards_of_a_real_run(trained, tmp_path, capsys):
    run_url = trained / "ckpt" / "cli-ray"
    code, out, err = _cli(capsys, "checkpoints", "verify", str(run_url))
    assert code == 0, err
    assert sorted(_table(out)) == [1, 2]
    out_dir = tmp_path / "export"
    code, _, err = _cli(capsys, "export", str(run_url), "--out", str(out_dir), "--output-dir", str(trained / "runs"))
    assert code == 0, err
    model = _load_tiny_export(out_dir)  # strict load: every key of TinyCausalLM, nothing else
    exported = load_file(str(out_dir / "model.safetensors"))
    # Independently of the reader: FSDP2 shards dim 0 by rank, so each weight is its ranks' chunks in order.
    actor = run_url / step_dirname(2) / "actor"
    report = inspect_run(locate(str(run_url)), deep=False)
    assert report.newest_committed().step == 2
    chunks: dict[str, list[torch.Tensor]] = {}
    for rank in range(2):
        with safe_open(str(actor / f"shard_{rank:05d}.safetensors"), "pt") as f:
            for key in f.keys():
                if key.startswith("model/"):
                    chunks.setdefault(key[len("model/"):], []).append(f.get_tensor(key))
    assert chunks.keys() == exported.keys() == model.state_dict().keys()
    for key, parts in chunks.items():
        assert torch.equal(exported[key], torch.cat(parts)), key
    assert any(len(parts) == 2 for parts in chunks.values())  # really sharded over 2 ranks


@pytest.mark.ray
@pytest.mark.slow  # a second full start of the cluster and roles (about a minute here)
def test_resume_continues_a_real_run_from_its_latest_checkpoint(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "run")
    root, runs = tmp_path / "run" / "ckpt", tmp_path / "run" / "runs"
    proc = _run_cli("resume", *_TRAIN_ARGS, "trainer.total_steps=3", f"checkpoint.root={root}",
                    f"trainer.output_dir={runs}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "from its newest checkpoint (step 2" in proc.stderr
    restored = [e for e in read_events(runs / "cli-ray") if e["event"] == "checkpoint_restored"]
    assert restored and restored[-1]["step"] == 2
    assert CheckpointManager(str(root), "cli-ray").latest_step() == 3
    steps = [json.loads(line)["step"] for line in (runs / "cli-ray" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.ray
def test_status_and_plot_of_a_real_run(trained, tmp_path, capsys):
    runs = trained / "runs"
    code, out, err = _cli(capsys, "status", "cli-ray", "--output-dir", str(runs), "--json")
    assert code == 0, err
    status = json.loads(out)
    assert status["state"] == "finished" and status["step"] == 2 and status["total_steps"] == 2
    assert status["controller"]["ended_at"] is not None and status["failures"] == []
    assert status["checkpoint"]["step"] == 2 and status["checkpoint"]["check"] == "ok"
    assert 0 < status["goodput"] <= 1 and status["useful_s"] > 0
    assert "not running" in status["metrics"]["note"]  # the targets file goes when the run ends
    png = tmp_path / "run.png"
    code, _, err = _cli(capsys, "plot", str(runs / "cli-ray"), "--out", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
