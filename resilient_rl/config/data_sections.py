"""The data and reward config sections: where prompts come from and how responses are scored.

``data.task`` picks the prompts: a built-in task generated from a seed, or a file of prompts
(``jsonl``, or ``parquet`` in verl's layout). Left unset it follows ``data.path``: a ``.parquet``
file is read as verl's data, any other file as JSONL, and no file means the built-in ``copy``
task. A file's responses are scored by ``data.reward_fn`` (``(response, answer)``) or by a
verl-style ``compute_score(data_source, solution_str, ground_truth, extra_info)`` named by the
``custom_reward_function`` section (verl's own keys); the root config checks that exactly one
is given (:meth:`resilient_rl.config.schema.Config.validate`). A built-in task scores with its
own reward unless ``data.reward_fn`` replaces it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from resilient_rl.config.section import choice, require, Section
from resilient_rl.config.sections import BUILTIN_REWARDS, BUILTIN_TASKS, FILE_TASKS

#: The ending that makes an unset ``data.task`` read ``data.path`` as verl's parquet data.
PARQUET_SUFFIX = ".parquet"


def default_task(path: Optional[str]) -> str:
    """The task an unset ``data.task`` means for ``data.path``."""
    if path is None:
        return "copy"
    return "parquet" if path.lower().endswith(PARQUET_SUFFIX) else "jsonl"


@dataclass
class DataConfig(Section):
    """Prompts: a built-in task or a file (JSONL, verl's parquet), and how they are batched."""

    #: null: from ``path`` (see :func:`default_task`); the root config resolves it, so a saved
    #: config names the task (not here: a section built as a default must keep null).
    task: Optional[str] = None
    #: A file task's prompts: JSONL, or verl's parquet (by its ending).
    path: Optional[str] = None
    #: What scores responses, ``(response, answer) -> float``: a built-in (``exact_match``,
    #: ``partial_match``, ``gsm8k``) or ``module:function``; it replaces a built-in task's own
    #: reward (and ``partial_credit``); null: the task's own (a file task needs a reward).
    reward_fn: Optional[str] = None
    #: Built-in tasks: how many prompts are generated.
    num_prompts: int = 1024
    #: Built-in tasks: shortest operand, in digits.
    min_digits: int = 2
    #: Built-in tasks: longest operand, in digits.
    max_digits: int = 3
    #: Prompts per step.
    batch_size: int = 64
    #: Shuffle the prompts each epoch.
    shuffle: bool = True
    #: Seed of the prompts' generation and shuffling.
    seed: int = 0
    #: Built-in tasks: reward the share of characters right (``partial_match``), not only an exact
    #: answer (unused when ``reward_fn`` is set).
    partial_credit: bool = True
    #: A local Hugging Face tokenizer directory (``data/make_tokenizer.py`` builds one); null: the
    #: model's folder for ``model.kind=hf`` with ``model.path``, else a character tokenizer of the
    #: task's alphabet.
    tokenizer: Optional[str] = None
    #: Wrap prompts in the tokenizer's chat template; null: where the tokenizer has one, true: it
    #: must.
    chat_template: Optional[bool] = None
    #: verl's ``data.max_prompt_length``: a prompt longer than this many tokens (chat template
    #: included) is an error at start, naming it (verl's ``truncation: error``); null: no limit.
    max_prompt_length: Optional[int] = None
    #: verl's ``data.val_files``: held-out prompts scored by the validation passes
    #: (``trainer.test_freq``), a JSONL file or verl's parquet (by its ending), read and checked
    #: like ``path`` and scored by the same reward; null: no file.
    val_path: Optional[str] = None
    #: A built-in task's held-out prompts: this many, generated from their own seed and none of
    #: them a training prompt; 0: none (a file task's held-out prompts are ``val_path``).
    val_num_prompts: int = 0
    #: Validation prompts per generation call; null: all of them in one.
    val_batch_size: Optional[int] = None

    @property
    def resolved_task(self) -> str:
        """``task``, or what null means for ``path``."""
        return self.task if self.task is not None else default_task(self.path)

    def validate(self) -> None:
        task = self.resolved_task
        if self.task is not None:
            choice("task", self.task, BUILTIN_TASKS + FILE_TASKS)
        if task in FILE_TASKS:
            require(self.path is not None, "path", self.path,
                    f"data.task={task!r} needs data.path (a {task} file)")
        if task == "jsonl":
            require(self.path is None or not self.path.lower().endswith(PARQUET_SUFFIX), "path", self.path,
                    "is a parquet file but data.task='jsonl'; use data.task=parquet (or leave data.task unset)")
        if self.reward_fn is not None:
            require(re.fullmatch(r"[\w.]+:[\w.]+", self.reward_fn) is not None or self.reward_fn in BUILTIN_REWARDS,
                    "reward_fn", self.reward_fn, "must be an import path 'package.module:function' or one of "
                    + ", ".join(repr(r) for r in BUILTIN_REWARDS))
        require(self.tokenizer is None or self.tokenizer.strip() != "", "tokenizer", self.tokenizer,
                "must be a local tokenizer folder (or 'pkg://package/dir'), or null for the character tokenizer")
        require(not self.chat_template or self.tokenizer is not None, "chat_template", self.chat_template,
                "needs data.tokenizer (the character tokenizer has no chat template)")
        require(self.num_prompts >= 1, "num_prompts", self.num_prompts, "must be >= 1")
        require(self.min_digits >= 1, "min_digits", self.min_digits, "must be >= 1")
        require(self.max_digits >= self.min_digits, "max_digits", self.max_digits,
                f"must be >= min_digits={self.min_digits}")
        require(self.batch_size >= 1, "batch_size", self.batch_size, "must be >= 1")
        require(task in FILE_TASKS or self.batch_size <= self.num_prompts, "batch_size", self.batch_size,
                f"must be <= num_prompts={self.num_prompts}")
        require(self.seed >= 0, "seed", self.seed, "must be >= 0")
        require(self.val_path is None or self.val_path.strip() != "", "val_path", self.val_path,
                "must be a JSONL or parquet file, or null (no validation file)")
        require(self.val_path is None or task in FILE_TASKS or not self.val_path.lower().endswith(PARQUET_SUFFIX),
                "val_path", self.val_path, f"is verl's parquet data, scored with its data sources; the built-in "
                f"data.task={task!r} scores JSONL prompts (or give data.val_num_prompts)")
        require(self.val_num_prompts >= 0, "val_num_prompts", self.val_num_prompts, "must be >= 0 (0: none)")
        require(self.val_num_prompts == 0 or task in BUILTIN_TASKS, "val_num_prompts", self.val_num_prompts,
                f"applies to a built-in task; data.task={task!r} takes its held-out prompts from data.val_path")
        require(self.val_num_prompts == 0 or self.val_path is None, "val_num_prompts", self.val_num_prompts,
                "give held-out prompts one way: data.val_path or data.val_num_prompts")
        require(self.val_batch_size is None or self.val_batch_size >= 1, "val_batch_size", self.val_batch_size,
                "must be >= 1 or null (every validation prompt in one call)")
        require(self.max_prompt_length is None or self.max_prompt_length >= 1, "max_prompt_length",
                self.max_prompt_length, "must be >= 1 or null (no limit)")


@dataclass
class CustomRewardConfig(Section):
    """verl's ``custom_reward_function``: ``name`` in the Python file ``path`` scores a file task's
    responses as ``name(data_source, solution_str, ground_truth, extra_info)``, returning a number
    or a mapping with a ``score``. ``path`` null: not used (``data.reward_fn`` scores instead)."""

    #: A Python file holding the reward function; null: not used (``data.reward_fn`` scores).
    path: Optional[str] = None
    #: The function in that file: ``name(data_source, solution_str, ground_truth, extra_info)``
    #: returns a number or a mapping with a ``score``.
    name: str = "compute_score"

    def validate(self) -> None:
        require(self.path is None or self.path.strip() != "", "path", self.path,
                "must be a Python file, or null (not used)")
        require(self.name.isidentifier(), "name", self.name, "must be the name of a function in the file")
