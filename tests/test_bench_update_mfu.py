"""bench/update_mfu.py: the actor's update pass alone, its MFU and where the device's time goes."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from resilient_rl.testing.bench_scripts import run_on_cpu


@pytest.fixture
def update_mfu(monkeypatch):
    from resilient_rl.testing.bench_scripts import BENCH

    monkeypatch.syspath_prepend(str(BENCH))
    import update_mfu

    return update_mfu


@pytest.mark.parametrize("op, kind", [
    ("aten::mm", "matrix products"), ("aten::addmm", "matrix products"), ("aten::bmm", "matrix products"),
    ("aten::_flash_attention_backward", "attention"), ("aten::_efficient_attention_forward", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"), ("aten::_fused_adamw_", "optimizer"),
    ("aten::_foreach_mul_", "optimizer"), ("Optimizer.step#AdamW.step", "optimizer"),
    ("aten::copy_", "copies and casts"), ("aten::_to_copy", "copies and casts"), ("aten::cat", "copies and casts"),
    ("nccl:all_gather", "collectives"), ("aten::mul", "elementwise and reductions"),
    ("aten::_log_softmax", "elementwise and reductions"), ("aten::mmx", "elementwise and reductions"),
])
def test_each_operator_has_one_kind_of_work(update_mfu, op, kind):
    assert update_mfu.kind_of(op) == kind


def _event(key, device, cpu_us=0.0, device_us=0.0):
    return SimpleNamespace(key=key, device_type=device, self_cpu_time_total=cpu_us, self_device_time_total=device_us)


def test_on_a_gpu_kinds_come_from_the_operators_and_the_busy_time_from_the_kernels_alone(update_mfu):
    """A kernel's time belongs to the operator that launched it: by kind from the operators, busy
    time and the longest list from the kernels; a record_function range that also shows on the
    device's timeline (under its CPU name) is neither a kernel nor counted twice."""
    events = [_event("aten::mm", DeviceType.CPU, 900, 3000), _event("aten::mul", DeviceType.CPU, 500, 1000),
              _event("Optimizer.step#AdamW.step", DeviceType.CPU, 400, 0),
              _event("aten::_fused_adamw_", DeviceType.CPU, 100, 500),
              _event("sm90_xmma_gemm_bf16", DeviceType.CUDA, 0, 3000),
              _event("vectorized_elementwise_kernel", DeviceType.CUDA, 0, 1000),
              _event("multi_tensor_apply_kernel", DeviceType.CUDA, 0, 500),
              _event("Optimizer.step#AdamW.step", DeviceType.CUDA, 0, 700)]
    kinds, kernels, busy = update_mfu.device_split(events, cuda=True)
    assert kinds == pytest.approx({"matrix products": 3e-3, "elementwise and reductions": 1e-3, "optimizer": 5e-4})
    assert [k for k, _ in kernels] == ["sm90_xmma_gemm_bf16", "vectorized_elementwise_kernel",
                                       "multi_tensor_apply_kernel"]
    assert busy == pytest.approx(4.5e-3)
    lines = update_mfu.profile_lines(kinds, kernels, busy, wall=0.01)
    assert any("matrix products" in line and "30.0 %" in line for line in lines)
    assert any(line.strip().startswith("idle") and "55.0 %" in line for line in lines)


def test_on_a_cpu_the_operators_own_time_is_the_device_time(update_mfu):
    events = [_event("aten::mm", DeviceType.CPU, 2000), _event("aten::exp", DeviceType.CPU, 1000),
              _event("aten::empty", DeviceType.CPU, 0)]
    kinds, ops, busy = update_mfu.device_split(events, cuda=False)
    assert kinds == pytest.approx({"matrix products": 2e-3, "elementwise and reductions": 1e-3})
    assert [k for k, _ in ops] == ["aten::mm", "aten::exp"] and busy == pytest.approx(3e-3)


def test_rows_are_laid_out_as_the_trainer_lays_them(update_mfu):
    """Prompts left-padded, responses right-padded, each from half its maximum to all of it."""
    b = update_mfu.ragged_rows(32, 16, 24, vocab=100)
    mask = b["attention_mask"]
    prompt, response = mask[:, :16].sum(-1), mask[:, 16:].sum(-1)
    assert prompt.min() >= 8 and prompt.max() <= 16 and response.min() >= 12 and response.max() <= 24
    assert len(set(response.tolist())) > 1  # the rows end at different lengths
    for r in range(32):
        assert mask[r, 16 - int(prompt[r]):16 + int(response[r])].all()  # one run of real tokens
    assert torch.equal(b["response_mask"], mask[:, 16:])
    assert torch.equal(b["responses"], b["input_ids"][:, 16:])
    assert (b["input_ids"][mask.bool()] >= 8).all() and (b["input_ids"][~mask.bool()] == 0).all()
    first = mask.argmax(-1)
    assert (b["position_ids"][torch.arange(32), first] == 0).all()


def test_update_flops_sum_each_row_at_its_own_length(update_mfu):
    from gpu_workloads import WORKLOADS, flop_params, pass_flops

    cfg = WORKLOADS["gsm8k-0.5b"].hf_config
    n = flop_params(cfg, "project")
    dims = (24, 14, 64)
    expected = pass_flops(n, *dims, 1, 100, True) + pass_flops(n, *dims, 1, 300, True)
    assert update_mfu.update_flops(cfg, [100, 300], "project") == pytest.approx(expected)
    assert update_mfu.update_flops(cfg, [100, 300], "project", training=False) == pytest.approx(expected / 3)
    # Attention grows with the square of the length: two rows of 200 cost less than 100 + 300.
    assert update_mfu.update_flops(cfg, [200, 200], "project") < expected


def test_a_variant_without_an_override_is_refused_with_its_form(update_mfu):
    with pytest.raises(SystemExit, match="NAME=KEY=VALUE"):
        update_mfu.parse_variant("ckpt")
    assert update_mfu.parse_variant("ckpt=actor.compile=true,actor.packing=false") == \
        ("ckpt", ["actor.compile=true", "actor.packing=false"])


def test_the_heaviest_operators_of_a_kind_are_listed_at_their_shapes(update_mfu):
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA

    def op(key, device_us, shapes, count=1, annotation=False):
        return SimpleNamespace(key=key, device_type=cpu, self_cpu_time_total=0.0, self_device_time_total=device_us,
                               input_shapes=shapes, count=count, is_user_annotation=annotation)

    events = [op("aten::copy_", 4000, [[8, 1536], [8, 1536]], 56), op("aten::copy_", 9000, [[8, 256], [8, 256]], 28),
              op("aten::_to_copy", 1000, [[1536, 1536]], 4), op("aten::mul", 3000, [[8, 1536], []], 112),
              op("aten::mm", 50000, [[8, 1536], [1536, 1536]]), op("actor.forward", 7000, [], annotation=True),
              SimpleNamespace(key="copy_kernel", device_type=cuda, self_cpu_time_total=0.0,
                              self_device_time_total=13000, input_shapes=[], count=84)]
    lines = update_mfu.heaviest_by_shape(events, cuda=True, top=2)
    assert [line.split() for line in lines] == [
        ["heaviest", "copies", "and", "casts,", "by", "input", "shapes:"],
        ["9.0", "ms", "28", "calls", "copy_", "[8,", "256],", "[8,", "256]"],
        ["4.0", "ms", "56", "calls", "copy_", "[8,", "1536],", "[8,", "1536]"],
        ["heaviest", "elementwise", "and", "reductions,", "by", "input", "shapes:"],
        ["3.0", "ms", "112", "calls", "mul", "[8,", "1536]"]]


def test_the_update_pass_runs_tiny_on_cpu_with_variants_and_its_profile(tmp_path):
    """As bench/gpu_figures.sh runs it (the head compiled, as on a GPU, against eager), and a variant
    of two overrides."""
    trace = tmp_path / "update_trace.json.gz"
    out = run_on_cpu("update_mfu.py", "--workload", "gsm8k-0.5b", "--rows", "16", "--repeats", "1",
                     "--trace", str(trace), "--variant", "eager_head=actor.compile_head=false",
                     "--variant", "ckpt=actor.activation_checkpointing=true,actor.compile_head=false",
                     timeout=300).stdout
    assert "gsm8k-0.5b-tiny on CPU: update of 16 rows" in out
    assert out.count("actor micro_batch_tokens=auto ->") == 3  # the memory plan, as a run prints it
    assert "(checkpointed)" in out.split("== variant ckpt")[1]
    assert "workload log-prob (head compiled, norms, rotary and SwiGLU compiled):" in out
    assert "workload update (head compiled, norms, rotary and SwiGLU compiled):" in out
    assert "eager_head update (head eager, norms, rotary and SwiGLU compiled):" in out
    assert "ckpt update (head eager, norms, rotary and SwiGLU compiled):" in out
    assert "x the workload's" in out
    assert "workload last update: actor/pg_loss" in out and "actor/nonfinite_skipped 0\n" in out
    assert "device time by kind of work" in out and "matrix products" in out and "idle (launches" in out
    # Where the host left the device idle, by the trainer's own phases of the update.
    idle = out.split("idle by phase (the host ran no operator")[1].split("longest 6 gaps:")[0]
    for phase in ("actor.prepare", "actor.forward", "logprob.pack", "logprob.head", "actor.loss", "actor.backward",
                  "actor.clip", "actor.optimizer", "actor.metrics"):
        assert f"\n    {phase} " in idle, phase
    assert "heaviest copies and casts, by input shapes:" in out and "heaviest elementwise and reductions" in out
    assert f"trace of the profiled update: {trace}" in out
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    # A record_function range is not an operator: never a kind of work nor a kernel of its own.
    profile = out.split("device time by kind of work")[1].split("idle by phase")[0]
    assert "actor.forward" not in profile and "actor.backward" not in profile
