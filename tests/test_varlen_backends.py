"""Packed attention's backends (models/varlen.py): which one is chosen where (flash-attn, torch's
varlen kernel, the per-sequence split), what the flash and torch calls hand their kernels (stand-ins:
no GPU here), a failing torch kernel leaving the process on split, and the flex path's block mask
compiled once (the packed models themselves: test_varlen_attention.py)."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from resilient_rl.errors import ModelInputError
from resilient_rl.models import varlen, varlen_flex, varlen_hf
from resilient_rl.models.packing import packed_layout
from resilient_rl.testing.packed_attention import CPU, LENGTHS, reference_attention as _reference_attention


def test_flash_is_chosen_on_cuda_when_importable(monkeypatch):
    """No GPU here: a stand-in ``flash_attn`` module checks what the flash path hands the kernel."""
    seen = {}

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size):
        seen.update(shapes=(q.shape, k.shape), cu=cu_q.tolist(), longest=(max_q, max_k), causal=causal,
                    window=window_size)
        assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
        lengths = torch.diff(cu_q).tolist()
        out = _reference_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                   lengths)
        return out[0].transpose(0, 1)

    varlen._flash_varlen_func.cache_clear()
    # No device runs torch's own varlen kernel (a CUDA build of torch without a GPU would ask the driver).
    monkeypatch.setattr(varlen, "_flash_capable", lambda index: False)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert varlen.choose_backend(torch.device("cuda"), torch.bfloat16) == "split"  # not installed
    varlen._flash_varlen_func.cache_clear()
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    try:
        assert varlen.choose_backend(torch.device("cuda"), torch.bfloat16) == "flash"
        assert varlen.choose_backend(torch.device("cuda"), torch.float32) == "split"  # the kernel has no fp32
        assert varlen.choose_backend(torch.device("cpu"), torch.bfloat16) == "split"
        positions = torch.cat([torch.arange(n) for n in LENGTHS * 2]).view(2, -1)
        layout = packed_layout(positions)
        q, k, v = torch.randn(2, 4, 62, 8), torch.randn(2, 2, 62, 8), torch.randn(2, 2, 62, 8)
        out = varlen.varlen_attention(q, k, v, layout, backend="flash")
    finally:
        varlen._flash_varlen_func.cache_clear()
    assert seen == {"shapes": ((124, 4, 8), (124, 2, 8)), "cu": layout.cu_seqlens.tolist(), "longest": (30, 30),
                    "causal": True, "window": (-1, -1)}
    torch.testing.assert_close(out, varlen.varlen_attention(q, k, v, layout, backend="split"))


def _varlen_attn_stand_in(calls: list, gqa_flag: bool = True):
    """A stand-in for ``torch.nn.attention.varlen.varlen_attn`` (torch 2.13's signature, flash-attn's
    window: ``(left, 0)`` lets a query see ``left`` keys before it, ``-1`` all of them), computed per
    sequence with SDPA under an explicit mask."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        calls.append({"shapes": (tuple(query.shape), tuple(key.shape)), "cu": cu_seq_q.tolist(),
                      "dtype": cu_seq_q.dtype, "longest": (max_q, max_k), "window": window_size, "gqa": enable_gqa})
        assert torch.equal(cu_seq_q, cu_seq_k) and window_size[1] == 0
        if not enable_gqa:
            assert query.shape[1] == key.shape[1]
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        lengths = torch.diff(cu_seq_q).tolist()
        parts = []
        for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths)):
            ahead = torch.arange(len(q))[:, None] - torch.arange(len(q))[None, :]
            seen = (ahead >= 0) & ((ahead <= window_size[0]) if window_size[0] >= 0 else True)
            parts.append(F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                        attn_mask=seen, scale=scale).transpose(0, 1))
        return torch.cat(parts)

    if not gqa_flag:  # the signature of a torch whose varlen_attn has no enable_gqa
        def older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                  window_size=(-1, -1)):
            return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                               window_size=window_size)
        return older
    return varlen_attn


def test_torch_varlen_is_chosen_on_cuda_without_flash_attn(monkeypatch):
    """No GPU here (torch's varlen kernels are CUDA-only): a stand-in for torch's ``varlen_attn``
    checks what the torch path hands it, forward and backward, with grouped heads and a window."""
    assert varlen._torch_varlen_func() is not None  # this torch's varlen_attn takes window_size
    calls: list = []
    monkeypatch.setattr(varlen, "_flash_varlen_func", lambda: None)
    monkeypatch.setattr(varlen, "_torch_varlen_func", lambda: _varlen_attn_stand_in(calls))
    monkeypatch.setattr(varlen, "_flash_capable", lambda index: True)
    cuda = torch.device("cuda")
    assert varlen.choose_backend(cuda, torch.bfloat16) == "torch"
    assert varlen.choose_backend(cuda, torch.float16) == "torch"
    assert varlen.choose_backend(cuda, torch.float32) == "split"  # the kernels have no fp32
    assert varlen.choose_backend(CPU, torch.bfloat16) == "split"
    assert varlen.choose_backend(cuda, torch.bfloat16, dropout=0.1) == "split"  # no attention dropout
    monkeypatch.setattr(varlen, "_flash_capable", lambda index: False)  # e.g. compute capability 7.5
    assert varlen.choose_backend(cuda, torch.bfloat16) == "split"

    positions = torch.cat([torch.arange(n) for n in LENGTHS * 2]).view(2, -1)
    layout = packed_layout(positions)
    torch.manual_seed(0)
    inputs = [torch.randn(2, 4, 62, 8), torch.randn(2, 2, 62, 8), torch.randn(2, 2, 62, 8)]
    for window in (None, 5):
        outs, grads = [], []
        for backend in ("torch", "split"):
            q, k, v = (x.clone().requires_grad_() for x in inputs)
            out = varlen.varlen_attention(q, k, v, layout, scale=0.3, backend=backend, window=window)
            out.square().sum().backward()
            outs.append(out.detach())
            grads.append([x.grad for x in (q, k, v)])
        torch.testing.assert_close(outs[0], outs[1])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)
    assert [c["window"] for c in calls] == [(-1, 0), (4, 0)]
    assert calls[0] == {"shapes": ((124, 4, 8), (124, 2, 8)), "cu": layout.cu_seqlens.tolist(), "dtype": torch.int32,
                        "longest": (30, 30), "window": (-1, 0), "gqa": True}

    # torch 2.11's varlen_attn has no enable_gqa: the grouped heads are repeated to the query heads first.
    monkeypatch.setattr(varlen, "_torch_varlen_func", lambda: _varlen_attn_stand_in(calls, gqa_flag=False))
    monkeypatch.setattr(varlen, "_flash_capable", lambda index: True)
    assert varlen.choose_backend(cuda, torch.bfloat16) == "torch"
    outs, grads = [], []
    for backend in ("torch", "split"):
        q, k, v = (x.clone().requires_grad_() for x in inputs)
        out = varlen.varlen_attention(q, k, v, layout, scale=0.3, backend=backend)
        (out * torch.arange(8.0)).sum().backward()  # unequal weights: a wrong head pairing shows in every grad
        outs.append(out.detach())
        grads.append([x.grad for x in (q, k, v)])
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert calls[-1]["shapes"] == ((124, 4, 8), (124, 4, 8)) and calls[-1]["gqa"] is False
    with pytest.raises(ModelInputError, match="dropout"):
        varlen.varlen_attention(*inputs, layout, backend="torch", dropout=0.1)


def test_a_failing_torch_varlen_kernel_leaves_the_process_on_split(monkeypatch, caplog):
    """The first choice of a backend is logged; a kernel that raises where it was chosen (not asked
    for by name) is reported once, the call is computed split, and the process chooses split from
    then on."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    enable_gqa=False):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore detail")

    monkeypatch.setattr(varlen, "_TORCH_VARLEN_FAILED", [])
    monkeypatch.setattr(varlen, "_ANNOUNCED", set())
    monkeypatch.setattr(varlen, "_flash_varlen_func", lambda: None)
    monkeypatch.setattr(varlen, "_torch_varlen_func", lambda: varlen_attn)
    monkeypatch.setattr(varlen, "_flash_capable", lambda index: True)
    assert varlen.choose_backend(torch.device("cuda"), torch.bfloat16) == "torch"
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).view(1, -1)
    layout = packed_layout(positions)
    q, k, v = (torch.randn(1, h, 62, 8, dtype=torch.bfloat16) for h in (4, 2, 2))
    with pytest.raises(RuntimeError, match="Ampere"):  # asked for by name: its error is the caller's
        varlen.varlen_attention(q, k, v, layout, backend="torch")
    assert varlen._TORCH_VARLEN_FAILED == []
    on_a_gpu = varlen.choose_backend
    monkeypatch.setattr(varlen, "choose_backend",  # the tensors are on the CPU; the choice as on a GPU
                        lambda device, dtype, dropout: on_a_gpu(torch.device("cuda"), dtype, dropout))
    with caplog.at_level("INFO", logger=varlen.__name__):
        out = varlen.varlen_attention(q, k, v, layout)
        varlen.varlen_attention(q, k, v, layout)
    torch.testing.assert_close(out, varlen.varlen_attention(q, k, v, layout, backend="split"))
    assert varlen._TORCH_VARLEN_FAILED == ["RuntimeError: FlashAttention only supports Ampere GPUs or newer."]
    assert [r.getMessage() for r in caplog.records] == [
        "packed attention: torch's varlen kernel (torch.nn.attention.varlen)",
        "packed attention: torch's varlen kernel failed (RuntimeError: FlashAttention only supports Ampere GPUs "
        "or newer.); this process attends per sequence from now on"]
    assert on_a_gpu(torch.device("cuda"), torch.bfloat16) == "split"


def test_a_torch_varlen_kernel_out_of_device_memory_raises_and_stays_chosen(monkeypatch):
    """Running out of memory is not a kernel the device cannot run: the error reaches the pass
    (which names the keys to change), and the process keeps the varlen kernel."""
    def varlen_attn(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(varlen, "_TORCH_VARLEN_FAILED", [])
    monkeypatch.setattr(varlen, "_ANNOUNCED", set())
    monkeypatch.setattr(varlen, "_flash_varlen_func", lambda: None)
    monkeypatch.setattr(varlen, "_torch_varlen_func", lambda: varlen_attn)
    monkeypatch.setattr(varlen, "_flash_capable", lambda index: True)
    on_a_gpu = varlen.choose_backend
    monkeypatch.setattr(varlen, "choose_backend",  # the tensors are on the CPU; the choice as on a GPU
                        lambda device, dtype, dropout: on_a_gpu(torch.device("cuda"), dtype, dropout))
    layout = packed_layout(torch.cat([torch.arange(n) for n in LENGTHS]).view(1, -1))
    q, k, v = (torch.randn(1, h, 62, 8, dtype=torch.bfloat16) for h in (4, 2, 2))
    with pytest.raises(torch.OutOfMemoryError):
        varlen.varlen_attention(q, k, v, layout)
    assert varlen._TORCH_VARLEN_FAILED == [] and on_a_gpu(torch.device("cuda"), torch.bfloat16) == "torch"


def test_flex_block_mask_and_forward_without_recompiling(monkeypatch):
    """The flex path's block mask is the document-causal mask, and a second length does not
    recompile. Flex has no backward on the CPU and the CPU compiler is not the GPU's, so this
    compiles without code generation (``aot_eager``) and runs forward only."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setattr(varlen_flex, "_FLEX", [torch.compile(flex_attention, dynamic=True, backend="aot_eager")])
    counters.clear()
    for lengths in ([1, 65, 59, 44, 88, 83, 33, 111, 300], [3, 40, 200, 7], [128, 128, 1]):
        layout = packed_layout(torch.cat([torch.arange(n) for n in lengths])[None])
        ids, total = layout.sequence_ids, sum(lengths)
        dense = create_block_mask(lambda b, h, q, kv: (ids[q] == ids[kv]) & (kv <= q), None, None, total, total,
                                  device="cpu")
        assert torch.equal(varlen.document_block_mask(layout, CPU).to_dense(), dense.to_dense())
        q, k, v = torch.randn(1, 4, total, 16), torch.randn(1, 2, total, 16), torch.randn(1, 2, total, 16)
        torch.testing.assert_close(varlen.varlen_attention(q, k, v, layout, backend="flex"),
                                   _reference_attention(q, k, v, lengths), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_under_autocast_the_varlen_kernel_takes_the_packed_model_in_autocasts_dtype(monkeypatch):
    """A replica computes under bf16 autocast over fp32 weights, and a Hugging Face model's query
    and key then leave the rotary embedding in fp32 (bf16 projection times fp32 cos/sin). The
    backend is chosen, and the kernel fed, in the dtype SDPA would compute in under autocast: bf16,
    so a GPU takes the varlen kernel, not one SDPA call per sequence."""
    from resilient_rl.models.hf import load_hf_causal_lm

    calls: list = []
    stand_in = _varlen_attn_stand_in(calls, gqa_flag=False)  # torch 2.11's signature: heads repeated

    def recording(query, key, value, *args, **kwargs):
        calls.append({"dtypes": (query.dtype, key.dtype, value.dtype)})
        return stand_in(query, key, value, *args, **kwargs)

    monkeypatch.setattr(varlen, "_flash_varlen_func", lambda: None)
    monkeypatch.setattr(varlen, "_torch_varlen_func", lambda: recording)
    monkeypatch.setattr(varlen, "_flash_capable", lambda index: True)
    on_a_gpu = varlen.choose_backend
    chosen: list = []
    monkeypatch.setattr(varlen, "choose_backend",  # the tensors are on the CPU; the choice as on a GPU
                        lambda device, dtype, dropout: chosen.append(dtype) or on_a_gpu(torch.device("cuda"), dtype,
                                                                                          dropout))
    torch.manual_seed(0)
    model = load_hf_causal_lm(hf_config={
        "model_type": "qwen2", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64, "tie_word_embeddings": False})
    ids = torch.randint(0, 97, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    logits.float().square().mean().backward()
    assert chosen == [torch.bfloat16]  # once for the packed forward, which both layers then take
    assert [c["dtypes"] for c in calls if "dtypes" in c] == [(torch.bfloat16,) * 3] * 2
    assert all(p.grad is not None for p in model.parameters())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same model and rows, one SDPA call per sequence
        split = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits
                           for a, b in zip([0, *itertools.accumulate(LENGTHS)][:-1], itertools.accumulate(LENGTHS))], 1)
    split.float().square().mean().backward()
    torch.testing.assert_close(logits.float(), split.float(), rtol=0.02, atol=0.02)
    for name, p in model.named_parameters():
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(grads[name], p.grad, rtol=0.05, atol=0.05 * max(scale, 1e-3), msg=name)


def test_the_bench_times_the_shapes_and_ways_it_is_asked_for():
    """bench/varlen.py as bench/gpu_figures.sh runs it: only the named shapes and ways, the split
    (every way's reference) always among them; an unknown name is a usage error."""
    from resilient_rl.testing.bench_scripts import run_on_cpu

    out = run_on_cpu("varlen.py", "--shapes", "tiny", "--ways", "padded", "--repeat", "1").stdout
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["tiny:", "split", "padded"]
    with pytest.raises(AssertionError, match="--ways: unknown sideways"):
        run_on_cpu("varlen.py", "--ways", "sideways")  # its stderr is the failed assertion's message


def _traceable_varlen_kernel():
    """A stand-in for torch's ``varlen_attn`` that the compiler traces as it does torch's: a custom
    operator with a fake and an autograd formula (computed per sequence with SDPA on the CPU)."""
    import torch.library

    def attend(q, k, v, cu, scale):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        lengths = torch.diff(cu).tolist()
        return torch.cat([F.scaled_dot_product_attention(a.transpose(0, 1), b.transpose(0, 1), c.transpose(0, 1),
                                                         is_causal=True, scale=scale).transpose(0, 1)
                          for a, b, c in zip(q.split(lengths), k.split(lengths), v.split(lengths))])

    if not hasattr(torch.ops.rrl_test, "varlen"):
        @torch.library.custom_op("rrl_test::varlen", mutates_args=())
        def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
                   scale: float | None) -> torch.Tensor:
            return attend(q, k, v, cu, scale)

        @torch.library.custom_op("rrl_test::varlen_backward", mutates_args=())
        def varlen_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                            scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            # Causal attention's gradient per sequence, in fp32 (autograd does not run inside an operator).
            groups = q.shape[1] // k.shape[1]
            s = q.shape[-1] ** -0.5 if scale is None else scale
            dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32) for t in (q, k, v))
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                qs, go = q[a:b].float().transpose(0, 1), grad[a:b].float().transpose(0, 1)  # [h, n, D]
                ks, vs = (t[a:b].float().transpose(0, 1).repeat_interleave(groups, 0) for t in (k, v))
                causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
                p = torch.softmax((qs @ ks.transpose(1, 2) * s).masked_fill(~causal, float("-inf")), -1)
                dp = go @ vs.transpose(1, 2)
                ds = p * (dp - (dp * p).sum(-1, keepdim=True))
                dq[a:b] = (ds @ ks * s).transpose(0, 1)
                dk[a:b] = (ds.transpose(1, 2) @ qs * s).unflatten(0, (-1, groups)).sum(1).transpose(0, 1)
                dv[a:b] = (p.transpose(1, 2) @ go).unflatten(0, (-1, groups)).sum(1).transpose(0, 1)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

        varlen.register_fake(lambda q, k, v, cu, longest, scale: torch.empty_like(q))
        varlen_backward.register_fake(lambda grad, q, k, v, cu, scale: (torch.empty_like(q), torch.empty_like(k),
                                                                         torch.empty_like(v)))

        def setup(ctx, inputs, output):
            ctx.save_for_backward(*inputs[:4])
            ctx.scale = inputs[5]

        def backward(ctx, grad):
            q, k, v, cu = ctx.saved_tensors
            return (*torch.ops.rrl_test.varlen_backward(grad, q, k, v, cu, ctx.scale), None, None, None)

        varlen.register_autograd(backward, setup_context=setup)

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False):
        return torch.ops.rrl_test.varlen(query, key, value, cu_seq_q, max_q, scale)

    return varlen_attn


def test_compiled_blocks_run_the_varlen_kernel_inside_their_graph(monkeypatch):
    """``actor.compile`` on a GPU with a varlen kernel (here a traceable stand-in, chosen as on a
    GPU): the packed forward's kernel is decided before the blocks run, so each block stays one
    graph across micro-batches of other layouts, with no graph break (the split backend breaks
    each block at its attention), and computes what the eager model does."""
    from torch._dynamo.utils import counters

    from resilient_rl.models.hf import load_hf_causal_lm
    from resilient_rl.workers.block_options import apply_block_options
    from resilient_rl.workers.logprob import response_logprobs

    monkeypatch.setattr(varlen, "_flash_varlen_func", lambda: None)
    monkeypatch.setattr(varlen, "_torch_varlen_func", _traceable_varlen_kernel)
    monkeypatch.setattr(varlen, "_flash_capable", lambda index: True)
    on_a_gpu = varlen.choose_backend
    monkeypatch.setattr(varlen, "choose_backend", lambda device, dtype, dropout: on_a_gpu(torch.device("cuda"),
                                                                                           dtype, dropout))
    starts, plans = [], []  # the sequence starts go to the device once a forward, in its plan
    for module, name, calls in ((varlen, "_cu_seqlens", starts), (varlen_hf, "plan_kernel", plans)):
        monkeypatch.setattr(module, name, lambda *a, _f=getattr(module, name), _calls=calls: _calls.append(1) or _f(*a))
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, *a, **k: compile_module(self, *a, **{**k, "backend": "aot_eager"}))
    config = {"model_type": "qwen2", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
              "max_position_embeddings": 128, "tie_word_embeddings": True}
    torch.manual_seed(0)
    eager = load_hf_causal_lm(hf_config=config)
    model = load_hf_causal_lm(hf_config=config)
    model.load_state_dict(eager.state_dict())
    apply_block_options(model, compile=True)
    torch._dynamo.reset()
    counters.clear()
    frames = []
    for i, (rows, prompt, resp) in enumerate([(4, 16, 24), (5, 20, 30), (3, 12, 40)]):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(3, 97, (rows, prompt + resp), generator=g)
        mask = torch.ones_like(ids)
        for r in range(rows):
            mask[r, :int(torch.randint(0, prompt // 2, (), generator=g))] = 0
            mask[r, prompt + int(torch.randint(1, resp, (), generator=g)):] = 0
        batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                 "responses": ids[:, prompt:]}
        out = {}
        for name, m in (("compiled", model), ("eager", eager)):
            m.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp, ent = response_logprobs(m, batch, torch.device("cpu"), pack=True)
            (logp.sum() + ent.sum()).backward()
            out[name] = (logp.detach(), m.model.layers[0].self_attn.q_proj.weight.grad.clone())
        frames.append(counters["stats"]["unique_graphs"])
        torch.testing.assert_close(out["compiled"][0], out["eager"][0], rtol=0.02, atol=0.02)
        torch.testing.assert_close(out["compiled"][1], out["eager"][1], rtol=0.05, atol=0.05)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert frames[0] > 0 and frames == [frames[0]] * len(frames), frames
    assert plans and len(starts) == len(plans)  # none per layer, eager or compiled
