"""The graphs the compiler is given for the rollout engine's decode step, recorded while a block
runs (inductor still compiles them), with a fresh compiler state before and the step's own after."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from resilient_rl.models.decode_step import DecodeStep


@contextmanager
def recorded_decode_graphs():
    """Yields the list the decode step's graphs are appended to as they are compiled."""
    from torch._inductor.compile_fx import compile_fx

    graphs: list = []

    def recording_inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    saved = DecodeStep.backend, dict(DecodeStep._compiled), DecodeStep.failure
    DecodeStep.backend, DecodeStep._compiled, DecodeStep.failure = recording_inductor, {}, None
    torch._dynamo.reset()
    try:
        yield graphs
    finally:
        DecodeStep.backend, DecodeStep._compiled, DecodeStep.failure = saved
