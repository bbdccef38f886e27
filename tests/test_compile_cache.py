"""The run's kept compiler artifacts: a rollout process that compiled its decode step writes them,
and a fresh process with an empty local compile cache (as on another node) takes its compiled code
from them instead of compiling it again. Each process is a fresh interpreter (the compiler's
caches live per process and per folder); the compiler's own counters tell a hit from a miss."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from resilient_rl.workers.compile_cache import CompileCache, device_tag

ROLLOUT = r"""
import json, sys
from types import SimpleNamespace
import torch
from torch._dynamo.utils import counters
from resilient_rl.config.schema import config_from_dict
from resilient_rl.models.factory import build_causal_lm
from resilient_rl.models.hf import tiny_llama_config
from resilient_rl.protocol import DataProto
from resilient_rl.workers.compile_cache import CompileCache
from resilient_rl.workers.fsdp import DevicePlan
from resilient_rl.workers.rollout import RolloutEngine

root, rank = sys.argv[1], int(sys.argv[2])
model = SimpleNamespace(kind="hf", hf_config=tiny_llama_config(64, hidden_size=32, intermediate_size=64))
cfg = config_from_dict({"rollout": {"compile": True}})
engine = RolloutEngine(model, cfg.rollout, 64, 1, DevicePlan(torch.device("cpu"), torch.float32, torch.float32),
                       eos_token_id=1, pad_token_id=0, compile_cache=CompileCache(root, "run"))
ids = torch.randint(2, 64, (4, 6), generator=torch.Generator().manual_seed(0))
prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                              meta_info={"step": 1, "max_new_tokens": 6})
out = engine.generate_sequences(prompts, rank=rank)
print(json.dumps({"compiles": out.meta_info["metrics"]["perf/decode_compiles"],
                  "inductor": dict(counters["inductor"]),
                  "responses": out.batch["responses"].tolist()}))
"""


def rollout_process(root, local_cache, rank: int = 0) -> dict:
    """One generation in a fresh interpreter whose local compile cache is ``local_cache``."""
    import os

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(local_cache)}
    done = subprocess.run([sys.executable, "-c", ROLLOUT, str(root), str(rank)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return root, rollout_process(root, tmp_path_factory.mktemp("node-a"))


def test_the_first_rollout_process_compiles_and_keeps_its_artifacts_for_the_run(first):
    root, run = first  # its local cache was empty, as a process on another node finds its own
    assert run["compiles"] >= 1 and run["inductor"].get("fxgraph_cache_miss", 0) >= 1
    kept = root / "run" / CompileCache.FOLDER / f"{device_tag('cpu')}.bin"
    assert kept.stat().st_size > 10_000


def test_a_process_on_another_node_takes_the_compiled_code_from_the_run(first, tmp_path):
    root, run = first
    kept = root / "run" / CompileCache.FOLDER / f"{device_tag('cpu')}.bin"
    before = kept.read_bytes()
    again = rollout_process(root, tmp_path / "node-b", rank=1)  # an empty local cache
    assert again["compiles"] >= 1  # still traced (guards are not kept) ...
    assert again["inductor"].get("fxgraph_cache_hit", 0) >= 1  # ... but not compiled again
    assert again["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert kept.read_bytes() == before  # only rank 0 writes


def test_an_unreadable_or_unwritable_cache_costs_a_compile_not_a_step(tmp_path, monkeypatch, caplog):
    import torch

    from resilient_rl.workers import compile_cache

    monkeypatch.setattr(compile_cache, "_PROCESS", {"adopted": False, "published": 0})
    cache = CompileCache(str(tmp_path), "run")
    kept = tmp_path / "run" / CompileCache.FOLDER / f"{device_tag('cpu')}.bin"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"torn or foreign bytes")
    assert cache.adopt("cpu") == 0 and "could not load" in caplog.text
    assert cache.adopt("cpu") == 0  # looked for once per process
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled" * 100, None))
    (tmp_path / "blocked").write_text("a file where the run's folder should be")
    assert CompileCache(str(tmp_path), "blocked").publish("cpu") == 0 and "could not write" in caplog.text
    assert cache.publish("cpu") == 800 and kept.read_bytes() == b"compiled" * 100
    assert cache.publish("cpu") == 0  # nothing new since
