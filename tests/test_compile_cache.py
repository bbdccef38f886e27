"""The run's kept compiler work: a rollout process that compiled its decode step writes the traced
step (and the compiler's artifacts), and a fresh process with an empty local compile cache (as on
another node) runs the kept step without tracing it. Where the step cannot be kept, the artifacts
still spare that process the compile. Each process is a fresh interpreter (the compiler's caches
live per process and per folder); the compiler's own counters tell a hit from a miss."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from resilient_rl.models.decode_kept import step_key
from resilient_rl.models.tiny import TinyCausalLM, TinyLMConfig
from resilient_rl.workers.compile_cache import CompileCache, device_tag

ROLLOUT = r"""
import json, sys
from types import SimpleNamespace
import torch
from torch._dynamo.utils import counters
from resilient_rl.config.schema import config_from_dict
from resilient_rl.models.decode_step import DecodeStep
from resilient_rl.models.factory import build_causal_lm
from resilient_rl.models.hf import tiny_llama_config
from resilient_rl.protocol import DataProto
from resilient_rl.workers.compile_cache import CompileCache
from resilient_rl.workers.fsdp import DevicePlan
from resilient_rl.workers.rollout import RolloutEngine

root, rank, keep = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
if not keep:
    DecodeStep.kept_failure = "not kept in this test"
model = SimpleNamespace(kind="hf", hf_config=tiny_llama_config(64, hidden_size=32, intermediate_size=64))
plan = DevicePlan(torch.device("cpu"), torch.float32, torch.float32)
ids = torch.randint(2, 64, (4, 6), generator=torch.Generator().manual_seed(0))
prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                              meta_info={"step": 1, "max_new_tokens": 6})
runs = {}
for compile in (True, False):
    cfg = config_from_dict({"rollout": {"compile": compile}})
    engine = RolloutEngine(model, cfg.rollout, 64, 1, plan, eos_token_id=1, pad_token_id=0,
                           compile_cache=CompileCache(root, "run"))
    runs[compile] = engine.generate_sequences(prompts, rank=rank)
metrics = runs[True].meta_info["metrics"]
print(json.dumps({"compiles": metrics["perf/decode_compiles"], "kept": metrics["perf/decode_kept"],
                  "cudagraph_skips": metrics["perf/decode_cudagraph_skips"], "decode_steps": metrics["perf/decode_steps"],
                  "timed": metrics["perf/decode_prefill_s"] > 0 and metrics["perf/decode_loop_s"] > 0,
                  "inductor": dict(counters["inductor"]),
                  "same_as_eager": runs[True].batch["responses"].tolist() == runs[False].batch["responses"].tolist()}))
"""


def rollout_process(root, local_cache, rank: int = 0, keep: bool = True) -> dict:
    """One generation, compiled and eager, in a fresh interpreter whose local compile cache is
    ``local_cache``; ``keep``: whether the decode step may be kept (else it compiles as before)."""
    import os

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(local_cache)}
    done = subprocess.run([sys.executable, "-c", ROLLOUT, str(root), str(rank), str(int(keep))],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def kept_files(root) -> dict:
    return {p.name: p.read_bytes() for p in (root / "run" / CompileCache.FOLDER).glob("*.bin")}


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    root, node = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("node-a")
    return root, rollout_process(root, node), node


def test_the_first_rollout_process_compiles_and_keeps_the_traced_step_for_the_run(first):
    root, run, node = first  # its local cache was empty, as a process on another node finds its own
    assert run["compiles"] >= 1 and run["same_as_eager"] and run["cudagraph_skips"] == 0  # none asked for on CPU
    assert 1 <= run["decode_steps"] <= 5 and run["timed"]  # the engine's prefill and loop, each timed
    steps = [name for name in kept_files(root) if name.startswith(f"{device_tag('cpu')}.decode-")]
    assert len(steps) == 1 and (root / "run" / CompileCache.FOLDER / steps[0]).stat().st_size > 10_000
    assert (node / "resilient_rl" / steps[0]).read_bytes() == kept_files(root)[steps[0]]  # the node's copy


def test_a_new_run_on_the_same_node_takes_the_nodes_copy_of_the_kept_step(first, tmp_path):
    _, _, node = first
    again = rollout_process(tmp_path / "new-run", node)  # its run folder is empty
    assert again["compiles"] == 0 and again["kept"] == 1.0 and again["same_as_eager"]


def test_a_process_on_another_node_runs_the_kept_step_without_tracing_it(first, tmp_path):
    root, run, _ = first
    before = kept_files(root)
    again = rollout_process(root, tmp_path / "node-b", rank=1)  # an empty local cache
    assert again["compiles"] == 0 and again["kept"] == 1.0 and again["same_as_eager"]  # not traced, not compiled
    assert kept_files(root) == before  # only rank 0 writes


def test_where_the_step_cannot_be_kept_the_artifacts_spare_the_compile(tmp_path):
    done = rollout_process(tmp_path / "ckpt", tmp_path / "node-a", keep=False)
    assert done["compiles"] >= 1 and done["kept"] == 0.0 and done["inductor"].get("fxgraph_cache_miss", 0) >= 1
    again = rollout_process(tmp_path / "ckpt", tmp_path / "node-b", rank=1, keep=False)
    assert again["compiles"] >= 1 and again["same_as_eager"]  # traced again ...
    assert again["inductor"].get("fxgraph_cache_hit", 0) >= 1  # ... but not compiled again
    assert again["inductor"].get("fxgraph_cache_miss", 0) == 0


def test_an_unreadable_or_unwritable_cache_costs_a_compile_not_a_step(tmp_path, monkeypatch, caplog):
    import torch

    from resilient_rl.workers import compile_cache

    monkeypatch.setattr(compile_cache, "_PROCESS", {"adopted": False, "published": 0, "kept_adopted": set(),
                                                    "kept_published": {}})
    cache = CompileCache(str(tmp_path), "run", node_root=str(tmp_path / "node"))
    kept = tmp_path / "run" / CompileCache.FOLDER / f"{device_tag('cpu')}.bin"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"torn or foreign bytes")
    assert cache.adopt("cpu") == 0 and "could not load" in caplog.text
    assert cache.adopt("cpu") == 0  # looked for once per process
    torch.manual_seed(0)
    model = TinyCausalLM(TinyLMConfig(vocab_size=16, hidden_size=8, max_seq_len=8))
    steps = kept.parent / f"{device_tag('cpu')}.decode-{step_key(model)[:16]}.bin"
    steps.write_bytes(b"torn")
    caplog.clear()
    assert cache.adopt("cpu", model) == 0 and f"could not load {steps}" in caplog.text
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled" * 100, None))
    (tmp_path / "blocked").write_text("a file where the run's folder should be")
    assert CompileCache(str(tmp_path), "blocked").publish("cpu") == 0 and "could not write" in caplog.text
    assert cache.publish("cpu") == 800 and kept.read_bytes() == b"compiled" * 100
    assert cache.publish("cpu") == 0  # nothing new since
