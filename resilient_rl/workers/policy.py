"""The policy engine behind the actor and ref roles: log-probs and the PPO update.

It is plain PyTorch (no Ray), so the same code runs inside a Ray worker on an FSDP2 shard and in a
single process. The loss is normalised by the number of response tokens over the whole
data-parallel group, so a step on N ranks computes the same gradient as one process on the
concatenated batch (FSDP2 averages gradients over ranks, hence the ``world_size`` factor).
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from resilient_rl.algos.kl import kl_penalty
from resilient_rl.algos.losses import agg_loss, ppo_policy_loss
from resilient_rl.runtime import progress
from resilient_rl.models.factory import build_causal_lm
from resilient_rl.models.fused_elementwise import ELEMENTWISE_FAILURE, compiles_elementwise
from resilient_rl.models.fused_elementwise import compile_elementwise as compile_elementwise_of
from resilient_rl.models.precision import hand_on_in_autocast_dtype
from resilient_rl.protocol import DataProto
from resilient_rl.workers import memory_plan, micro_batch
from resilient_rl.workers.block_options import apply_block_options
from resilient_rl.workers.chunked_head import HEAD_FAILURE
from resilient_rl.workers.logprob import compiles_head, response_logprobs
from resilient_rl.workers.rank_state import RankState
from resilient_rl.workers.fsdp import DevicePlan, agreed_counts, wrap_model
from resilient_rl.workers.host_to_device import to_device
from resilient_rl.workers.optimizer import build_optimizer, build_scheduler
from resilient_rl.workers.update_loop import run_epochs


def planned_seq_len(model_cfg, model) -> int:
    """The longest sequence (prompt + response) a micro-batch row may have: ``model.max_seq_len``,
    else the model's own position limit."""
    length = getattr(model_cfg, "max_seq_len", None) or getattr(model.config, "max_position_embeddings", None) \
        or getattr(model.config, "max_seq_len", None)
    return int(length or 1)


class PolicyEngine:
    """A causal LM that scores responses and, when trainable, takes PPO steps.

    Log-probs are computed without full-vocabulary logits (:mod:`resilient_rl.workers.logprob`).
    With ``actor.micro_batch_tokens`` a mini-batch is split into token-sized micro-batches whose
    gradients accumulate before the one optimizer step (:mod:`resilient_rl.workers.micro_batch`);
    each micro-batch's loss is scaled by its share of the global token (or sequence) count, so
    the gradient equals the unsplit mini-batch's up to summation order.
    """

    def __init__(self, model_cfg, vocab_size: int, seed: int, plan: DevicePlan, actor_cfg=None,
                 total_steps: int = 1, trainable: bool = True, reshard_after_forward: bool = True,
                 empty: bool = False, colocated: tuple[str, ...] = (), kv_rows: int = 0, packing: bool = False,
                 compile_head: bool | None = None, compile_elementwise: bool | None = None, temperature: float = 1.0):
        """``empty``: the weights are allocated, not initialised, for a restore to fill (the
        caller must load the whole state before using the engine). ``colocated`` (the other roles
        sharing this process's device) and ``kv_rows`` (their rollout's cache rows) size
        ``actor.micro_batch_tokens=auto`` (:attr:`memory_plan`). ``packing``: for an engine
        without ``actor_cfg`` (the ref), whether its passes pack rows (``actor.packing``), and
        ``compile_head`` and ``compile_elementwise`` whether they compile the log-prob head's reductions
        and the norms, rotary embedding and SwiGLU (``actor.compile_head``, ``actor.compile_elementwise``).
        ``temperature``: the rollout's (``rollout.temperature``): log-probs and entropies are those
        of ``softmax(logits / T)``, the distribution the responses were sampled from (0, greedy: T = 1)."""
        self.plan = plan
        self.temperature = float(temperature) or 1.0
        self.cfg = actor_cfg
        self.trainable = trainable
        model = build_causal_lm(model_cfg, vocab_size, seed, empty=empty)
        if not trainable:
            model.requires_grad_(False)
        elif actor_cfg is not None:
            apply_block_options(model, actor_cfg.activation_checkpointing, actor_cfg.compile)
        # The ref (no actor config) follows ``auto``: a replica on CPU (its forward then runs no
        # FSDP hooks), FSDP2 shards on CUDA (less memory; once gathered, no collectives either).
        strategy = actor_cfg.strategy if actor_cfg is not None else "auto"
        self.model = wrap_model(model, plan, strategy, reshard_after_forward=reshard_after_forward)
        self.model.train(False)
        self._autocast = plan.autocast_enabled(self.model)
        if self._autocast:  # norms and rotary embeddings hand on bf16, as FSDP2's mixed precision does
            hand_on_in_autocast_dtype(self.model)
        self.compile_elementwise = compiles_elementwise(
            actor_cfg.compile_elementwise if actor_cfg is not None else compile_elementwise, plan.device,
            blocks=getattr(actor_cfg, "compile", False))
        if self.compile_elementwise:
            compile_elementwise_of(self.model)
        # A scoring-only engine (the ref) keeps one forward per batch, as before ``auto`` existed.
        self.micro_batch_tokens, self.memory_plan = memory_plan.resolve(
            getattr(actor_cfg, "micro_batch_tokens", None) if trainable else None, role="actor", model=self.model,
            device_plan=plan, role_cfg=actor_cfg, seq_len=planned_seq_len(model_cfg, self.model),
            colocated=colocated, kv_rows=kv_rows)
        self.packing = bool(getattr(actor_cfg, "packing", False) if actor_cfg is not None else packing)
        self.compile_head = compiles_head(actor_cfg.compile_head if actor_cfg is not None else compile_head,
                                          plan.device)
        self.optimizer = build_optimizer(self.model, actor_cfg.optim) if trainable else None
        self.scheduler = build_scheduler(self.optimizer, actor_cfg.optim, total_steps) if trainable else None
        # What checkpoints and snapshots of this rank carry (a role registers its own parts here).
        self.states = RankState(self) if trainable else None

    def _logprobs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(self.plan.device.type, dtype=self.plan.param_dtype, enabled=self._autocast):
            return response_logprobs(self.model, batch, self.plan.device, pack=self.packing,
                                     compile_head=self.compile_head, temperature=self.temperature)

    @torch.no_grad()
    def compute_log_prob(self, data: DataProto, micro_batch_size: int | None = None) -> DataProto:
        """Log-probs (and entropies) of the response tokens under the current weights, in
        micro-batches of ``micro_batch_size`` rows, else of ``actor.micro_batch_tokens`` tokens."""
        keys = ["input_ids", "attention_mask", "position_ids", "responses"]
        batch = {k: data.batch[k] for k in keys}
        if micro_batch_size:
            parts = [{k: v[i:i + micro_batch_size] for k, v in batch.items()}
                     for i in range(0, len(data), micro_batch_size)]
        else:
            parts = micro_batch.split(batch, self.micro_batch_tokens, self.packing,
                                      self._agreed_counts([batch])[0])
        logps, ents = [], []
        for part in parts:
            progress.advance("micro-batch")
            logp, ent = self._logprobs(part)
            logps.append(logp)
            ents.append(ent)
        # Read back once, after every micro-batch was launched: one read per micro-batch waited for
        # its forward, and the device then idled while the host packed the next one.
        return DataProto.from_dict({"log_probs": torch.cat(logps).cpu(), "entropys": torch.cat(ents).cpu()})

    def update(self, data: DataProto, step: int) -> dict[str, float]:
        """PPO epochs over mini-batches of ``data`` (this rank's share); one scheduler step
        (:func:`~resilient_rl.workers.update_loop.run_epochs`, ``actor/*`` metrics)."""
        keys = ["responses", "input_ids", "attention_mask", "position_ids", "response_mask", "old_log_probs",
                "advantages"] + (["ref_log_prob"] if self.cfg.use_kl_loss else [])
        seed = int(data.meta_info.get("seed", 0)) * 1_000_003 + step
        metrics = run_epochs(self, data, keys, seed, "actor", self._accumulate)
        if self.compile_head:  # 1 once a compiler failure left the head eager (its warning says why)
            metrics["perf/head_eager"] = float(HEAD_FAILURE["reason"] is not None)
        if self.compile_elementwise:  # the same for the norms, rotary and SwiGLU
            metrics["perf/actor_elementwise_eager"] = float(ELEMENTWISE_FAILURE["reason"] is not None)
        return metrics

    def _agreed_counts(self, batches) -> list[int]:
        """Micro-batches per batch, as many on every rank of an FSDP2 group (see
        :func:`~resilient_rl.workers.fsdp.agreed_counts`); no collective when batches are whole."""
        if self.micro_batch_tokens is None:
            return [1] * len(batches)
        return agreed_counts([micro_batch.count(b["attention_mask"], self.micro_batch_tokens, self.packing)
                              for b in batches], self.model, self.plan.device)

    def _accumulate(self, mb: DataProto, mask: torch.Tensor, tokens: torch.Tensor, seqs: torch.Tensor,
                    world: int, n_parts: int = 1) -> list[tuple[str, torch.Tensor]]:
        """Forward and backward of one mini-batch, in at least ``n_parts`` micro-batches; returns the
        mini-batch's loss terms (each micro-batch's weighted by its share of the mini-batch)."""
        cfg = self.cfg
        mb_tokens, mb_seqs = mask.sum().clamp(min=1.0), mask.bool().any(dim=-1).sum().clamp(min=1)
        sums: dict[str, torch.Tensor] = {}
        for part in micro_batch.split(dict(mb.batch.items()), self.micro_batch_tokens, self.packing, n_parts):
            with record_function("actor.forward"):
                logp, ent = self._logprobs(part)
            with record_function("actor.loss"):
                loss, pg, entropy, kl_loss, m = self._loss(part, logp, ent)
                # A local mean times world * (local units / global units) is this rank's share of the
                # global mean (FSDP averages gradients over ranks): units are tokens for token means,
                # sequences with a valid token for the policy loss's sequence means.
                # Every term is aggregated by ``loss_agg_mode`` (see :meth:`_loss`).
                if cfg.loss_agg_mode == "token-mean":
                    scaled = loss * (world * m.sum() / tokens)
                else:
                    scaled = loss * (world * m.bool().any(dim=-1).sum() / seqs)
            with record_function("actor.backward"):
                scaled.backward()
            # Metrics of the mini-batch: the loss terms weighted by their units (tokens, or
            # sequences with a valid token), the ratio's statistics by tokens (equal to the unsplit
            # mini-batch's values).
            tok_share = m.sum() / mb_tokens
            share = tok_share if cfg.loss_agg_mode == "token-mean" else m.bool().any(dim=-1).sum() / mb_seqs
            terms = [("actor/pg_loss", pg["pg_loss"].detach(), share), ("actor/entropy", entropy.detach(), share),
                     ("actor/pg_clipfrac", pg["pg_clipfrac"], tok_share),
                     ("actor/pg_clipfrac_lower", pg["pg_clipfrac_lower"], tok_share),
                     ("actor/ppo_kl", pg["ppo_kl"], tok_share)]
            if kl_loss is not None:
                terms.append(("actor/kl_loss", kl_loss.detach(), share))
            for k, v, share in terms:
                sums[k] = sums.get(k, 0.0) + v * share
        return list(sums.items())

    def _loss(self, part: dict, logp: torch.Tensor, ent: torch.Tensor):
        """The PPO loss of one micro-batch: ``(loss, policy-loss terms, entropy, KL loss or None,
        response mask)``, each aggregated over the micro-batch by ``actor.loss_agg_mode`` (token
        mean, or mean over sequences), as verl aggregates all three."""
        cfg, dev = self.cfg, self.plan.device
        m = to_device(part["response_mask"], dev).float()
        pg = ppo_policy_loss(to_device(part["old_log_probs"], dev), logp, to_device(part["advantages"], dev), m,
                             clip_ratio=cfg.clip_ratio, loss_agg_mode=cfg.loss_agg_mode, clip_ratio_c=cfg.clip_ratio_c)
        loss = pg["pg_loss"]
        entropy = agg_loss(ent, m, cfg.loss_agg_mode)
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * entropy
        kl_loss = None
        if cfg.use_kl_loss:
            kl = kl_penalty(logp, to_device(part["ref_log_prob"], dev), cfg.kl_loss_type)
            kl_loss = agg_loss(kl, m, cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl_loss
        return loss, pg, entropy, kl_loss, m
