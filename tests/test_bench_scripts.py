"""The benchmark scripts' CPU paths: bench/gpu.py without a GPU, its FLOPs and report helpers, and
bench/train.py's weight-sync comparison. Figures are made up; nothing here times anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient_rl.models.tiny import TinyCausalLM, TinyLMConfig
from resilient_rl.telemetry.device import GpuSampler
from resilient_rl.testing.fake_nvml import FakeGpu, FakeNVML

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


@pytest.fixture
def bench(monkeypatch):
    """The bench scripts as modules (``gpu``, ``train``), importable as they import each other."""
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu
    import train

    return gpu, train


@pytest.fixture
def report(bench):
    """bench/gpu_report.py, the figures bench/gpu.py prints."""
    import gpu_report

    return gpu_report


def run_on_cpu(script: str, *args: str, timeout: int = 600, **env_vars: str) -> subprocess.CompletedProcess:
    """``python bench/<script> args...`` with no GPU visible; the test's failure shows its stderr."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO), **env_vars}
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_gpu_bench_without_gpu_says_so_and_exits_0():
    proc = run_on_cpu("gpu.py", timeout=120)
    assert proc.stdout.strip().splitlines() == ["bench/gpu.py: no CUDA device visible to torch on this machine; "
                                                "nothing to measure (bench/train.py runs on CPU)"]


def test_gpu_bench_rejects_bad_arguments(bench):
    gpu, _ = bench
    with pytest.raises(SystemExit):
        gpu.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--peak-tflops", "-1"])
    args = gpu.parse_args(["data.batch_size=64", "rollout.n=4"])
    assert args.overrides == ["data.batch_size=64", "rollout.n=4"] and args.config.endswith("grpo_add.yaml")


def test_step_flops_formula(report):
    n, t = 1_000, 50
    grpo = report.step_flops(n, t, ppo_epochs=2, need_ref=True)
    assert grpo == {"gen": 2 * n * t, "ref": 2 * n * t, "old_log_prob": 2 * n * t, "update_actor": 6 * n * t * 2}
    ppo = report.step_flops(n, t, ppo_epochs=4, need_ref=False, critic_epochs=3)
    assert set(ppo) == {"gen", "old_log_prob", "update_actor", "values", "update_critic"}
    assert ppo["update_critic"] == 6 * n * t * 3 and ppo["values"] == 2 * n * t


@pytest.mark.parametrize("tie", [False, True])
def test_matmul_params_leave_out_embedding_lookups(report, tie):
    cfg = TinyLMConfig(vocab_size=20, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                       tie_embeddings=tie)
    model = TinyCausalLM(cfg)
    embeddings = cfg.vocab_size * cfg.hidden_size + cfg.max_seq_len * cfg.hidden_size
    # Tied, the head's matrix is the token embedding: counted once (through the head), untied it
    # is a parameter of its own and the embedding table is not counted.
    head = cfg.vocab_size * cfg.hidden_size
    all_params = sum(p.numel() for p in model.parameters())
    assert report.matmul_params(model) == all_params - embeddings + (head if tie else 0)


def test_peak_flops_table(report):
    assert report.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert report.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert report.peak_flops("NVIDIA H200") == 989e12
    assert report.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert report.peak_flops("Tesla T4") is None


def test_utilization_summary_from_nvml_readings(report):
    a, b = FakeGpu(uuid="GPU-aaaa", utilization_percent=20), FakeGpu(uuid="GPU-bbbb", utilization_percent=50)
    b.unsupported = {"utilization"}
    sampler = GpuSampler(nvml=FakeNVML([a, b]))
    readings = []
    for percent in (20, 60, 100):
        a.utilization_percent = percent
        readings.append(sampler.sample())
    util = report.utilization_summary(readings)
    assert util[0]["mean_util"] == pytest.approx(0.6) and util[0]["max_util"] == 1.0 and util[0]["samples"] == 3
    assert util[1]["mean_util"] is None and util[1]["uuid"] == "GPU-bbbb"
    assert report.utilization_summary([[], []]) == {}


def test_sampling_thread_collects_readings(bench):
    gpu, _ = bench
    sampler = GpuSampler(nvml=FakeNVML([FakeGpu(uuid="GPU-aaaa", utilization_percent=40)]))
    with gpu.Sampling(sampler, 0.01) as sampling:
        pass
    assert sampling.readings and all(len(r) == 1 for r in sampling.readings)


def _rows(n=4):
    # 1 s steps of 1000 tokens: gen 0.4 s, ref 0.1, old_log_prob 0.1, update_actor 0.3, sync 0.05
    return [{"timing/step_s": 1.0, "tokens": 1000.0, "timing/gen_s": 0.4, "timing/ref_s": 0.1,
             "timing/old_log_prob_s": 0.1, "timing/adv_s": 0.01, "timing/update_actor_s": 0.3,
             "timing/weight_sync_s": 0.05, "perf/weight_sync_bytes": 2.0 * 2**20,
             "perf/weight_sync_worker_s": 0.002} for _ in range(n)]


def test_format_report_mfu_weight_sync_and_stalls(report):
    n = 10**9  # 1 B matmul params, 1000 tokens, 2 epochs: (2 + 2 + 2 + 6*2) * 1e12 = 18 TFLOP per 1 s step
    lines = report.format_report(_rows(), n_params=n, ppo_epochs=2, need_ref=True, critic_epochs=None,
                              device_name="NVIDIA H100 80GB HBM3", peak=100e12, n_gpus=2,
                              util={0: {"uuid": "GPU-a", "samples": 5, "mean_util": 0.5, "max_util": 0.9,
                                        "max_memory_bytes": 3 * 2**30}},
                              copy_s=0.001, stalls=[(2, 0.5), (4, 0.1), (6, 0.2)])
    text = "\n".join(lines)
    assert "= 18.0 TFLOP" in text
    assert "MFU: 9.00% (18.0 TFLOP/s over 2 x 100.0 TFLOP/s" in text
    assert "utilization mean 50% max 90% over 5 NVML samples, memory used max 3.0 GiB" in text
    assert "weight sync: 5.0% of the step" in text
    assert "worker-timed 2.0x (2.000 ms), controller-timed 50.0x" in text
    assert "first checkpoint save (step 2) stalled 500.0 ms; later saves median 150.0 ms (2 saves)" in text
    gen = next(line for line in lines if line.strip().startswith("gen"))
    assert "40.0%" in gen and "5.0 TFLOP/s" in gen  # 2e12 FLOP in 0.4 s


def test_format_report_without_peak_or_sync(report):
    rows = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in _rows()]
    text = "\n".join(report.format_report(rows, n_params=1000, ppo_epochs=1, need_ref=False, critic_epochs=1,
                                       device_name="Tesla T4", peak=None, n_gpus=1, util={}, copy_s=None,
                                       stalls=[]))
    assert "MFU: n/a (no peak known for 'Tesla T4'; pass --peak-tflops)" in text
    assert "weight sync vs plain copy: n/a" in text and "+ values" in text and "checkpoint" not in text


def test_train_bench_weight_sync_line(bench):
    _, train = bench
    assert train.plain_copy_s(1 << 16, "cpu", repeats=3) > 0
    assert train.plain_copy_s(1 << 16, "cpu", repeats=1, cold=True) > 0
    results = {"ray": train.summarize(_rows()), "single process": train.summarize(_rows()[:1])}
    results["single process"]["weight_sync_worker_s"] = None
    line = train.weight_sync_line(results, 0.001)
    assert line == "weight sync / plain copy: ray 2.0x (2.00 ms), single process n/a; plain copy of 2.0 MiB 1.000 ms"
    assert train.weight_sync_line(results, 0.001, 0.0005).endswith(
        "plain copy of 2.0 MiB 1.000 ms from cold caches (0.500 ms from warm ones)")


def test_snapshot_bench_arguments_carry_what_the_recovery_helpers_read(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import recovery
    import snapshots

    args = snapshots.parse_args([])
    assert (args.rank, args.in_call, args.fault_step) == (1, "update_actor", 4)
    assert recovery._when(args) == {"in_call": "update_actor"}
    assert recovery._when(snapshots.parse_args(["--in-call", "", "--delay", "0.2"])) == {"delay_s": 0.2}
    for bad in (["--block", "1"], ["--steps", "20"], ["--repeats", "0"], ["--rank", "-1"]):
        with pytest.raises(SystemExit):
            snapshots.parse_args(bad)


def test_snapshot_bench_blocks_switch_snapshots_and_compare_the_sides(monkeypatch):
    """Blocks of 3 steps, on (warm-up), off, on, off: each side's step time is the median of its
    blocks' steps after the first, from a step's start to the next one's."""
    monkeypatch.syspath_prepend(str(BENCH))
    import snapshots

    readings = iter(range(100))
    monkeypatch.setattr(snapshots, "cpu_seconds", lambda: float(next(readings)))
    clock = iter([0.0, 1.0, 2.0,  3.0, 4.0, 5.0,  6.0, 7.5, 9.0,  10.5, 11.5, 12.5,  13.5])
    blocks = snapshots.Blocks(3, clock=lambda: next(clock))
    trainer = type("T", (), {"snapshots": type("K", (), {"every": 1})()})()
    seen = []
    for step in range(1, 14):
        blocks.on_step_start(trainer, step)
        seen.append(trainer.snapshots.every)
    assert seen == [1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1]
    sides = blocks.sides()
    # Off blocks (steps 4-6, 10-12): steps 5, 6 and 11, 12 take 1 s each; on (7-9): steps 8, 9 take 1.5 s.
    assert sides[False]["step_s"] == 1.0 and sides[True]["step_s"] == 1.5
    # CPU readings are taken at the first two steps of each block; a block's measured steps span
    # its second step's reading to the next block's first.
    assert set(blocks.cpu) == {1, 2, 4, 5, 7, 8, 10, 11, 13}
    assert sides[True]["cpu_s"] == (blocks.cpu[10] - blocks.cpu[8]) / 2


def test_generation_bench_runs_tiny_and_reports_every_path(monkeypatch, capsys):
    """bench/generation.py end to end on a tiny model: the three paths ran and are compared."""
    monkeypatch.syspath_prepend(str(BENCH))
    import generation

    assert generation.main(["--tiny"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("qwen2 (tiny): 2 prompts x n=2")
    assert [line.split()[0] for line in lines[1:]] == ["engine", "hf", "plain"]
    assert all("engine is" in line and line.rstrip().endswith("x faster") for line in lines[2:])


def test_generation_bench_batch_and_report(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import generation

    ids, mask = generation.make_batch(vocab=50, prompts=3, prompt_len=8)
    assert mask.sum(1).tolist() == [8, 6, 4] and bool((ids[mask == 0] == 0).all())
    lines = generation.report({"engine": 1.0, "hf": 3.0, "plain": 2.0}, output_tokens=100)
    assert "100 output tokens/s" in lines[0] and "3.00x faster" in lines[1] and "2.00x faster" in lines[2]
    with pytest.raises(SystemExit):
        generation.parse_args(["--n", "0"])


# ------------------------------------------------------------------ bench/gpu.py --workload (pure parts)
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


def test_workload_config_loads_and_its_data_fits_its_tokenizer_and_reward(workloads, tmp_path, bench):
    """The workload starts: its answers carry the gsm8k '#### n' line, every prompt encodes with its
    own tokenizer (chat template applied) within prompt_len tokens and lengths vary, and its stop
    ids are ids of that tokenizer."""
    wl, _ = workloads
    gpu, _ = bench
    from resilient_rl.config.schema import load_config
    from resilient_rl.data.rewards import gsm8k_reference
    from resilient_rl.data.tasks import read_jsonl
    from resilient_rl.data.tokenizer import build_tokenizer
    from resilient_rl.models.hf_folder import model_eos_token_ids

    path = gpu.prepare_workload("gsm8k-0.5b", str(tmp_path))
    cfg = load_config(path, [f"trainer.output_dir={tmp_path}"])
    w = wl.WORKLOADS["gsm8k-0.5b"]
    assert cfg.model.kind == "hf" and cfg.model.hf_config["hidden_size"] == 896
    assert (cfg.data.batch_size, cfg.rollout.n, cfg.rollout.max_new_tokens) == (64, 8, 512)
    assert cfg.actor.packing  # rows without padding, as verl runs (use_remove_padding)
    tokenizer = build_tokenizer(cfg.data)
    samples = read_jsonl(cfg.data.path)
    lengths = [len(tokenizer.encode_prompt(s.prompt)) for s in samples]
    assert len(samples) == 256 and max(lengths) <= w.prompt_len and min(lengths) < 0.75 * w.prompt_len
    assert all(gsm8k_reference(s.answer) > 0 for s in samples)
    stops = model_eos_token_ids(cfg.model)
    assert len(stops) == w.stop_ids() and max(stops) < tokenizer.vocab_size <= cfg.model.hf_config["vocab_size"]
    args = gpu.parse_args(["--workload", "gsm8k-1.5b", "--skip-generation"])
    assert args.workload == "gsm8k-1.5b" and args.skip_generation
    with pytest.raises(SystemExit):
        gpu.parse_args(["--workload", "gsm8k-70b"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--tiny"])


def test_progress_prints_each_step_once_its_events_and_the_figures_so_far(monkeypatch):
    """bench/gpu.py's running account: a run stopped at its time limit still shows its steps, its
    recovery's course and the figures of the measured steps it finished."""
    monkeypatch.syspath_prepend(str(BENCH))
    from gpu_progress import Progress

    from resilient_rl.events.kinds import FailureEvent, Recovered

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
                        "perf/decode_compactions": 2.0}
    progress.on_step_start(trainer, 1)
    assert lines == []
    run_dir.rows.append(row(1))
    now[0] = 112.5
    progress.on_step_start(trainer, 2)
    assert lines == ["[   12.5 s] step 1: 4.0 s (gen 3.0); 800 tokens, 200 tokens/s; "
                     "decode step: 1 compiles, 2 compactions"]
    assert figures_of == []  # a warm-up step: no figures
    run_dir.rows.append(row(2))
    progress.on_step_start(trainer, 3)
    assert lines[1].startswith("[   12.5 s] step 2: ") and "figures of measured steps 2..2 so far" in lines[2]
    assert lines[3] == "  figures of 1 steps" and figures_of == [[2]]
    run_dir.publish(FailureEvent(time=0.0, step=3, role="actor", rank=0, cause="died", message="x" * 1000))
    assert lines[4].startswith("[   12.5 s] failure: step=3 role=actor rank=0 cause=died message=xxx")
    assert lines[4].endswith(" ...") and len(lines[4]) < 400
    run_dir.rows.append(row(3))
    run_dir.publish(Recovered(time=0.0, failed_step=3, restored_step=2, steps_replayed=0, duration_s=1.25,
                              restarted=[["g", 0]], generation=1))
    assert lines[5].startswith("[   12.5 s] recovered: failed_step=3 restored_step=2 steps_replayed=0 duration_s=1.25")
    progress.finish(run_dir)
    assert lines[6].startswith("[   12.5 s] step 3: ") and figures_of == [[2], [2, 3]]
    run_dir.publish(Recovered(time=0.0, failed_step=4, restored_step=3, steps_replayed=0, duration_s=1.0,
                              restarted=[], generation=2))
    progress.steps(run_dir.rows)
    assert len(lines) == 9  # nothing new: no step printed twice, no event after finish


def test_gpu_workload_runs_end_to_end_tiny_on_cpu(tmp_path):
    """``bench/gpu.py --workload gsm8k-0.5b --tiny`` without a GPU: the GPU code path at small
    dimensions: rollout through the compiled decode step with compaction, rewards, update, weight
    sync, a checkpoint and a recovery from a SIGKILL, with nothing replayed. Its own empty compile
    cache: the first rollout compiles, and the restarted process loads the kept step instead."""
    proc = run_on_cpu("gpu.py", "--workload", "gsm8k-0.5b", "--tiny", "--warmup", "1", "--steps", "2", timeout=900,
                      TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = proc.stdout
    warmup = next(line for line in out.splitlines() if line.startswith("warm-up step 1:"))
    assert "1 decode-step compiles" in warmup, warmup
    decode = next(line for line in out.splitlines() if line.startswith("decode step in the measured steps"))
    assert "0 graph breaks" in decode and "eager fallback: no" in decode and " 0.0 compactions" not in decode
    assert "first checkpoint save" in out
    recovery = next(line for line in out.splitlines() if line.startswith("recovery after a SIGKILL"))
    assert "0 steps replayed" in recovery, recovery
    # The retry's own cost is shown beside it: the restarted process ran the kept decode step.
    assert "  the retried step 5: " in out and ", 0 decode-step compiles) against a median" in out
    # Printed as the run went: every step once, the recovery's course, the figures so far.
    stamped = [line.split("] ", 1)[1] for line in out.splitlines() if line.startswith("[")]
    assert [line.split(":")[0] for line in stamped if line.startswith("step ")] == [f"step {i}" for i in range(1, 6)]
    assert any(line.startswith("failure: step=5") for line in stamped)
    assert any(line.startswith("recovered: failed_step=5") for line in stamped)
    assert "figures of measured steps 2..3 so far:" in stamped
    assert "each once: True" in out and "whole-step MFU" not in out  # no peak is known for a CPU


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
    seconds = {"engine": 2.0, "hf_dynamic": 8.0, "hf_static": 5.0, "param_bytes": 1e9}
    glines = gen.generation_lines(w, seconds, "NVIDIA H200")
    assert "4.00x faster" in glines[2] and "2.50x faster" in glines[3]
    assert "decode roofline at 4.80 TB/s" in glines[4] and "% of it" in glines[4]
    assert "n/a" in gen.generation_lines(w, seconds, "Tesla T4")[4]


def test_decode_compile_bench_reports_one_compile_for_every_batch_size():
    proc = run_on_cpu("decode_compile.py", "--layers", "1", "--rows", "16", "--new-tokens", "16", "--backend",
                      "aot_eager")
    first, second = proc.stdout.strip().splitlines()[-2:]
    assert "0 graph breaks" in first and ", 1 compiles" in first and "sizes [16, 8, " in first, first
    assert "(0 compiles)" in second and "per compile" in second


def test_decode_profile_bench_times_each_way_and_prints_the_profile():
    proc = run_on_cpu("decode_profile.py", "--rows", "4", "--tokens", "8", "--profile-tokens", "4")
    out = proc.stdout
    eager = next(line for line in out.splitlines() if line.strip().startswith("eager"))
    compiled = next(line for line in out.splitlines() if "compiled, no CUDA graphs" in line)
    assert "ms per decode step" in eager and "0 compiles" in eager
    assert "1 compiles" in compiled and "eager fallback: None" in compiled, compiled
    assert "Self CPU" in out  # the profiler's table


def test_recovery_path_bench_lists_the_controller_functions_of_one_recovery():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(BENCH / "recovery_path.py"), "--list"], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("one SIGKILL recovery: ") and " functions in " in lines[0]
    functions = [line for line in lines if ":" in line and line.startswith("resilient_rl.")]
    assert functions[0] == "resilient_rl.runtime.health:classify_error"
    assert "resilient_rl.recovery.driver:Recovery.handle" in functions
    assert any(f.endswith("RollBack.roll_back_to") for f in functions)
    assert int(lines[0].split()[3]) == len(functions)
    unnamed = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>", "__create_fn__")
    named = [f for f in functions if not any(mark in f for mark in unnamed)]
    assert lines[1].startswith(f"  of them {len(named)} written as functions in ")


def test_same_history_compares_every_key_but_measured_times(tmp_path, monkeypatch, capsys):
    import json

    monkeypatch.syspath_prepend(str(BENCH))
    import same_history

    def run(name: str, losses: list[float]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"step": i + 1, "actor/pg_loss": v, "timing/step_s": 0.1 * (i + 1) + len(name)}
                for i, v in enumerate(losses)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return folder

    a, b, c = run("a", [0.5, 0.25]), run("bb", [0.5, 0.25]), run("c", [0.5, 0.3])
    assert same_history.main([str(a), str(b)]) == 0
    assert "2 steps, 2 keys compared (timing/* and perf/* left out): identical" in capsys.readouterr().out
    assert same_history.main([str(a), str(c)]) == 1
    assert "step 2: actor/pg_loss" in capsys.readouterr().out


def test_decode_spans_bench_compares_spans_with_reading_the_whole_cache():
    proc = run_on_cpu("decode_spans.py", "--rows", "4", "--prompt", "8", "--new-tokens", "200", "--repeats", "1")
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("4 rows x (8 prompt + 200 new tokens), CPU, eager")
    assert lines[1].split()[:2] == ["whole", "cache"] and lines[2].split()[0] == "spans"
    assert lines[3].startswith("  spans / whole cache: ") and lines[3].endswith("x the time")


def test_fresh_case_runs_in_its_own_interpreter_with_its_own_compile_cache(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import decode_bench

    code = ("import json, os, sys, decode_bench\nprint('other output first')\n"
            "print(json.dumps({'args': sys.argv[1:], 'cache': os.environ['TORCHINDUCTOR_CACHE_DIR']}))")
    out = decode_bench.run_fresh(code, 1, "a", cache=str(tmp_path))
    assert out["args"] == ["1", "a"] and out["cache"] == str(tmp_path) and out["process_s"] > 0
    with pytest.raises(SystemExit, match="ZeroDivisionError"):
        decode_bench.run_fresh("1 / 0", cache=str(tmp_path))


@pytest.mark.slow
def test_decode_kept_bench_runs_each_case_on_the_path_it_names():
    lines = run_on_cpu("decode_kept.py", "--layers", "1", "--rows", "4").stdout.strip().splitlines()
    assert lines[1].strip().startswith("compiled as before") and lines[1].endswith("(1.00x)  kept False")
    assert lines[2].strip().startswith("kept version") and lines[2].endswith("kept True")


@pytest.mark.slow
def test_compile_cache_bench_loads_the_kept_step_with_no_compile():
    lines = run_on_cpu("compile_cache.py", "--layers", "1").stdout.strip().splitlines()
    assert "compiles 1, kept step True" in lines[1]
    assert all("compiles 0, kept step True" in line for line in lines[2:4]), lines
