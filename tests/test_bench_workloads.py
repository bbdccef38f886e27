"""bench/gpu.py --workload on the CPU: its pure parts (device specs, FLOPs, decode roofline, report
lines), the workload's config and data, the running account it prints, and a tiny end-to-end run
with a recovery. Figures are made up; nothing here times anything."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from resilient_rl.testing.bench_scripts import BENCH, run_on_cpu


@pytest.fixture
def workloads(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_generation
    import gpu_workloads

    return gpu_workloads, gpu_generation


def test_workload_device_specs_by_cuda_name(workloads):
    wl, _ = workloads
    assert wl.device_specs("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert wl.device_specs("NVIDIA H100 PCIe") == (756e12, 2.0e12)
    assert wl.device_specs("NVIDIA H100 NVL") == (835e12, 3.9e12)
    assert wl.device_specs("NVIDIA H200") == (989e12, 4.8e12)
    assert wl.device_specs("Tesla T4") is None


def test_workload_flops_count_the_head_once_and_verl_counts_the_embedding_too(workloads):
    wl, _ = workloads
    w = wl.WORKLOADS["gsm8k-1.5b"]
    head = 151936 * 1536
    # Qwen2.5-1.5B: 1.54 B parameters with the tied embedding counted once (biases aside).
    assert wl.flop_params(w.hf_config, "project") == pytest.approx(1.5436e9, rel=1e-3)
    assert wl.flop_params(w.hf_config, "verl") - wl.flop_params(w.hf_config, "project") == head
    assert wl.pass_flops(1000, 2, 4, 8, rows=3, seq=16, training=True) == 3 * (6 * 1000 * 16 + 12 * 2 * 4 * 8 * 256)
    assert wl.pass_flops(1000, 2, 4, 8, rows=3, seq=16, training=False) == \
        wl.pass_flops(1000, 2, 4, 8, rows=3, seq=16, training=True) / 3
    assert wl.mfu(flops=200.0, seconds=2.0, peak=1e2) == pytest.approx(1.0)


def test_generation_flops_prefill_each_prompt_once(workloads):
    wl, _ = workloads
    w = wl.WORKLOADS["gsm8k-0.5b"]
    shape = {"rows": w.prompts * w.n, "prompt": 200.0, "response": 0.0}
    flops = wl.phase_flops(w, shape, "project", ppo_epochs=1)
    # With no response the generation is the prompts' prefill alone: n times less than a forward
    # over every row.
    assert flops["gen"] == pytest.approx(flops["old_log_prob"] / w.n)


def test_decode_roofline_matches_the_published_anchors(workloads):
    """Qwen2.5-1.5B bf16 on H100 SXM: ~1.1 k tokens/s at batch 1, ~43 k at batch 64 with 1 k context."""
    wl, _ = workloads
    w = wl.WORKLOADS["gsm8k-1.5b"]
    assert w.kv_bytes_per_token() == 2 * 28 * 2 * 128 * 2
    params = 1.544e9 * 2
    bandwidth = wl.device_specs("NVIDIA H100 80GB HBM3")[1]
    one = wl.decode_roofline_tokens_per_s(params, w.kv_bytes_per_token(), 1, 0, 1, bandwidth)
    assert one == pytest.approx(1085, rel=0.01)
    sixty_four = wl.decode_roofline_tokens_per_s(params, w.kv_bytes_per_token(), 64, 1024, 1, bandwidth)
    assert sixty_four == pytest.approx(43.1e3, rel=0.01)
    # A growing context lowers the bound: 256 + 512 tokens sits between the two extremes' contexts.
    grow = wl.decode_roofline_tokens_per_s(params, w.kv_bytes_per_token(), 64, 256, 512, bandwidth)
    assert wl.decode_roofline_tokens_per_s(params, w.kv_bytes_per_token(), 64, 767, 1, bandwidth) < grow < \
        wl.decode_roofline_tokens_per_s(params, w.kv_bytes_per_token(), 64, 256, 1, bandwidth)
    assert wl.verl_throughput(tokens=6000, step_seconds=2.0, gpus=2) == 1500


def test_workload_config_loads_and_its_data_fits_its_tokenizer_and_reward(workloads, tmp_path, bench, monkeypatch):
    """The workload starts: its answers carry the gsm8k '#### n' line, every prompt encodes with its
    own tokenizer (chat template applied) within prompt_len tokens and lengths vary, and its stop
    ids are ids of that tokenizer and its model's."""
    wl, _ = workloads
    gpu, _ = bench
    from resilient_rl.config.schema import load_config
    from resilient_rl.data.rewards import gsm8k_reference
    from resilient_rl.data.tasks import read_jsonl
    from resilient_rl.data.tokenizer import build_tokenizer
    from resilient_rl.models.hf import load_hf_config
    from resilient_rl.models.hf_folder import model_eos_token_ids

    def config_only(w, stops, models):  # the folder without the 0.5 B weights (see the next test)
        folder = models / w.name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(wl.model_config(w, stops)))
        return folder

    monkeypatch.setattr(wl, "model_folder", config_only)
    path = gpu.prepare_workload("gsm8k-0.5b", str(tmp_path), str(tmp_path / "models"))
    cfg = load_config(path, [f"trainer.output_dir={tmp_path}"])
    w = wl.WORKLOADS["gsm8k-0.5b"]
    model = load_hf_config(cfg.model.path)
    assert cfg.model.kind == "hf" and cfg.model.path == str(tmp_path / "models" / w.name) and model.hidden_size == 896
    assert (cfg.data.batch_size, cfg.rollout.n, cfg.rollout.max_new_tokens) == (64, 8, 512)
    assert cfg.actor.packing  # rows without padding, as verl runs (use_remove_padding)
    tokenizer = build_tokenizer(cfg.data)
    samples = read_jsonl(cfg.data.path)
    lengths = [len(tokenizer.encode_prompt(s.prompt)) for s in samples]
    assert len(samples) == 256 and max(lengths) <= w.prompt_len and min(lengths) < 0.75 * w.prompt_len
    assert all(gsm8k_reference(s.answer) > 0 for s in samples)
    stops = model_eos_token_ids(cfg.model)
    assert len(stops) == w.stop_ids() and max(stops) < tokenizer.vocab_size <= model.vocab_size
    # The short form (the same model on four short rows) has stop ids enough for the same tokenizer.
    assert w.short().stop_ids() <= tokenizer.vocab_size - 8 and w.short().hf_config == w.hf_config
    args = gpu.parse_args(["--workload", "gsm8k-1.5b", "--skip-generation"])
    assert args.workload == "gsm8k-1.5b" and args.skip_generation and args.size is None
    assert gpu.parse_args(["--workload", "gsm8k-0.5b", "--short"]).size == "short"
    with pytest.raises(SystemExit):
        gpu.parse_args(["--workload", "gsm8k-0.5b", "--short", "--tiny"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--workload", "gsm8k-70b"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--tiny"])


def test_workload_model_folder_is_drawn_once_and_loads_as_a_pretrained_model(workloads, tmp_path, monkeypatch):
    """The run loads the workload's model from a folder, as a run loads its pretrained model: the
    random weights are drawn and saved (bf16, as Qwen's folders) once per config and seed, and every
    later build reads them; the folder appears whole, under a name of its own for other stops."""
    import torch

    import resilient_rl.models.hf as hf
    from resilient_rl.models.hf_folder import model_eos_token_ids

    wl, _ = workloads
    w = wl.WORKLOADS["gsm8k-0.5b"].tiny()
    folder = wl.model_folder(w, [9, 10], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # no partial folder left
    model = hf.load_hf_causal_lm(path=str(folder))
    assert model.config.hidden_size == w.hf_config["hidden_size"]
    assert model_eos_token_ids(SimpleNamespace(kind="hf", path=str(folder), hf_config=None)) == [9, 10]
    drawn = hf.load_hf_causal_lm(hf_config=wl.model_config(w, [9, 10]))
    wl.random_weights(drawn, 0)
    for (name, kept), fresh in zip(model.state_dict().items(), drawn.state_dict().values()):
        assert torch.equal(kept, fresh.to(torch.bfloat16).float()), name
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)

    def no_second_draw(**kwargs):
        raise AssertionError("the kept folder was drawn again")

    monkeypatch.setattr(hf, "load_hf_causal_lm", no_second_draw)
    assert wl.model_folder(w, [9, 10], tmp_path) == folder
    with pytest.raises(AssertionError, match="drawn again"):
        wl.model_folder(w, [9, 11], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]


def test_progress_prints_each_step_once_its_events_and_the_figures_so_far(monkeypatch):
    """bench/gpu.py's running account: a run stopped at its time limit still shows its steps, its
    recovery's course and the figures of the measured steps it finished."""
    monkeypatch.syspath_prepend(str(BENCH))
    from gpu_progress import Progress

    from resilient_rl.events.kinds import FailureEvent, KillUnresponsive, Recovered, SpareAdopted

    class RunDir:
        rows: list[dict] = []
        listeners: list = []

        def read_metrics(self):
            return list(self.rows)

        def subscribe(self, fn, *kinds):
            self.listeners.append((fn, kinds))
            return lambda: self.listeners.clear()

        def publish(self, event):
            for fn, kinds in self.listeners:
                if isinstance(event, kinds):
                    fn(event)

    now = [100.0]
    lines: list[str] = []
    figures_of: list[list[int]] = []

    def figures(rows):
        figures_of.append([r["step"] for r in rows])
        return [f"  figures of {len(rows)} steps"]

    run_dir = RunDir()
    progress = Progress(2, 3, figures, out=lines.append, clock=lambda: now[0])
    progress.attach(run_dir)
    trainer = type("T", (), {"run_dir": run_dir})()
    row = lambda step: {"step": step, "timing/step_s": 4.0, "timing/gen_s": 3.0, "timing/ref_s": 0.01,  # noqa: E731
                        "tokens": 800, "perf/decode_compiles": 1.0 if step == 1 else 0.0,
                        "perf/decode_compactions": 2.0, "perf/decode_steps": 100.0, "perf/decode_prefill_s": 0.25,
                        "perf/decode_loop_s": 2.5}
    progress.on_step_start(trainer, 1)
    assert lines == []
    run_dir.rows.append(row(1))
    now[0] = 112.5
    progress.on_step_start(trainer, 2)
    assert lines == ["[   12.5 s] step 1: 4.0 s (gen 3.0); 800 tokens, 200 tokens/s; "
                     "decode step: 1 compiles, 2 compactions, prefill 0.25 s, 100 steps in 2.50 s (25.00 ms a step)"]
    assert figures_of == []  # a warm-up step: no figures
    run_dir.rows.append(row(2))
    progress.on_step_start(trainer, 3)
    assert lines[1].startswith("[   12.5 s] step 2: ") and "figures of measured steps 2..2 so far" in lines[2]
    assert lines[3] == "  figures of 1 steps" and figures_of == [[2]]
    run_dir.publish(FailureEvent(time=0.0, step=3, role="actor", rank=0, cause="died", message="x" * 1000))
    assert lines[4].startswith("[   12.5 s] failure: step=3 role=actor rank=0 cause=died message=xxx")
    assert lines[4].endswith(" ...") and len(lines[4]) < 400
    now[0] = 114.5  # within the restart phase: the probe's kill, then the hand-over to a spare
    run_dir.publish(KillUnresponsive(time=0.0, group="g", rank=0, pid=7, node="n"))
    run_dir.publish(SpareAdopted(time=0.0, group="g", rank=0, role="actor"))
    assert lines[5:7] == ["[   14.5 s] kill_unresponsive: group=g rank=0 pid=7 node=n",
                          "[   14.5 s] spare_adopted: group=g rank=0 role=actor"]
    run_dir.rows.append(row(3))
    run_dir.publish(Recovered(time=0.0, failed_step=3, restored_step=2, steps_replayed=0, duration_s=1.25,
                              restarted=[["g", 0]], generation=1))
    assert lines[7].startswith("[   14.5 s] recovered: failed_step=3 restored_step=2 steps_replayed=0 duration_s=1.25")
    progress.finish(run_dir)
    assert lines[8].startswith("[   14.5 s] step 3: ") and figures_of == [[2], [2, 3]]
    run_dir.publish(Recovered(time=0.0, failed_step=4, restored_step=3, steps_replayed=0, duration_s=1.0,
                              restarted=[], generation=2))
    progress.steps(run_dir.rows)
    assert len(lines) == 11  # nothing new: no step printed twice, no event after finish


def test_progress_prints_the_ranks_lines_that_say_which_kernels_they_took(monkeypatch):
    """The packed-attention kernel a rank process chose, a role's build time, a rank's restore and a
    spare's taking of a rank reach bench/gpu.py's output (and with it gpu_figures.sh's summary) as
    they are logged; other worker lines, and lines after the run, do not."""
    monkeypatch.syspath_prepend(str(BENCH))
    from gpu_progress import Progress

    from resilient_rl.runtime.worker_output import WORKER_LOG

    run_dir = type("D", (), {"subscribe": lambda self, fn, *kinds: (lambda: None),
                             "read_metrics": lambda self: []})()
    lines: list[str] = []
    progress = Progress(2, 3, None, out=lines.append, clock=lambda: 100.0)
    tag = "(WorkerDict_actor_rollout_ref pid=7, 10.0.0.1)"
    progress.attach(run_dir)
    try:
        WORKER_LOG.info("%s %s", tag, "INFO resilient_rl.models.varlen: packed attention: torch's varlen kernel")
        WORKER_LOG.info("%s %s", tag, "INFO resilient_rl.runtime.worker: rank 0 joined generation 1")
        WORKER_LOG.info("%s %s", tag, "INFO resilient_rl.workers.roles: actor rank 0 built empty in 2.10 s (1.50 s "
                        "of it waiting for the start-up imports)")
        WORKER_LOG.info("%s %s", tag, "INFO resilient_rl.workers.snapshots.restore: actor rank 0: restored step 4 "
                        "from its node copy, 6.47 GB: checked in 0.45 s, written in 1.50 s")
        WORKER_LOG.info("%s %s", tag, "INFO resilient_rl.workers.allocator: the CUDA caching allocator grows its "
                        "segments in place")
        WORKER_LOG.info("%s %s", tag, "INFO resilient_rl.runtime.worker_class: rank 0: a warm spare took its place "
                        "in 0.90 s (the rank's devices 0.00 s, the worker's constructor 0.30 s, its first health "
                        "reply 0.60 s)")
    finally:
        progress.finish(run_dir)
    WORKER_LOG.info("%s %s", tag, "INFO resilient_rl.models.varlen: packed attention: split")
    assert lines == [f"[    0.0 s] {tag} INFO resilient_rl.models.varlen: packed attention: torch's varlen kernel",
                     f"[    0.0 s] {tag} INFO resilient_rl.workers.roles: actor rank 0 built empty in 2.10 s (1.50 s "
                     "of it waiting for the start-up imports)",
                     f"[    0.0 s] {tag} INFO resilient_rl.workers.snapshots.restore: actor rank 0: restored step 4 "
                     "from its node copy, 6.47 GB: checked in 0.45 s, written in 1.50 s",
                     f"[    0.0 s] {tag} INFO resilient_rl.workers.allocator: the CUDA caching allocator grows its "
                     "segments in place",
                     f"[    0.0 s] {tag} INFO resilient_rl.runtime.worker_class: rank 0: a warm spare took its place "
                     "in 0.90 s (the rank's devices 0.00 s, the worker's constructor 0.30 s, its first health "
                     "reply 0.60 s)"]


def test_gpu_workload_runs_end_to_end_tiny_on_cpu(tmp_path):
    """``bench/gpu.py --workload gsm8k-0.5b --tiny`` without a GPU: the GPU code path at small
    dimensions: rollout through the compiled decode step with compaction, rewards, log-probs and
    update through the compiled head, weight sync, a checkpoint and a recovery from a SIGKILL, with
    nothing replayed, then the engine against HF generate. Its own empty compile cache: the first
    rollout compiles, and the restarted process and the comparison load the kept step instead."""
    proc = run_on_cpu("gpu.py", "--workload", "gsm8k-0.5b", "--tiny", "--warmup", "1", "--steps", "2",
                      "--models", str(tmp_path / "models"), timeout=900,
                      TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = proc.stdout
    warmup = next(line for line in out.splitlines() if line.startswith("warm-up step 1:"))
    assert "1 decode-step compiles" in warmup, warmup
    decode = next(line for line in out.splitlines() if line.startswith("decode step in the measured steps"))
    assert "0 graph breaks" in decode and "eager fallback: no" in decode and " 0.0 compactions" not in decode
    assert "log-prob head: compiled" in out  # its reductions compiled, as on a GPU, and none fell back
    assert "actor's norms, rotary and SwiGLU: compiled" in out  # the same for the elementwise work between the products
    assert "first checkpoint save" in out
    recovery = next(line for line in out.splitlines() if line.startswith("recovery after a SIGKILL"))
    assert "0 steps replayed" in recovery, recovery
    # The retry's own cost is shown beside it: the restarted process ran the kept decode step.
    assert "  the retried step 5: " in out and ", 0 decode-step compiles) against a median" in out
    # Printed as the run went: every step once, the recovery's course, the figures so far.
    stamped = [line.split("] ", 1)[1] for line in out.splitlines() if line.startswith("[")]
    assert [line.split(":")[0] for line in stamped if line.startswith("step ")] == [f"step {i}" for i in range(1, 6)]
    assert any(line.startswith("failure: step=5") for line in stamped)
    # The default run keeps one warm spare here; its taking of the rank is shown in parts.
    assert any(line.startswith("spare_adopted: ") for line in stamped)
    assert any("a warm spare took its place in " in line for line in stamped)
    assert any(line.startswith("recovered: failed_step=5") for line in stamped)
    assert "figures of measured steps 2..3 so far:" in stamped
    assert "each once: True" in out and "whole-step MFU" not in out  # no peak is known for a CPU
    # The engine against HF generate on the run's rollout model: the engine ran the decode step the
    # run kept, so the comparison compiled nothing.
    assert "  engine warm-up " in out and ", 0 decode-step compiles (the run's kept step)" in out
    assert "engine is " in out and "x faster" in out and "decode roofline: n/a" in out


def test_a_workload_stopped_by_its_time_limit_still_reports_the_steps_it_did(tmp_path):
    """bench/gpu_figures.sh ends a run at its limit with SIGTERM (SIGKILL 20 s later). Ray's own
    handler would exit at once, losing every figure printed only at the end: the run stops where it
    is instead, and reports its measured steps so far."""
    import os
    import signal
    import subprocess
    import sys

    from resilient_rl.testing.bench_scripts import REPO

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = subprocess.Popen([sys.executable, str(BENCH / "gpu.py"), "--workload", "gsm8k-0.5b", "--tiny", "--warmup",
                             "1", "--steps", "3", "--skip-generation", "--models", str(tmp_path / "models")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[") and "] step 2:" in line:  # the first measured step is done
                proc.send_signal(signal.SIGTERM)
                break
        out = "".join(lines) + proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 124, out[-3000:]
    stopped = next(line for line in out.splitlines() if line.startswith("stopped by the time limit"))
    done = int(stopped.split("after step ")[1].split(":")[0])
    assert done >= 2, stopped
    # The steps whose metrics were written (the signal may land between a step's row and its count).
    measured = next(line for line in out.splitlines() if " measured steps on 1 x CPU" in line)
    assert int(measured.split()[0]) in (done - 1, done), out[-3000:]
    # The workload's figures of those steps, printed at the end (the signal may land before the
    # running account printed them after the step).
    assert "tokens/s/GPU" in out.split(measured, 1)[1], out[-3000:]


def test_workload_and_generation_report_lines(workloads):
    wl, gen = workloads
    w = wl.WORKLOADS["gsm8k-0.5b"]
    rows_per_step = w.prompts * w.n
    summary = {"tokens_per_step": rows_per_step * 300.0, "step_s": 4.0,
               "phase_s": {"gen": 2.0, "update_actor": 1.0, "old_log_prob": 0.5, "ref": 0.0}}
    rows = [{"response_length/mean": 90.0}, {"response_length/mean": 110.0}]
    lines = wl.workload_lines(w, summary, rows, peak=1e15, gpus=1, ppo_epochs=2)
    text = "\n".join(lines)
    shape = {"rows": rows_per_step, "prompt": 200.0, "response": 100.0}
    project, verl = (wl.phase_flops(w, shape, c, 2) for c in ("project", "verl"))
    assert f"update MFU (project / verl): {100 * project['update_actor'] / 1e15:.1f}% / " \
           f"{100 * verl['update_actor'] / 1e15:.1f}%" in text
    assert f"log-prob MFU (project / verl): {100 * project['old_log_prob'] / 0.5 / 1e15:.1f}%" in text
    assert "ref log-prob" not in text  # no ref phase ran
    whole = (project["gen"] + project["update_actor"] + project["old_log_prob"]) / 4.0 / 1e15
    assert f"whole-step MFU (project / verl): {100 * whole:.1f}%" in text
    assert f"{rows_per_step * 100 / 2.0:.0f} output tokens/s" in text
    assert f"{rows_per_step * 300 / 4.0:.0f} tokens/s/GPU" in text
    assert "allocator" not in text  # no allocator counters: a CPU run
    gib = 2**30
    rows = [dict(r, **{"perf/actor_peak_bytes": p * gib, "perf/actor_reserved_peak_bytes": (p + 2) * gib,
                       "perf/actor_alloc_retries": retries, "perf/actor_planned_peak_bytes": 60.0 * gib})
            for r, p, retries in zip(rows, (61.0, 63.5), (0.0, 3.0))]
    assert wl.allocator_lines(rows) == ["  actor update allocator: peak 63.5 GiB allocated, 65.5 GiB reserved "
                                        "(60.0 GiB planned); 1.5 cudaMalloc retries per step"]
    assert wl.gradient_lines([{"actor/grad_norm": 3.0, "actor/nonfinite_skipped": 0.0},
                              {"actor/grad_norm": float("nan"), "actor/nonfinite_skipped": 2.0},
                              {"actor/grad_norm": 1.0}]) == [
        "  actor gradients: 2 non-finite mini-batches skipped in 3 steps; grad norm median 2"]
    seconds = {"engine": 2.0, "hf_dynamic": 8.0, "hf_static": 5.0, "param_bytes": 1e9}
    glines = gen.generation_lines(w, seconds, "NVIDIA H200")
    assert "4.00x faster" in glines[2] and "2.50x faster" in glines[3]
    assert "decode roofline at 4.80 TB/s" in glines[4] and "% of it" in glines[4]
    assert "n/a" in gen.generation_lines(w, seconds, "Tesla T4")[4]
