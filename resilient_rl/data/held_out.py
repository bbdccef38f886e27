"""Held-out prompts: the validation set a run scores every ``trainer.test_freq`` steps.

They come from ``data.val_path`` (JSONL, or verl's parquet by its ending), read by the same
readers as the training file and checked the same way (an unreadable file, a bad line or row, an
answer the reward cannot score or a prompt that does not fit is a ConfigError naming the file and
line before any worker starts), or, for a built-in task, ``data.val_num_prompts`` prompts generated
from a seed of their own, none of them one of the training prompts. They are scored by the
training task's reward.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from resilient_rl.config.data_sections import PARQUET_SUFFIX
from resilient_rl.data.loader import PromptDataset
from resilient_rl.data.tasks import Sample, Task, read_jsonl, read_parquet
from resilient_rl.data.tokenizer import Tokenizer
from resilient_rl.errors import ConfigError

#: Mixed into ``data.seed`` for a built-in task's held-out prompts (the training prompts use the seed alone).
HELD_OUT_STREAM = 0x76616C
#: Draws per held-out prompt before a built-in task is found too small to hold them out.
_DRAWS_PER_PROMPT = 100


def read_val_file(path: str) -> list[Sample]:
    """The samples of the validation file ``path`` (JSONL, or verl's parquet by its ending)."""
    if path.lower().endswith(PARQUET_SUFFIX):
        return read_parquet(path, "data.val_path")
    return read_jsonl(path, "data.val_path")


def generated_held_out(task: Task, n: int, seed: int, train_prompts) -> list[Sample]:
    """``n`` samples of a built-in ``task`` drawn from their own stream of ``seed``, skipping any
    prompt among ``train_prompts`` (and repeats): a ConfigError when the task has too few."""
    rng = np.random.default_rng((seed, HELD_OUT_STREAM))
    seen = set(train_prompts)
    out: list[Sample] = []
    for _ in range(n * _DRAWS_PER_PROMPT):
        (sample,) = task.make_prompts(1, rng)
        if sample.prompt not in seen:
            seen.add(sample.prompt)
            out.append(sample)
            if len(out) == n:
                return out
    raise ConfigError(f"data.val_num_prompts={n}: data.task={task.name!r} yields only {len(out)} prompts that "
                      "are not training prompts; lower it, or widen data.min_digits/data.max_digits")


def held_out_dataset(data_cfg, tokenizer: Tokenizer, task: Task, train: PromptDataset) -> Optional[PromptDataset]:
    """The validation set the ``data`` section describes (None: it names none)."""
    if data_cfg.val_path is not None:
        samples = read_val_file(data_cfg.val_path)
        check = getattr(task, "check_references", None)  # data.reward_fn's check, for a built-in task too
        if check is not None:
            check(samples)
    elif data_cfg.val_num_prompts > 0:
        samples = generated_held_out(task, data_cfg.val_num_prompts, data_cfg.seed, train.prompts)
    else:
        return None
    return PromptDataset(samples, tokenizer, task, data_cfg.max_prompt_length)
