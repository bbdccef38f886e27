"""The run's kept compiler artifacts: a rollout process that compiled its decode step writes them,
and a fresh process with an empty local compile cache (as on another node) takes the traced step
and its compiled code from them instead of tracing and compiling it again, and samples the same
tokens. Each process is a fresh interpreter (the compiler's caches live per process and per
folder); the compiler's own counters tell a hit from a miss."""

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
from resilient_rl.models.precompile import DROPPED_GUARDS
from resilient_rl.protocol import DataProto
from resilient_rl.workers.compile_cache import CompileCache
from resilient_rl.workers.fsdp import DevicePlan
from resilient_rl.workers.rollout import RolloutEngine

root, rank, precompile = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
model = SimpleNamespace(kind="hf", hf_config=tiny_llama_config(64, hidden_size=32, intermediate_size=64))
cfg = config_from_dict({"rollout": {"compile": True, "precompile": precompile}})
engine = RolloutEngine(model, cfg.rollout, 64, 1, DevicePlan(torch.device("cpu"), torch.float32, torch.float32),
                       eos_token_id=1, pad_token_id=0,
                       compile_cache=CompileCache(root, "run", precompile=cfg.rollout.precompile))
ids = torch.randint(2, 64, (4, 6), generator=torch.Generator().manual_seed(0))
prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                              meta_info={"step": 1, "max_new_tokens": 6})
out = engine.generate_sequences(prompts, rank=rank)
# Rank 0 also samples rank 1's stream with the code it compiled, for a process on another node to match.
other = engine.generate_sequences(prompts, rank=1) if rank == 0 else out
print(json.dumps({"compiles": out.meta_info["metrics"]["perf/decode_compiles"],
                  "inductor": dict(counters["inductor"]), "dynamo_cache": dict(counters["dynamo_cache"]),
                  "dropped_guards": sum(DROPPED_GUARDS.values()), "rank1_responses": other.batch["responses"].tolist()}))
"""


def rollout_process(root, local_cache, rank: int = 0, precompile: bool = True) -> dict:
    """One generation in a fresh interpreter whose local compile cache is ``local_cache``."""
    import os

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(local_cache)}
    done = subprocess.run([sys.executable, "-c", ROLLOUT, str(root), str(rank), str(int(precompile))],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return root, rollout_process(root, tmp_path_factory.mktemp("node-a"))


def test_the_first_rollout_process_compiles_and_keeps_its_artifacts_for_the_run(first):
    root, run = first  # its local cache was empty, as a process on another node finds its own
    assert run["compiles"] >= 1 and run["inductor"].get("fxgraph_cache_miss", 0) >= 1
    assert run["dynamo_cache"].get("dynamo_cache_miss", 0) >= 1
    kept = root / "run" / CompileCache.FOLDER / f"{device_tag('cpu')}.bin"
    assert kept.stat().st_size > 10_000
    # torch drops the guards on objects' identities, one warning each: counted, not logged.
    assert run["dropped_guards"] > 0 and "is dropped with caching_precompile" not in run["stderr"]


def test_a_process_on_another_node_takes_the_traced_step_from_the_run(first, tmp_path):
    root, run = first
    kept = root / "run" / CompileCache.FOLDER / f"{device_tag('cpu')}.bin"
    before = kept.read_bytes()
    again = rollout_process(root, tmp_path / "node-b", rank=1)  # an empty local cache
    assert again["dynamo_cache"].get("dynamo_cache_hit", 0) >= 1  # the traced step with its guards ...
    assert again["compiles"] == 0  # ... so it neither traces ...
    assert again["inductor"].get("fxgraph_cache_miss", 0) == 0  # ... nor compiles a graph again
    assert again["rank1_responses"] == run["rank1_responses"]  # and samples the same tokens
    assert kept.read_bytes() == before  # only rank 0 writes


def test_without_precompile_a_process_traces_again_but_compiles_nothing(first, tmp_path):
    root, run = first
    again = rollout_process(root, tmp_path / "node-c", rank=1, precompile=False)
    assert again["compiles"] >= 1 and not again["dynamo_cache"]  # traced, the kept step not looked for
    assert again["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert again["rank1_responses"] == run["rank1_responses"]


def test_an_unreadable_or_unwritable_cache_costs_a_compile_not_a_step(tmp_path, monkeypatch, caplog):
    import torch

    from resilient_rl.workers import compile_cache

    monkeypatch.setattr(compile_cache, "_PROCESS", {"adopted": False, "published": 0})
    monkeypatch.setattr(compile_cache.DecodeStep, "precompile", False)  # adopt() turns it on
    cache = CompileCache(str(tmp_path), "run")
    kept = tmp_path / "run" / CompileCache.FOLDER / f"{device_tag('cpu')}.bin"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"torn or foreign bytes")
    assert cache.adopt("cpu") == 0 and "could not load" in caplog.text
    assert cache.adopt("cpu") == 0  # looked for once per process
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled" * 100, None))
    (tmp_path / "blocked").write_text("a file where the run's folder should be")
    assert CompileCache(str(tmp_path), "blocked").keep("cpu", share=True) == 0 and "could not write" in caplog.text
    assert cache.keep("cpu", share=False) == 0 and kept.read_bytes() == b"torn or foreign bytes"  # not rank 0
    assert cache.keep("cpu", share=True) == 800 and kept.read_bytes() == b"compiled" * 100
    assert cache.keep("cpu", share=True) == 0  # nothing new since
