"""Background warm-up of a worker process (:func:`warm_in_background`), and what a worker warms up
ahead of its first calls (:meth:`RankWorker.warm_imports`)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import pytest

from resilient_rl.runtime import worker


def test_warm_up_threads_are_waited_for_and_finished_ones_are_dropped(monkeypatch):
    monkeypatch.setattr(worker, "_WARMING", [])
    release = threading.Event()
    worker.warm_in_background(release.wait, "slow-import")
    for i in range(20):  # a process that takes over rank after rank warms up each time
        worker.warm_in_background(lambda: None, f"quick-{i}")
        worker._WARMING[-1].join(timeout=10)
    assert [t.name for t in worker._WARMING] == ["slow-import", "quick-19"]
    release.set()
    for thread in list(worker._WARMING):
        thread.join(timeout=10)
    worker.warm_in_background(lambda: None, "last")
    assert [t.name for t in worker._WARMING] == ["last"]


def test_the_warm_up_runs_with_the_garbage_collector_off_and_says_so(monkeypatch):
    monkeypatch.setattr(worker, "_WARMING", [])
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def imports():
        seen["gc"] = gc.isenabled()
        inside.set()
        release.wait(10)

    assert gc.isenabled()
    worker.warm_in_background(imports, "warm-test")
    assert inside.wait(10)
    assert worker.warming() and seen["gc"] is False
    release.set()
    for t in list(worker._WARMING):
        t.join(10)
    assert not worker.warming() and gc.isenabled()


class _Worker:
    def __init__(self, imports) -> None:
        self.warm_imports = imports


def test_a_workers_own_warm_up_runs_in_the_background_after_the_earlier_ones(monkeypatch):
    """The worker's imports (:meth:`RankWorker.warm_imports`) start once the warm-ups already
    running are done, never beside them, and a call that waits for the warm-up waits for them."""
    monkeypatch.setattr(worker, "_WARMING", [])
    first_done, release, order = threading.Event(), threading.Event(), []

    def first():
        release.wait(10)
        order.append("first")
        first_done.set()

    worker.warm_in_background(first, "warm-imports")
    worker.warm_worker_imports(_Worker(lambda: order.append("worker's")))
    assert worker.warming() and order == []  # returned at once; the worker's waits for the first
    release.set()
    worker.wait_warm_up()
    assert order == ["first", "worker's"] and not worker.warming()


def test_a_failing_warm_up_is_logged_and_raises_nothing(monkeypatch, caplog):
    monkeypatch.setattr(worker, "_WARMING", [])

    def broken():
        raise ImportError("No module named 'transformers'")

    with caplog.at_level("DEBUG", logger=worker.__name__):
        worker.warm_worker_imports(_Worker(broken))
        worker.wait_warm_up()
    assert "warm-up imports of _Worker failed: ImportError: No module named 'transformers'" in caplog.text
    worker.warm_worker_imports(object())  # a worker class with no warm-up of its own: nothing started
    assert worker._WARMING[-1].name == "warm-worker-imports" and not worker.warming()


@pytest.mark.parametrize("role, overrides, expected", [
    ("rollout", ["rollout.compile=true"], ["model", "compiler cpu"]),
    ("rollout", [], ["model"]),  # decode compiles by default only on a GPU
    ("rollout", ["rollout.compile=true", "rollout.engine=plain"], ["model"]),
    ("actor", ["rollout.compile=true"], ["model"]),
    ("actor", ["actor.compile_head=true"], ["model", "compiler cpu"]),  # the log-prob head (null: on a GPU)
    ("actor", ["actor.compile=true"], ["model", "compiler cpu"]),  # the blocks
    ("ref", ["actor.compile_head=true"], ["model", "compiler cpu"]),
    ("ref", ["actor.compile=true"], ["model"]),  # the ref's blocks are never compiled
    ("critic", ["critic.compile=true", "actor.compile_head=true"], ["model", "compiler cpu"]),
    ("critic", ["actor.compile_head=true"], ["model"]),  # a value head has no log-prob head
    ("actor", ["actor.compile_elementwise=true"], ["model", "compiler cpu"]),  # the norms, rotary and SwiGLU
    ("ref", ["actor.compile_elementwise=true"], ["model", "compiler cpu"]),
    ("critic", ["critic.compile_elementwise=true"], ["model", "compiler cpu"]),
    ("critic", ["actor.compile_elementwise=true"], ["model"]),  # the critic's own key
])
def test_a_role_warms_up_what_its_first_build_imports(monkeypatch, role, overrides, expected):
    from resilient_rl.config.schema import load_config
    from resilient_rl.workers import roles

    seen = []
    monkeypatch.setattr(roles, "import_model_code", lambda model_cfg: seen.append("model"))
    monkeypatch.setattr(roles, "import_compiler_code", lambda device: seen.append(f"compiler {device}"))
    cls = roles.ROLE_CLASSES[role].__ray_actor_class__
    w = cls.__new__(cls)  # the constructor would set this process's torch threads
    w.cfg = load_config(None, ["trainer.device=cpu", *overrides])
    w.warm_imports()
    assert seen == expected


def test_the_warm_up_imports_a_hf_models_family_code_and_the_compilers(tmp_path):
    """In a fresh interpreter: the modules a first build of a Qwen2 model and a first compile of
    the decode step import are imported by the warm-up and not before, and nothing is built."""
    code = """
import sys
import torch
from resilient_rl.models.engine import import_compiler_code
from resilient_rl.models.hf import import_hf_model_code
import resilient_rl.workers.roles
mods = ("transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama",
        "torch._inductor.compile_fx", "torch._inductor.select_algorithm", "torch._inductor.codegen.wrapper",
        "torch._inductor.runtime.triton_heuristics")
before = [m in sys.modules for m in mods]
import_hf_model_code(hf_config={"model_type": "qwen2", "hidden_size": 8})
import_hf_model_code(path="model")  # a local model folder: its config.json names the family
import_compiler_code("cpu")
import_compiler_code("cuda")  # Triton's launcher too; imported without a GPU, and no device initialised
assert not torch.cuda.is_initialized()
from torch._inductor.cpu_vec_isa import valid_vec_isa_list
print(before, [m in sys.modules for m in mods], valid_vec_isa_list.cache_info().currsize)
"""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["[False,"] + ["False,"] * 4 + ["False]", "[True,"] + ["True,"] * 4 + ["True]", "1"]
