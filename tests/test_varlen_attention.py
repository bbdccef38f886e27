"""Packed attention (models/varlen.py): equal to the sequences run one by one, forward and backward,
for the tiny model and Hugging Face models (Qwen2 with grouped-query heads, GPT-2, a sliding-window
Mistral), with no ``T x T`` tensor, and compiled blocks that keep one graph across packings. The
backend choice, the flash and torch varlen calls and the flex block mask are tested in
test_varlen_backends.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from resilient_rl.models import varlen, varlen_hf
from resilient_rl.models.hf import load_hf_causal_lm
from resilient_rl.models.packing import packed_layout
from resilient_rl.models.tiny import TinyCausalLM, TinyLMConfig
from resilient_rl.testing.packed_attention import CPU, LENGTHS, reference_attention as _reference_attention
from resilient_rl.workers.logprob import response_logprobs

VOCAB = 97


def _qwen2(max_positions: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return load_hf_causal_lm(hf_config={
        "model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": max_positions, "tie_word_embeddings": False})


def _gpt2(max_positions: int = 64) -> torch.nn.Module:
    """A family whose attention layers are not handed the position ids."""
    torch.manual_seed(0)
    return load_hf_causal_lm(hf_config={
        "model_type": "gpt2", "vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4,
        "n_positions": max_positions, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "bos_token_id": 0, "eos_token_id": 0})


def _tiny(max_positions: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyCausalLM(TinyLMConfig(vocab_size=VOCAB, hidden_size=32, num_heads=4, max_seq_len=max_positions))


def _packed(lengths: list[int], seed: int = 1) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return seqs, torch.cat(seqs)[None], positions


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def test_layout_reads_sequences_from_positions():
    positions = torch.tensor([[0, 1, 2, 0, 0, 1], [3, 4, 0, 1, 2, 0]])
    layout = packed_layout(positions)
    assert layout.lengths == (3, 1, 2, 2, 3, 1)  # every row starts a sequence, whatever its position
    assert layout.cu_seqlens.tolist() == [0, 3, 4, 6, 8, 11, 12]
    assert layout.sequence_ids.tolist() == [0, 0, 0, 1, 2, 2, 3, 3, 4, 4, 4, 5]


@pytest.mark.parametrize("rows", [1, 2])
def test_split_attention_equals_per_sequence_attention_with_grads(rows):
    torch.manual_seed(0)
    lengths = LENGTHS * rows
    seq = sum(LENGTHS)
    positions = torch.cat([torch.arange(n) for n in lengths]).view(rows, seq)
    q = torch.randn(rows, 4, seq, 8, requires_grad=True)
    k = torch.randn(rows, 2, seq, 8, requires_grad=True)
    v = torch.randn(rows, 2, seq, 8, requires_grad=True)
    out = varlen.varlen_attention(q, k, v, packed_layout(positions))
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, 8)).sum(), (q, k, v))

    def flat(x):  # rows end to end, as one row
        return x.transpose(0, 1).reshape(1, x.shape[1], rows * seq, 8)

    ref = _reference_attention(flat(q), flat(k), flat(v), lengths)
    ref_grads = torch.autograd.grad((ref * torch.linspace(-1, 1, 8)).sum(), (q, k, v))
    torch.testing.assert_close(flat(out), ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build", [_tiny, _qwen2, _gpt2], ids=["tiny", "qwen2", "gpt2"])
def test_packed_model_equals_sequences_alone_with_grads(build):
    model = build()
    seqs, ids, positions = _packed(LENGTHS)
    weights = torch.randn(ids.shape[1], VOCAB, generator=torch.Generator().manual_seed(2))
    packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    (packed * weights).sum().backward()
    packed_grads = _grads(model)
    alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    (alone * weights).sum().backward()
    alone_grads = _grads(model)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert packed_grads.keys() == alone_grads.keys() and packed_grads
    for name, grad in packed_grads.items():  # sums over other orders: rounding relative to the largest term
        scale = float(alone_grads[name].abs().max())
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-6 * max(scale, 1.0), msg=name)


def test_sliding_window_model_packs_sequences_longer_than_its_window():
    torch.manual_seed(0)
    model = load_hf_causal_lm(hf_config={
        "model_type": "mistral", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "sliding_window": 8})
    seqs, ids, positions = _packed(LENGTHS)  # 30 and 19 tokens are past the window
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        alone = [model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        # With explicit positions too, a row of one sequence keeps its window.
        alone_at = [model(input_ids=s[None], position_ids=torch.arange(len(s))[None], use_cache=False).logits[0]
                    for s in seqs]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(alone_at), torch.cat(alone), rtol=1e-5, atol=1e-5)
    model.config.sliding_window = None  # the window changes the result: the checks above see it
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    with torch.no_grad():
        assert not torch.allclose(alone[2], model(input_ids=seqs[2][None], use_cache=False).logits[0])


def test_hf_model_uses_varlen_attention_only_for_packed_calls(monkeypatch):
    model = _qwen2()
    assert model.config._attn_implementation == varlen_hf.HF_ATTENTION
    calls = []
    real = varlen_hf.varlen_attention
    monkeypatch.setattr(varlen_hf, "varlen_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    seqs, ids, positions = _packed([5, 3])
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False)
        assert len(calls) == 2  # one per layer
        # Left padding: the usual SDPA path with its mask, equal to the unpadded sequence.
        padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), seqs[1][None]], 1)
        mask = torch.tensor([[0, 0, 1, 1, 1]])
        out = model(input_ids=padded, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        torch.testing.assert_close(out[0, 2:], model(input_ids=seqs[1][None]).logits[0], rtol=1e-5, atol=1e-5)
    assert len(calls) == 2
    with torch.no_grad():
        model.train()  # attention dropout, where the model has some, applies per sequence
        model.config.attention_dropout = 0.5
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.5
        dropped = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        model.eval()
        assert not torch.allclose(dropped, model(input_ids=ids, position_ids=positions, use_cache=False).logits)
    assert len(calls) == 6
    calls.clear()
    with torch.no_grad():  # as transformers reads it, neither of these is a packed call: one causal row each
        model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions, use_cache=False)
        model(input_ids=ids, position_ids=positions, use_cache=True)
        model(input_ids=ids, use_cache=False)  # no positions: they count from 0 along the row
    assert calls == []


class _SquareRecorder(TorchDispatchMode):
    """Records the shape of every op output whose last two dims are both ``size``."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.found = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.shape[-2:] == (self.size, self.size):
                self.found.append((str(func), tuple(leaf.shape)))
        return out


@pytest.mark.parametrize("build", [_tiny, _qwen2], ids=["tiny", "qwen2"])
def test_packed_forward_and_backward_allocate_no_square_tensor(build):
    lengths = [1, 200, 90, 1, 150, 70]  # T = 512, no sequence as long as the row
    model = build(max_positions=256)
    seqs, ids, positions = _packed(lengths)
    total = ids.shape[1]
    assert total == 512
    with _SquareRecorder(total) as recorder:
        model(input_ids=ids, position_ids=positions, use_cache=False).logits.float().square().mean().backward()
    assert recorder.found == []
    # The recorder sees such tensors when they exist: a left-padded row builds its T x T mask.
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with torch.no_grad(), _SquareRecorder(total) as recorder:
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0) % 256)
    assert recorder.found


def test_packed_log_probs_of_an_hf_model_take_the_varlen_path():
    model = _qwen2(max_positions=256)
    gen = torch.Generator().manual_seed(3)
    prompt, response = 4, 252
    batch = {"input_ids": torch.randint(0, VOCAB, (2, prompt + response), generator=gen),
             "attention_mask": torch.ones(2, prompt + response, dtype=torch.long)}
    batch["attention_mask"][1, prompt + 4:] = 0  # the second response ends early: T = 256 + 8
    batch["attention_mask"][0, prompt + response - 8:] = 0
    batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    batch["responses"] = batch["input_ids"][:, prompt:]
    total = int(batch["attention_mask"].sum())
    with _SquareRecorder(total) as recorder:
        logp, _ = response_logprobs(model, batch, CPU, pack=True)
        logp.sum().backward()
    assert recorder.found == []
    with torch.no_grad():
        ref, _ = response_logprobs(model, batch, CPU)
    valid = batch["attention_mask"][:, prompt:].bool()
    torch.testing.assert_close(logp.detach()[valid], ref[valid], rtol=1e-5, atol=1e-5)


def test_compiled_blocks_keep_one_graph_across_packings():
    """Compiled transformer blocks leave the packed attention out of their graph, so a new set of
    sequence lengths does not recompile them; the result is the eager one."""
    from torch._dynamo.utils import counters, is_frozen_dataclass

    model, eager = _tiny(), _tiny()
    for block in model.layers:
        block.compile(backend="aot_eager", dynamic=True)
    counters.clear()
    graphs = []
    for lengths in ([3, 5, 9], [1, 20, 7, 7], [11, 11, 11, 11, 1]):
        _, ids, positions = _packed(lengths)
        logits = model(input_ids=ids, position_ids=positions).logits
        logits.sum().backward()
        torch.testing.assert_close(logits, eager(input_ids=ids, position_ids=positions).logits)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs == graphs[:1] * 3
    assert not counters["recompiles"]
    # torch 2.11's compiler builds every field of a frozen dataclass a compiled block is handed,
    # guarding on the number of sequences (torch 2.13 reads a field only when the code does).
    assert not is_frozen_dataclass(packed_layout(positions))


def _mistral_window() -> torch.nn.Module:
    torch.manual_seed(0)
    return load_hf_causal_lm(hf_config={
        "model_type": "mistral", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "sliding_window": 8})


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("build", [_qwen2, _gpt2, _mistral_window])
def test_packed_log_probs_with_the_layout_found_on_the_host_equal_the_padded_rows(build, rows, monkeypatch):
    """The packed log-prob pass finds the rows' layout on the host and hands transformers an
    all-ones mask with it (no packed-rows check on the device): the values of the padded rows, a
    sliding window kept (sequences of up to 30 tokens, window 8), and a micro-batch of one row."""
    from transformers import masking_utils

    from resilient_rl.models import packing

    model = build()
    gen = torch.Generator().manual_seed(5)
    prompt, response = 10, 20
    ids = torch.randint(1, VOCAB, (rows, prompt + response), generator=gen)
    mask = torch.ones_like(ids)
    for r, (p, n) in enumerate([(3, 20), (0, 7), (6, 12)][:rows]):
        mask[r, :p] = 0
        mask[r, prompt + n:] = 0
    batch = {"input_ids": ids * mask, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
             "responses": (ids * mask)[:, prompt:]}
    with torch.no_grad():
        padded, _ = response_logprobs(model, batch, CPU)
        # Neither the model's mask code nor transformers' packed-rows check looks at the positions.
        found = []
        monkeypatch.setattr(packing, "packed_layout", lambda positions: found.append(positions) or 1 / 0)
        monkeypatch.setattr(varlen_hf, "packed_layout", packing.packed_layout)
        monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: found.append(p) or 1 / 0)
        packed, _ = response_logprobs(model, batch, CPU, pack=True)
    assert not found
    valid = mask[:, prompt:].bool() & mask[:, prompt - 1:-1].bool()
    torch.testing.assert_close(packed[valid], padded[valid], rtol=1e-5, atol=1e-5)
