"""Validation passes: the held-out prompts scored with the current weights.

A pass generates responses for every held-out prompt through the rollout that serves training
(``data.val_batch_size`` prompts per call), with ``rollout.val_kwargs`` sampling (greedy by
default) from a stream of its own (:func:`~resilient_rl.workers.rollout.sampling_seed`), scores
them with the training task's reward and returns ``val/`` metrics. It changes no state: no
weights, no data position, no random stream of training. A worker that dies during a pass fails
the step it belongs to, which recovery rolls back and replays, pass included; the pass gives the
same result again, so a run with failures keeps the same history as one without.

Passes run after every ``trainer.test_freq``-th step and after the last step (their metrics join
that step's row), and, with ``trainer.val_before_train``, once before the first step (a row of its
own with ``step: 0``).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from resilient_rl.data.loader import PromptDataset
from resilient_rl.data.tasks import compute_rewards
from resilient_rl.trainer.step import make_prompts

#: The metric prefix of validation passes.
PREFIX = "val/"
#: Row key of a validation pass's wall time (not part of ``timing/step_s``, nor one of its phases).
DURATION_KEY = "timing/val_s"


class Validator:
    """Runs the validation passes of one run (``dataset`` None: validation is off)."""

    def __init__(self, cfg, dataset: Optional[PromptDataset], task, tokenizer):
        self.cfg, self.dataset, self.task, self.tokenizer = cfg, dataset, task, tokenizer

    @property
    def enabled(self) -> bool:
        return self.dataset is not None

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based, just trained) ends with a validation pass."""
        freq = self.cfg.trainer.test_freq
        return self.enabled and freq > 0 and (step % freq == 0 or step == self.cfg.trainer.total_steps)

    def due_before_train(self, step: int, history) -> bool:
        """Whether the pass before training is still to do: at step 0 with ``val_before_train``
        and no ``step: 0`` row in ``history`` yet (a roll-back to the start keeps that row)."""
        return (self.enabled and self.cfg.trainer.val_before_train and step == 0
                and not any(row.get("step") == 0 for row in history))

    def run(self, roles, step: int) -> dict[str, float]:
        """Score the held-out prompts with the rollout's weights ``step``; the ``val/`` metrics."""
        assert self.dataset is not None
        t0 = time.perf_counter()
        kw = self.cfg.rollout.val_kwargs
        temperature = kw.temperature if kw.do_sample else 0.0
        meta = {"seed": self.cfg.trainer.seed, "step": step, "weights_version": step,
                "temperature": temperature, "top_p": kw.top_p if kw.do_sample else 1.0}
        size = len(self.dataset)
        chunk = self.cfg.data.val_batch_size or size
        scores, lengths, sources = [], [], []
        for i, start in enumerate(range(0, size, chunk)):
            batch = self.dataset.gather(np.arange(start, min(start + chunk, size)))
            prompts = make_prompts(batch, kw.n, {**meta, "sampling_stream": f"val{i}"})
            data = roles.generate(prompts)
            mask = data.batch["response_mask"]
            extras = prompts.non_tensor_batch
            pad = self.tokenizer.pad_token_id
            scores.append(compute_rewards(self.task, self.tokenizer, data.batch["responses"] * mask + pad * (1 - mask),
                                          list(extras["answers"]), extras.get("data_source"),
                                          extras.get("extra_info")))
            lengths.append(mask.sum(dim=1).float().numpy())
            if "data_source" in extras:
                sources.append(np.asarray(extras["data_source"], dtype=object))
        return summarize(np.concatenate(scores), np.concatenate(lengths),
                         np.concatenate(sources) if sources else None, time.perf_counter() - t0)


def summarize(scores: np.ndarray, lengths: np.ndarray, sources: Optional[np.ndarray], seconds: float) -> dict:
    """The ``val/`` metrics of one pass: a NaN/Inf score counts as a failed response (as in training)."""
    bad = ~np.isfinite(scores)
    scores = np.where(bad, np.float32(0.0), scores)
    out = {"val/reward_mean": float(scores.mean()), "val/accuracy": float((scores >= 1.0).mean()),
           "val/response_length_mean": float(lengths.mean()), "val/samples": float(len(scores)),
           "val/reward_nonfinite": float(bad.sum())}
    if sources is not None:  # verl's data: a mean per data source too (verl's val-core/<source>/...)
        for source in sorted({str(s) for s in sources}):
            out[f"val/{source}/reward_mean"] = float(scores[sources.astype(str) == source].mean())
    out[DURATION_KEY] = float(seconds)
    return out
