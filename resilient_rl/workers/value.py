"""The value engine behind the critic role: per-token values and the clipped value update."""

from __future__ import annotations

import torch
from torch.profiler import record_function

from resilient_rl.algos.losses import value_loss
from resilient_rl.models.factory import build_value_model
from resilient_rl.models.fused_elementwise import ELEMENTWISE_FAILURE, compile_elementwise, compiles_elementwise
from resilient_rl.models.precision import hand_on_in_autocast_dtype
from resilient_rl.protocol import DataProto
from resilient_rl.workers import memory_plan, micro_batch
from resilient_rl.workers.host_to_device import to_device
from resilient_rl.workers.block_options import apply_block_options
from resilient_rl.workers.fsdp import DevicePlan, agreed_counts, wrap_model
from resilient_rl.workers.optimizer import build_optimizer, build_scheduler
from resilient_rl.workers.policy import planned_seq_len
from resilient_rl.workers.update_loop import run_epochs
from resilient_rl.workers.rank_state import RankState


def response_values(model, data, device: torch.device) -> torch.Tensor:
    """Value of the state before each response token (positions ``P-1 .. P+R-2``); ``data`` is a
    DataProto or a dict of its tensors."""
    b = data.batch if hasattr(data, "batch") else data
    resp_len = b["responses"].shape[1]
    values = model(**{k: to_device(b[k], device) for k in ("input_ids", "attention_mask", "position_ids")})
    return values[:, -resp_len - 1:-1].float()


class ValueEngine:
    """A value model (backbone + scalar head) trained with the clipped value loss."""

    def __init__(self, model_cfg, critic_cfg, vocab_size: int, seed: int, plan: DevicePlan, total_steps: int = 1,
                 empty: bool = False, colocated: tuple[str, ...] = (), kv_rows: int = 0):
        """``empty``, ``colocated`` and ``kv_rows``: as for
        :class:`~resilient_rl.workers.policy.PolicyEngine` (``critic.micro_batch_tokens=auto``)."""
        self.plan = plan
        self.cfg = critic_cfg
        model = apply_block_options(build_value_model(model_cfg, vocab_size, seed, empty=empty),
                                    critic_cfg.activation_checkpointing, critic_cfg.compile)
        self.model = wrap_model(model, plan, critic_cfg.strategy, reshard_after_forward=critic_cfg.reshard_after_forward)
        self.micro_batch_tokens, self.memory_plan = memory_plan.resolve(
            critic_cfg.micro_batch_tokens, role="critic", model=self.model, device_plan=plan, role_cfg=critic_cfg,
            seq_len=planned_seq_len(model_cfg, self.model), colocated=colocated, kv_rows=kv_rows)
        self.model.train(False)
        self._autocast = plan.autocast_enabled(self.model)
        if self._autocast:  # norms and rotary embeddings hand on bf16, as FSDP2's mixed precision does
            hand_on_in_autocast_dtype(self.model)
        self.compile_elementwise = compiles_elementwise(critic_cfg.compile_elementwise, plan.device,
                                                        blocks=critic_cfg.compile)
        if self.compile_elementwise:
            compile_elementwise(self.model)
        self.optimizer = build_optimizer(self.model, critic_cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, critic_cfg.optim, total_steps)
        # What checkpoints and snapshots of this rank carry (a role registers its own parts here).
        self.states = RankState(self)

    def _values(self, data) -> torch.Tensor:
        with torch.autocast(self.plan.device.type, dtype=self.plan.param_dtype, enabled=self._autocast):
            return response_values(self.model, data, self.plan.device)

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> DataProto:
        """Values of the states before each response token (0 under the mask), in micro-batches
        of ``critic.micro_batch_tokens`` tokens."""
        batch = {k: data.batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
        parts = micro_batch.split(batch, self.micro_batch_tokens, at_least=self._agreed_counts([batch])[0])
        values = torch.cat([self._values(part) for part in parts]).cpu()  # read back once (see the policy's)
        return DataProto.from_dict({"values": values * data.batch["response_mask"]})

    def update(self, data: DataProto, step: int) -> dict[str, float]:
        """Value-loss epochs over mini-batches of ``data``; one scheduler step
        (:func:`~resilient_rl.workers.update_loop.run_epochs`, ``critic/*`` metrics)."""
        keys = ["responses", "input_ids", "attention_mask", "position_ids", "response_mask", "values", "returns"]
        seed = int(data.meta_info.get("seed", 0)) * 1_000_003 + step + 7
        metrics = run_epochs(self, data, keys, seed, "critic",
                             lambda mb, mask, tokens, _seqs, world, n: self._accumulate(mb, mask, tokens, world, n))
        if self.compile_elementwise:  # 1 once a compiler failure left the norms, rotary and SwiGLU eager
            metrics["perf/critic_elementwise_eager"] = float(ELEMENTWISE_FAILURE["reason"] is not None)
        return metrics

    def _agreed_counts(self, batches) -> list[int]:
        """As :meth:`~resilient_rl.workers.policy.PolicyEngine._agreed_counts` (values run padded)."""
        if self.micro_batch_tokens is None:
            return [1] * len(batches)
        return agreed_counts([micro_batch.count(b["attention_mask"], self.micro_batch_tokens) for b in batches],
                             self.model, self.plan.device)

    def _accumulate(self, mb: DataProto, mask: torch.Tensor, tokens: torch.Tensor,
                    world: int, n_parts: int = 1) -> list[tuple[str, torch.Tensor]]:
        """Forward and backward of one mini-batch, micro-batch by micro-batch (token-weighted
        loss terms; see :class:`~resilient_rl.workers.policy.PolicyEngine`)."""
        dev = self.plan.device
        mb_tokens = mask.sum().clamp(min=1.0)
        sums: dict[str, torch.Tensor] = {}
        for part in micro_batch.split(dict(mb.batch.items()), self.micro_batch_tokens, at_least=n_parts):
            with record_function("critic.forward"):
                vpreds = self._values(part)
            with record_function("critic.loss"):
                m = to_device(part["response_mask"], dev).float()
                values, returns = (to_device(part[k], dev) for k in ("values", "returns"))
                vf_loss, vf_clipfrac = value_loss(vpreds, values, returns, m, self.cfg.cliprange_value)
            with record_function("critic.backward"):
                (vf_loss * (world * m.sum() / tokens)).backward()
            share = m.sum() / mb_tokens
            for k, v in (("critic/vf_loss", vf_loss.detach()), ("critic/vf_clipfrac", vf_clipfrac),
                         ("critic/vpred_mean", (vpreds.detach() * m).sum() / m.sum().clamp(min=1.0))):
                sums[k] = sums.get(k, 0.0) + v * share
        return list(sums.items())
