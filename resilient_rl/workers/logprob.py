"""Log-probs and entropies of the chosen response tokens without full-vocabulary logits.

A causal LM's forward ends with ``lm_head(hidden)``: ``[batch, len, vocab]`` logits, which for a
151 k vocabulary and GSM8K-length responses is the largest tensor of the step (and its fp32 copy,
its softmax and their gradients come on top). :func:`response_logprobs` instead runs the model's
own forward with its output layer replaced, for that call, by a head that

- keeps only the positions that predict response tokens (``P-1 .. P+R-2``), so the prompt's
  positions never reach the vocabulary projection;
- projects them ``_CHUNK_ELEMENTS`` logits at a time and reduces each chunk at once to the
  chosen token's log-prob and the entropy (fp32), so at most one chunk of logits exists;
- with gradients, recomputes each chunk's logits in the backward pass instead of keeping them:
  the autograd graph holds the hidden states, not the logits (one extra projection of the
  response positions in the backward pass), and the chunks' weight gradients are summed in fp32
  in one buffer, the weight cast to the compute dtype once per pass
  (:mod:`resilient_rl.workers.chunked_head`).

With ``compile_head`` (``actor.compile_head``; null: on a GPU) a chunk's reductions and their
gradient run compiled: eagerly each reduction and each elementwise step of the log-prob and
the entropy reads and writes the chunk's fp32 logits once more, forward and backward, and these
passes over the vocabulary can cost more device time than the head's matrix product; inductor fuses
them into a few kernels that read the logits once or twice. A process compiles two graphs, the
statistics and their gradient (the chunk's rows are a symbol), and the values equal the eager
ones within float rounding.

The forward still goes through ``model(...)``, so FSDP2's hooks gather and free parameters as
usual and the head computes inside the unsharded window. Per row the arithmetic is the one of
:func:`~resilient_rl.algos.losses.logprobs_from_logits` and
:func:`~resilient_rl.algos.losses.entropy_from_logits` on the same logits; the head's matrix
product runs on a chunk's rows instead of all of them, and the BLAS library may block a product
of another shape differently, so the results equal the full-logits path's within float rounding
(often bit for bit; tests/test_chunked_logprob.py checks 1e-6), and a run with the same chunk
size is bit-reproducible with itself. Gradients are the same terms, the logits' in closed form
and summed in another order (the full path's head gradient also sums the zero rows of the prompt
positions), equal within float rounding (rtol 1e-5): weights after an update differ from the full
path's in the last bits, and a run stays bit-reproducible with itself.
Models that post-process logits after the head (Gemma's final soft-capping, Cohere's logit
scale) take the full-logits path.

``temperature``: the statistics are those of the distribution the rollout samples from,
``softmax(logits / T)``, as verl computes them: the PPO ratio, the KL terms and the entropy then
judge the policy that produced the tokens. The chunked head divides its inputs instead of each
chunk's logits, ``logits / T = (hidden / T) W^T + b / T``, one pass over the response positions'
hidden states, and the gradients follow through the division.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function

from resilient_rl.algos.losses import entropy_from_logits, logprobs_from_logits
from resilient_rl.errors import ModelInputError
from resilient_rl.models.packing import PackedLayout, given_layout, packed_layout
from resilient_rl.workers.chunked_head import chunked_head_stats
from resilient_rl.workers.host_to_device import to_device

__all__ = ["PackedRows", "compiles_head", "full_response_logprobs", "packed_inputs", "response_logprobs",
           "supports_chunked_head"]

#: Logits of one chunk: 2^26 fp32 values (256 MiB), e.g. 443 tokens of a 151 k vocabulary.
_CHUNK_ELEMENTS = 1 << 26

# Config attributes of families whose forward transforms the head's output.
_POST_HEAD = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def supports_chunked_head(model: nn.Module) -> bool:
    """Whether ``model``'s logits are its output layer's output, untransformed (see module docs)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return False
    config = getattr(model, "config", None)
    return not any(getattr(config, name, None) not in (None, 1, 1.0) for name in _POST_HEAD)


def compiles_head(compile_head: bool | None, device: torch.device | str) -> bool:
    """Whether the chunked head's reductions run compiled: ``compile_head``
    (``actor.compile_head``), or, when None, on CUDA."""
    return torch.device(device).type == "cuda" if compile_head is None else bool(compile_head)


def _chunked_head(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, chunk_elements: int,
                  packed: PackedRows | None = None, compiled: bool = False, temperature: float = 1.0) -> torch.Tensor:
    """``[B, R, 2]`` log-probs and entropies of ``labels`` ``[B, R]`` from the last positions of
    ``hidden`` ``[B, T, H]`` at ``temperature``; for packed rows (``packed``), from the flat tokens
    that predict each response token, and zeros where a response token is padding. ``compiled``:
    the chunks' reductions compiled (:func:`~resilient_rl.workers.chunked_head.chunked_head_stats`)."""
    if packed is not None:
        # Integer indices found on the host: neither these nor their gradients read the device back.
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, packed.sources)
        picked = labels[packed.targets]
        stats = _chunked_head(flat[None, :, :], head, picked[None, :], chunk_elements, None, compiled, temperature) \
            if flat.shape[0] else flat.new_zeros((1, 0, 2), dtype=torch.float32)
        return stats.new_zeros((*labels.shape, 2)).index_put(packed.targets, stats[0])
    resp_len = labels.shape[1]
    # A packed row's hidden states arrive already gathered: one position per label.
    h = hidden[:, -resp_len - 1:-1] if hidden.shape[1] > resp_len else hidden
    rows = max(1, chunk_elements // head.out_features)
    h, bias = h.reshape(-1, h.shape[-1]), head.bias
    if temperature != 1.0:  # logits / T, with no chunk of logits divided (see the module docs)
        h, bias = h / temperature, (None if bias is None else bias / temperature)
    out = chunked_head_stats(h, head.weight, bias, labels.reshape(-1), rows, compiled)
    # A tensor of its own, not a view of ``out``: it is the model's output, on which FSDP2 hooks
    # its backward (and warns about a view, where an in-place op would lose that hook).
    return out.reshape(*labels.shape, 2).clone()


@contextlib.contextmanager
def _head_replaced(head: nn.Module, forward) -> Iterator[None]:
    # An instance attribute shadows the class's forward for this call only; parameter names,
    # hooks and FSDP2 state stay untouched.
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def _model_inputs(data, device: torch.device) -> dict[str, torch.Tensor]:
    b = data.batch if hasattr(data, "batch") else data
    return {k: to_device(b[k], device) for k in ("input_ids", "attention_mask", "position_ids")}


@dataclass(frozen=True)
class PackedRows:
    """Where the response tokens of packed rows come from, on the device: ``targets``, the (row,
    column) of each response token that some token predicts, and ``sources``, the packed index of
    that token; ``layout``, the packed row's :class:`~resilient_rl.models.packing.PackedLayout`."""

    targets: tuple[torch.Tensor, torch.Tensor]
    sources: torch.Tensor
    layout: PackedLayout


def packed_inputs(data, device: torch.device) -> tuple[dict[str, torch.Tensor], PackedRows]:
    """The batch's real tokens (attention mask 1) end to end in one row, without padding
    (:mod:`resilient_rl.models.packing`), and their :class:`PackedRows`.

    Laid out where the batch is (a worker's batch is on the host: selecting tokens by a mask reads
    the mask's count back, a wait on the device's queue were it there), then moved to ``device``
    without a wait (:func:`~resilient_rl.workers.host_to_device.to_device`)."""
    b = data.batch if hasattr(data, "batch") else data
    mask = b["attention_mask"].bool()
    resp_len = b["responses"].shape[1]
    index = mask.reshape(-1).cumsum(0).reshape(mask.shape) - 1  # packed index of each real token
    predicted = mask[:, -resp_len:] & mask[:, -resp_len - 1:-1]
    positions = b["position_ids"][mask.to(b["position_ids"].device)][None]
    layout = packed_layout(positions)
    move = functools.partial(to_device, device=device)
    rows = PackedRows(tuple(move(t) for t in predicted.nonzero(as_tuple=True)),
                      move(index[:, -resp_len - 1:-1][predicted]), layout.map_tensors(move))
    inputs = dict(input_ids=move(b["input_ids"][mask.to(b["input_ids"].device)][None]), attention_mask=None,
                  position_ids=move(positions))
    return inputs, rows


def full_response_logprobs(model: nn.Module, data, device: torch.device,
                           temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference path: full ``[B, T, V]`` logits over ``temperature``, then log-probs and
    entropies ``[B, R]``."""
    b = data.batch if hasattr(data, "batch") else data
    labels = b["responses"].to(device)
    out = model(**_model_inputs(data, device), use_cache=False)
    logits = out.logits[:, -labels.shape[1] - 1:-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


def response_logprobs(model: nn.Module, data, device: torch.device, chunk_elements: int | None = None,
                      pack: bool = False, compile_head: bool = False,
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[B, R]`` (fp32) of ``data``'s response tokens (a DataProto or a
    dict with ``input_ids``, ``attention_mask``, ``position_ids``, ``responses``), without
    full-vocabulary logits when the model allows it (:func:`supports_chunked_head`).

    ``pack``: the rows' real tokens run as one packed row (:func:`packed_inputs`), so no padding
    is computed; response tokens under the attention mask (after the end) then get 0.
    ``compile_head``: each chunk's reductions compiled; ``temperature``: the rollout's (see the
    module docstring)."""
    if not supports_chunked_head(model):
        if pack:
            raise ModelInputError(f"{type(model).__name__} transforms its logits after the output layer: "
                                  "packed sequences need the chunked head (set packing to false)")
        return full_response_logprobs(model, data, device, temperature)
    b = data.batch if hasattr(data, "batch") else data
    labels = to_device(b["responses"], device)
    head = model.get_output_embeddings()
    chunk_elements = _CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    with record_function("logprob.pack" if pack else "logprob.inputs"):
        inputs, rows = packed_inputs(data, device) if pack else (_model_inputs(data, device), None)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        with record_function("logprob.head"):
            return _chunked_head(hidden, head, labels, chunk_elements, rows, compile_head, temperature)

    # Packed: the model's mask code takes the layout found on the host (models/packing.py).
    given = given_layout(inputs["position_ids"], rows.layout) if rows is not None else contextlib.nullcontext()
    with _head_replaced(head, forward), given:
        stats = model(**inputs, use_cache=False).logits
    return stats[..., 0], stats[..., 1]
