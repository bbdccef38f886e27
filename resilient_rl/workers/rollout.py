"""The rollout engine: batched sampling with a KV cache from an unsharded copy of the policy.

``rollout.engine`` picks the decoder of the decode loop once, when the model is built: the static
engine's (:func:`~resilient_rl.models.engine.generate_static`) for the models it covers, else the
plain mode (:func:`~resilient_rl.models.generation.generate`: the model's own cache, eager).

It receives the actor's weights after every update (``load_weights``) together with a version
number; a generate request that names another version is refused, so stale weights can never
produce a batch silently. Sampling draws from a generator seeded by (run seed, step, rank), which
makes a replayed step after recovery sample exactly the same tokens.

Where it compiles its decode step, a process first takes the run's kept compiler artifacts and
rank 0 keeps what it compiled (:mod:`resilient_rl.workers.compile_cache`), so a process started
on another node later does not compile from scratch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from resilient_rl.errors import WorkerError
from resilient_rl.models.engine import compiles_decode, generate_static, resolve_engine
from resilient_rl.models.factory import build_causal_lm
from resilient_rl.models.fused_projections import fuse_projections
from resilient_rl.models.generation import generate
from resilient_rl.models.precision import cast_parameters
from resilient_rl.protocol import DataProto
from resilient_rl.workers.compile_cache import CompileCache
from resilient_rl.workers.fsdp import DevicePlan, to_device
from resilient_rl.workers.weight_sync import digest

#: The weights version of a rollout built empty, before it received any weights.
NO_WEIGHTS = -1


def sampling_seed(seed: int, step: int, rank: int, stream: str | None = None) -> int:
    """A 63-bit seed that is a pure function of its inputs; ``stream`` names a stream apart from
    the training step's (a validation pass samples from its own, leaving the step's untouched)."""
    key = f"{seed}:{step}:{rank}" + (f":{stream}" if stream else "")
    hashed = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(hashed[:8], "little") & ((1 << 63) - 1)


class RolloutEngine:
    """Generates responses for left-padded prompts."""

    def __init__(self, model_cfg, rollout_cfg, vocab_size: int, seed: int, plan: DevicePlan,
                 eos_token_id: int | Sequence[int] | None, pad_token_id: int, empty: bool = False,
                 compile_cache: CompileCache | None = None):
        """``eos_token_id``: one id or several (a response ends at the first of them).
        ``empty``: the weights are allocated, not initialised, and the version is
        :data:`NO_WEIGHTS` until the actor's first sync (generation refuses to run before it).
        ``compile_cache``: the run's kept compiler artifacts (None: this process's own only)."""
        self.plan = plan
        self.compile_cache = compile_cache
        self.cfg = rollout_cfg
        self.model = to_device(build_causal_lm(model_cfg, vocab_size, seed, empty=empty), plan.device)
        if plan.mixed_precision:  # the weights only: the rotary frequencies stay fp32, as the actor's
            cast_parameters(self.model, plan.param_dtype)
        # One product for q, k, v and one for gate, up (models/fused_projections.py); built empty,
        # nothing to copy into the fused weights before the first sync writes them.
        fuse_projections(self.model, copy=not empty)
        self.model.requires_grad_(False)
        self.model.train(False)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        #: "static" or "plain": what ``rollout.engine`` resolved to for this model.
        self.engine = resolve_engine(getattr(rollout_cfg, "engine", "auto"), self.model)
        self.version = NO_WEIGHTS if empty else 0
        if compile_cache is not None and self.compiles():
            compile_cache.adopt(plan.device, self.model)  # once per process, before its first compile

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Copy the actor's full weights in; returns the new version."""
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise WorkerError(f"rollout weight sync: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}",
                              role="rollout")
        self.version = int(version)
        return self.version

    def weights_digest(self) -> str:
        """sha256 over the parameters (to check that a sync really arrived)."""
        return digest(self.model.state_dict())

    def compiles(self) -> bool:
        """Whether generations compile the decode step (``rollout.compile``; unset: on a GPU)."""
        return self.engine == "static" and compiles_decode(getattr(self.cfg, "compile", None), self.plan.device)

    def generate_sequences(self, prompts: DataProto, rank: int) -> DataProto:
        meta = prompts.meta_info
        expected = meta.get("weights_version")
        if self.version == NO_WEIGHTS or (expected is not None and int(expected) != self.version):
            held = "no weights yet (built empty, never synced)" if self.version == NO_WEIGHTS else \
                f"weights version {self.version}"
            raise WorkerError(f"rollout rank {rank} holds {held}, asked for {expected}",
                              role="rollout", rank=rank, cause="stale_weights")
        gen = torch.Generator(device=self.plan.device)
        gen.manual_seed(sampling_seed(int(meta.get("seed", 0)), int(meta.get("step", 0)), rank,
                                      meta.get("sampling_stream")))
        args = dict(max_new_tokens=int(meta.get("max_new_tokens", self.cfg.max_new_tokens)),
                    temperature=float(meta.get("temperature", self.cfg.temperature)),
                    top_p=float(meta.get("top_p", self.cfg.top_p)), eos_token_id=self.eos_token_id,
                    pad_token_id=self.pad_token_id, generator=gen)
        ids = prompts.batch["input_ids"].to(self.plan.device)
        mask = prompts.batch["attention_mask"].to(self.plan.device)
        if self.engine == "static":
            out = generate_static(self.model, ids, mask, check_every=self.cfg.finish_check_every,
                                  compact_min_fraction=self.cfg.compact_min_fraction,
                                  cuda_graphs=self.cfg.cuda_graphs, compile=getattr(self.cfg, "compile", None),
                                  **args)
        else:
            out = generate(self.model, ids, mask, use_cache=True, **args)
        meta = {}
        if out.engine_stats is not None:
            stats = out.engine_stats
            if stats["compiles"] and rank == 0 and self.compile_cache is not None:
                self.compile_cache.publish(self.plan.device, self.model)
            meta["metrics"] = {"perf/decode_compiles": float(stats["compiles"]),
                               "perf/decode_graph_breaks": float(stats["graph_breaks"]),
                               "perf/decode_cudagraph_skips": float(stats["cudagraph_skips"]),
                               "perf/decode_compactions": float(stats["compactions"]),
                               "perf/decode_eager": float(stats["eager_fallback"] is not None),
                               "perf/decode_kept": float(stats["kept"]),
                               "perf/decode_steps": float(stats["steps"]),
                               "perf/decode_prefill_s": float(stats["prefill_s"]),
                               "perf/decode_loop_s": float(stats["loop_s"])}
            if stats["eager_fallback"] is not None:
                meta["decode_eager_reason"] = stats["eager_fallback"]
        return DataProto.from_dict({
            "prompts": prompts.batch["input_ids"].cpu(),
            "responses": out.responses.cpu(),
            "input_ids": out.sequences.cpu(),
            "attention_mask": out.attention_mask.cpu(),
            "position_ids": out.position_ids.cpu(),
            "response_mask": out.response_mask.cpu(),
        }, meta_info=meta)
