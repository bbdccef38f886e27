"""The weight transfer from the actor to the rollout, as parts of their workers
(:mod:`resilient_rl.runtime.parts`): the actor's :class:`WeightSender` and the rollout's
:class:`WeightReceiver`, whose registered methods the worker pool calls at every sync.

Colocated, the actor writes its weights into the rollout's parameters on the device
(:mod:`~resilient_rl.workers.weight_sync`); split, actor rank 0 broadcasts them over a weight
channel (:mod:`~resilient_rl.workers.weight_channel`) or returns them for Ray's object store. Each
part is handed what it reads at each use: the role's engine now (rebuilt after a recovery), the
rank's device plan and its rank.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from resilient_rl.errors import WorkerError
from resilient_rl.runtime.dispatch import Dispatch, register
from resilient_rl.workers import weight_channel, weight_sync
from resilient_rl.workers.weight_sync import digest
from resilient_rl.workers.fsdp import DevicePlan, full_state_dict


class WeightSender:
    """The actor's side. ``engine()``: its engine now (``model``); ``plan()``: its device plan;
    ``rank()``: its rank; ``sink()``: the weight sink of the rollout in this process
    (:class:`~resilient_rl.workers.weight_sync.Sink`), or None where there is none."""

    def __init__(self, engine: Callable[[], Any], plan: Callable[[], DevicePlan], rank: Callable[[], int],
                 sink: Callable[[], weight_sync.Sink | None]) -> None:
        self.engine, self.plan, self._rank, self.sink = engine, plan, rank, sink

    @property
    def rank(self) -> int:
        return self._rank()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_weights(self, version: int, colocated: bool):
        """Colocated: write the weights into the rollout of this process, on the device, and return
        (bytes, seconds); split: rank 0 returns the gathered weights on CPU (for the object store)."""
        if colocated:
            t0 = time.perf_counter()
            sink = self.sink()
            if sink is None:
                raise WorkerError("weight sync: no rollout in this process registered its weights", role="actor",
                                  cause="stale_weights")
            nbytes = sink.push(self.engine().model, version)
            self._device_sync()
            return nbytes, time.perf_counter() - t0
        return self._gathered()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join_weight_channel(self, generation: int, addr: str, port: int, size: int, backend: str,
                            timeout_s: float) -> int | None:
        """Actor rank 0 hosts and joins the weight channel to the rollout (channel rank 0)."""
        if self.rank != 0:
            return None
        return weight_channel.join(generation, addr, port, 0, size, backend, timeout_s)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_layout(self) -> int:
        """The ranks the weights are sharded over as :meth:`send_weights` lays them out
        (:func:`~resilient_rl.workers.weight_sync.layout_world`)."""
        return weight_sync.layout_world(self.engine().model)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_weights(self, version: int):
        """Every actor rank gathers; rank 0 broadcasts over the weight channel. Returns (bytes, seconds)."""
        t0 = time.perf_counter()
        nbytes = weight_channel.send(self.engine().model, self.plan().param_dtype, is_root=self.rank == 0)
        self._device_sync()
        return nbytes, time.perf_counter() - t0

    def _device_sync(self) -> None:
        """Wait for the device's queued copies, so that a reported sync time is the copy's, not its launch's."""
        device = self.plan().device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_digest(self) -> str | None:
        """sha256 of the gathered weights on rank 0 (a collective: every rank must call it), in the
        dtype the rollout holds them in (the compute dtype: bf16 on a GPU, where the actor's master
        weights stay fp32), so that a sync that arrived has the rollout's digest."""
        state = full_state_dict(self.engine().model, all_ranks=False)
        return digest(state, self.plan().param_dtype) if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_weights(self) -> dict | None:
        """The gathered weights on rank 0 (tests compare them across placements and world sizes)."""
        return self._gathered()

    def _gathered(self) -> dict | None:
        """The full weights on rank 0, None on the others (a collective: every rank must call it)."""
        state = full_state_dict(self.engine().model, all_ranks=False)
        return state if self.rank == 0 else None


class WeightReceiver:
    """The rollout's side. ``engine()``: its engine now (``model``, ``version``, ``load_weights``);
    ``rank()``: its rank; ``replicated()``: whether the actor is replicated (ddp), so that its full
    weights arrive as from one rank. ``sink``: its engine's parameters as the destination of a
    colocated actor's syncs (set by :meth:`receive_into` at each model build)."""

    def __init__(self, engine: Callable[[], Any], rank: Callable[[], int], replicated: Callable[[], bool]) -> None:
        self.engine, self._rank, self.replicated = engine, rank, replicated
        self.sink: weight_sync.Sink | None = None

    def receive_into(self, model) -> None:
        """Make ``model``'s parameters the destination of this process's weight syncs (version unset)."""
        self.sink = weight_sync.Sink(model)

    @property
    def rank(self) -> int:
        return self._rank()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_weights(self, state: dict | None, version: int) -> int:
        """Load weights sent by the actor, or (colocated) check that the actor of this process wrote ``version``."""
        engine = self.engine()
        if state is None:
            if self.sink is None:
                raise WorkerError("weight sync: this rollout has no model to receive weights into", role="rollout",
                                  cause="stale_weights")
            self.sink.take(version)
            engine.version = int(version)
            return engine.version
        return engine.load_weights(state, version)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join_weight_channel(self, generation: int, addr: str, port: int, size: int, backend: str,
                            timeout_s: float) -> int:
        """Join the actor's weight channel as channel rank ``rank + 1``."""
        return weight_channel.join(generation, addr, port, self.rank + 1, size, backend, timeout_s)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_weights(self, version: int, layout_world: int) -> int:
        """Receive the weights actor rank 0 broadcasts over the weight channel, laid out for
        ``layout_world`` shards (the actor's ``weights_layout``); returns the new version."""
        engine = self.engine()
        weight_channel.receive(engine.model, 1 if self.replicated() else layout_world)
        engine.version = int(version)
        return engine.version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_version(self) -> int:
        return self.engine().version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_digest(self) -> str:
        return digest(self.engine().model.state_dict())
