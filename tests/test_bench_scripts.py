"""The benchmark scripts' CPU paths: bench/gpu.py without a GPU, its FLOPs and report helpers,
bench/train.py's weight-sync comparison, and the smaller benches (snapshots, generation, decode
compile, profile, spans and kept steps, the recovery path, same_history, store listing). Figures are made up;
nothing here times anything. bench/gpu.py --workload is tested in test_bench_workloads.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient_rl.models.tiny import TinyCausalLM, TinyLMConfig
from resilient_rl.telemetry.device import GpuSampler
from resilient_rl.testing.bench_scripts import BENCH, REPO, run_on_cpu
from resilient_rl.testing.fake_nvml import FakeGpu, FakeNVML


@pytest.fixture
def report(bench):
    """bench/gpu_report.py, the figures bench/gpu.py prints."""
    import gpu_report

    return gpu_report


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


def test_format_report_counts_each_prompt_s_prefill_once_in_the_generation(report):
    """A prompt's samples share one prefill: with 2 prompts x 4 samples of 100 response tokens in a
    step of 1000 tokens (200 of them prompt tokens, 25 a row), the generation computes the 800
    response tokens and 50 prompt tokens, not 1000."""
    rows = [dict(r, **{"response_length/mean": 100.0}) for r in _rows()]
    n = 10**9
    kwargs = dict(n_params=n, ppo_epochs=2, need_ref=True, critic_epochs=None, device_name="NVIDIA H100 80GB HBM3",
                  peak=100e12, n_gpus=1, util={}, copy_s=None, stalls=[])
    lines = report.format_report(rows, prompts=2, samples=4, **kwargs)
    gen = next(line for line in lines if line.strip().startswith("gen"))
    assert "4.2 TFLOP/s" in gen, gen  # 2 x 1e9 x 850 FLOP in 0.4 s
    formula = next(line for line in lines if line.startswith("model FLOPs/step"))
    assert "T_gen = 850" in formula and "its 4 samples sharing its prefill" in formula
    assert "= 17.7 TFLOP" in formula  # (2 + 2 + 12) x 1e12 + 2 x 1e9 x 850
    # Without the rows' response lengths every row's prompt is counted, as before.
    plain = report.format_report(_rows(), prompts=2, samples=4, **kwargs)
    assert "= 18.0 TFLOP" in "\n".join(plain) and "(T_gen =" not in "\n".join(plain)


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
    unfused = next(line for line in out.splitlines() if "compiled, unfused" in line)
    assert "1 compiles" in unfused and "eager fallback: None" in unfused, unfused
    assert "projections fused / unfused, compiled: " in out
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


def test_snapshot_checksum_bench_times_both_checksums_on_one_buffer():
    lines = run_on_cpu("snapshot_checksum.py", "--gib", "0.2", "--repeats", "1").stdout.strip().splitlines()
    assert lines[0].startswith("checksum of 0.21 GB, median of 1:")
    assert lines[1].split()[:3] == ["one", "piece,", "one"] and lines[1].endswith("1.00x")
    assert lines[2].lstrip().startswith("pieces of 64 MiB,") and lines[2].endswith("x")


def test_optimizer_bench_times_both_adamw_forms_in_turn_and_compares_their_weights():
    lines = run_on_cpu("optimizer.py", "--tiny", "--repeat", "1").stdout.strip().splitlines()
    assert lines[0].startswith("AdamW over 26 tensors,") and "(gsm8k-0.5b-tiny, 2 blocks), cpu" in lines[0]
    assert lines[1].split()[0] == "foreach" and lines[1].endswith("1.00x")
    assert lines[2].split()[0] == "fused" and lines[2].endswith("x")
    assert float(lines[3].rsplit(": ", 1)[1]) < 1e-6  # the same update within fp32 rounding


def test_snapshot_restore_bench_writes_the_state_both_ways_bit_for_bit():
    lines = run_on_cpu("snapshot_restore.py", "--tiny", "--repeat", "1").stdout.strip().splitlines()
    assert "(104 tensors: gsm8k-0.5b-tiny, 2 blocks" in lines[0] and "into cpu tensors" in lines[0]
    assert [line.split()[0] for line in lines[1:3]] == ["direct", "staged"] and lines[1].endswith("1.00x")
    assert lines[3].endswith("bit for bit: True")


def test_rollout_build_bench_times_both_ways_in_fresh_processes():
    lines = run_on_cpu("rollout_build.py", "--tiny", "--repeats", "1").stdout.strip().splitlines()
    assert lines[0] == "an empty rollout of gsm8k-0.5b-tiny on this CPU, fresh processes, median of 1:"
    assert "fused weights copied (before)" in lines[1] and "fused weights allocated (now)" in lines[2]
    assert lines[3].startswith("  ratio: ") and lines[3].endswith("x")


def test_fused_elementwise_bench_times_each_way_and_counts_what_autograd_keeps():
    out = run_on_cpu("fused_elementwise.py", "--tokens", "64", "--repeat", "1").stdout.strip().splitlines()
    assert out[0].startswith("elementwise work of a gsm8k-1.5b block, 64 tokens, cpu")
    assert out[1] == "  RMS norm (hidden 1536, fp32 in, bf16 out)" and out[2].split()[5] == "1.00x"
    kept = {line.split("  ")[2].strip(): float(line.split("kept")[1].split()[0]) for line in out[2:5]}
    # The module keeps its input, its fp32 normalised copy and a scale a token; compiled, the input and the scale.
    assert kept == {"Hugging Face's module": 12.29, "F.rms_norm": 12.29, "compiled": 6.15}
    assert out[7] == "  rotary embedding (12 query and 2 key heads of 128, bf16)"
    # Both keep cos and sin (bf16, 128 a token each), the compiled one sin with its first half negated.
    assert [float(line.split("kept")[1].split()[0]) for line in out[8:10]] == [0.51, 0.51]
    assert out[11] == "  SwiGLU (intermediate 8960, bf16)"
    assert [float(line.split("kept")[1].split()[0]) for line in out[12:14]] == [53.76, 35.84]  # gate, up (, silu)
    assert out[-1].startswith("  a block's two norms, rotary embedding and SwiGLU: eager ") and out[-1].endswith("x)")


def test_activation_bytes_bench_counts_both_ways_in_one_run():
    lines = run_on_cpu("activation_bytes.py", "--workload", "gsm8k-0.5b", "--layers", "1", "--vocab", "512",
                       "--rows", "4", "--prompt", "16", "--response", "32").stdout.strip().splitlines()
    before, after, ratio = lines[-3:]
    assert before.startswith("norms and rotary fp32 (before): ") and after.startswith("norms and rotary bf16: ")
    assert "KB a token written outside the products" in after and "_to_copy" in before
    assert ratio.startswith("ratio: ") and float(ratio.split()[1].rstrip("x")) < 1.0


@pytest.mark.slow  # the same stuck controller runs in the default set: chaos/test_stuck_controller.py
@pytest.mark.ray
def test_stuck_controller_bench_prints_each_order_ended_by_the_watch():
    out = run_on_cpu("stuck_controller.py", "--no-baseline", timeout=300).stdout.splitlines()
    assert out[0].split() == ["case", "watch", "handlers", "alone", "ratio"]
    assert [line.split(" s, exit ")[1].split()[0] for line in out[1:]] == ["143", "143"]
    assert [line[:27].strip() for line in out[1:]] == ["sent", "acted on"]


def test_gpu_release_bench_times_a_killed_process_and_one_that_frees_itself_on_host_memory():
    lines = run_on_cpu("gpu_release.py", "--gib", "0.5", "--repeats", "2").stdout.strip().splitlines()
    # On a CPU the reading is the child's own resident set, which the suite's other processes do not move.
    assert len(lines) == 3 and all(line.startswith(f"repeat {i + 1}: killed holding 0.5 GiB (0.5 GiB measured): "
                                                   "reaped after ") for i, line in enumerate(lines[:2])), lines
    assert "freed by itself after" in lines[0]
    assert lines[2].startswith("host memory, 0.5 GiB, medians of 2: a killed process's memory free after ")
    assert lines[2].endswith("x")


def test_commit_listing_bench_commits_on_both_sides_and_prints_what_each_lists():
    proc = run_on_cpu("commit_listing.py", "--kept", "3", "--aside-files", "40", "--commits", "2", timeout=300)
    lines = proc.stdout.splitlines()
    assert lines[1].endswith("listings: find run/step_00003002, ls run, find run, ls run, find run, ls run/abandoned")
    assert lines[2].endswith("listings: find run/step_00003002, ls run, ls run/abandoned") and "baseline / this code:" in lines[3]


@pytest.mark.parametrize("store", ["object", "tree"])
def test_store_listing_bench_compares_each_command_with_the_sequential_reads(store):
    out = run_on_cpu("store_listing.py", "--steps", "2", "--ranks", "2", "--latency-ms", "1", "--repeat", "1",
                     "--store", store).stdout.strip().splitlines()
    assert out[0].startswith("run: 2 steps of 10 files,") and f"{store} " in out[0]
    assert [line.split(":")[0].strip() for line in out[1:]] == ["verify", "resume", "list"]
    for line in out[1:]:
        assert "baseline" in line and "this code" in line and line.endswith("x")
