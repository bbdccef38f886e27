"""Prompt datasets and a data loader whose position is part of the checkpointed state.

The loader's order is a pure function of ``(seed, epoch)``, and its state is three integers, so a
run restored from a checkpoint sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch

from resilient_rl.errors import CheckpointError, ConfigError, TokenizerError
from resilient_rl.config.schema import DataConfig
from resilient_rl.data.tasks import Sample, Task, get_task
from resilient_rl.data.tokenizer import Tokenizer


def _objects(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array of ``values``: ``np.array`` would make a 2-D array of equally long lists
    (chat messages, list-valued ground truths)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


class PromptDataset:
    """Tokenised prompts, left-padded to the longest prompt of the whole dataset.

    Padding to the dataset's longest prompt (not the batch's) keeps every batch the same shape,
    which keeps generation and checkpoints independent of which prompts a batch happens to hold.
    Each prompt is encoded by ``tokenizer.encode_prompt`` (bos first; a Hugging Face tokenizer's
    chat template when it applies). Attributes: ``input_ids`` and ``attention_mask`` (int64 [N, P]),
    ``prompts`` and ``answers`` (numpy object arrays [N]), ``data_sources`` and ``extra_infos``
    (object arrays [N] for verl's data, else None), ``prompt_len`` (P) and ``task``. A prompt longer
    than ``max_prompt_length`` tokens is a ConfigError naming it.
    """

    def __init__(self, samples: Sequence[Sample], tokenizer: Tokenizer, task: Optional[Task] = None,
                 max_prompt_length: Optional[int] = None):
        if not samples:
            raise ConfigError("a prompt dataset needs at least one sample")
        encoded = []
        for i, sample in enumerate(samples):
            try:
                encoded.append(tokenizer.encode_prompt(sample.prompt))
            except TokenizerError as e:  # data the tokenizer cannot spell is bad input (exit 2), not a run-time error
                raise ConfigError(f"prompt {sample.source or f'#{i}'}: {e}") from None
            if max_prompt_length is not None and len(encoded[-1]) > max_prompt_length:
                raise ConfigError(f"prompt {sample.source or f'#{i}'} is {len(encoded[-1])} tokens, longer than "
                                  f"data.max_prompt_length={max_prompt_length}")
        self.prompt_len = max(len(ids) for ids in encoded)
        self.input_ids = torch.full((len(encoded), self.prompt_len), tokenizer.pad_token_id, dtype=torch.int64)
        self.attention_mask = torch.zeros((len(encoded), self.prompt_len), dtype=torch.int64)
        for row, ids in enumerate(encoded):
            self.input_ids[row, self.prompt_len - len(ids):] = torch.tensor(ids, dtype=torch.int64)
            self.attention_mask[row, self.prompt_len - len(ids):] = 1
        self.prompts = _objects([s.prompt for s in samples])
        self.answers = _objects([s.answer for s in samples])
        # verl's data: given to the reward with each response; None for tasks whose samples have none.
        carried = any(s.data_source is not None or s.extra_info is not None for s in samples)
        self.data_sources = _objects([s.data_source for s in samples]) if carried else None
        self.extra_infos = _objects([s.extra_info for s in samples]) if carried else None
        self.tokenizer, self.task = tokenizer, task

    @classmethod
    def from_task(cls, task: Task, tokenizer: Tokenizer, num_prompts: int, seed: int,
                  max_prompt_length: Optional[int] = None) -> "PromptDataset":
        """``num_prompts`` samples of ``task``, generated from ``numpy.random.default_rng(seed)``."""
        return cls(task.make_prompts(num_prompts, np.random.default_rng(seed)), tokenizer, task, max_prompt_length)

    @classmethod
    def from_config(cls, data_cfg: DataConfig, tokenizer: Tokenizer, task: Optional[Task] = None) -> "PromptDataset":
        """The dataset described by the ``data`` config section (of ``task``, when it is built already)."""
        return cls.from_task(task if task is not None else get_task(data_cfg), tokenizer, data_cfg.num_prompts,
                             data_cfg.seed, data_cfg.max_prompt_length)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def gather(self, indices: np.ndarray) -> dict[str, Any]:
        """The rows ``indices`` as a batch dict (see :meth:`StatefulPromptLoader.next_batch`)."""
        index = np.asarray(indices, dtype=np.int64)
        rows = torch.from_numpy(index)
        batch = {
            "input_ids": self.input_ids[rows],
            "attention_mask": self.attention_mask[rows],
            "prompt_index": index,
            # Copies: a reward that edits its ground truth or extra info must not change the dataset,
            # or a replayed step, or the prompt's next epoch, would be scored on other inputs.
            "answers": _objects([copy.deepcopy(a) for a in self.answers[index]]),
            "prompts": self.prompts[index],
        }
        if self.data_sources is not None and self.extra_infos is not None:
            batch["data_sources"] = self.data_sources[index]
            batch["extra_infos"] = _objects([copy.deepcopy(e) for e in self.extra_infos[index]])
        return batch

    def check_fits(self, max_seq_len: int, max_new_tokens: int) -> None:
        """Raise ConfigError if a prompt plus a full response would exceed the model's context."""
        if self.prompt_len + max_new_tokens > max_seq_len:
            raise ConfigError(f"model.max_seq_len={max_seq_len} is too small: prompts are {self.prompt_len} "
                              f"tokens and rollout.max_new_tokens={max_new_tokens}")


class StatefulPromptLoader:
    """An endless, resumable stream of prompt batches.

    Epoch ``e`` visits the dataset in the order ``numpy.random.default_rng((seed, e)).permutation(N)``
    (or in index order without shuffling). An epoch's last incomplete batch is dropped, so every
    batch has exactly ``batch_size`` prompts; the dropped prompts differ from epoch to epoch when
    shuffling. :meth:`state_dict` is ``{"epoch", "position", "seed"}``: ``position`` counts the
    prompts of the current epoch already handed out.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, shuffle: bool = True, seed: int = 0):
        if not 1 <= batch_size <= len(dataset):
            raise ConfigError(f"data.batch_size={batch_size} must be between 1 and the dataset size {len(dataset)}")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self._epoch, self._position = 0, 0
        self._order: Optional[np.ndarray] = None
        self._order_epoch = -1

    @classmethod
    def from_config(cls, dataset: PromptDataset, data_cfg: DataConfig) -> "StatefulPromptLoader":
        """A loader with the ``data`` section's batch size, shuffling and seed."""
        return cls(dataset, data_cfg.batch_size, data_cfg.shuffle, data_cfg.seed)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        self._roll_over()
        return self._epoch

    @property
    def batches_per_epoch(self) -> int:
        """Full batches per epoch (the remainder is dropped)."""
        return len(self.dataset) // self.batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order epoch ``epoch`` visits them."""
        if not self.shuffle:
            return np.arange(len(self.dataset), dtype=np.int64)
        return np.random.default_rng((self.seed, epoch)).permutation(len(self.dataset)).astype(np.int64)

    def _roll_over(self) -> None:
        if self._position + self.batch_size > len(self.dataset):
            self._epoch, self._position = self._epoch + 1, 0

    def next_batch(self) -> dict[str, Any]:
        """The next batch: ``input_ids``/``attention_mask`` (int64 [B, P]), ``prompt_index``
        (int64 [B], dataset indices, usable as GRPO group ids), ``answers`` and ``prompts`` (object [B])."""
        self._roll_over()
        if self._order_epoch != self._epoch:
            self._order, self._order_epoch = self.epoch_order(self._epoch), self._epoch
        assert self._order is not None
        indices = self._order[self._position:self._position + self.batch_size]
        self._position += self.batch_size
        return self.dataset.gather(indices)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Position in the stream, JSON-serialisable."""
        self._roll_over()
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (its seed replaces this loader's, so the order is the saved run's)."""
        for key in ("epoch", "position", "seed"):
            value = state.get(key) if isinstance(state, Mapping) else None
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CheckpointError(f"data loader state: {key!r} must be a non-negative int, got {value!r}")
        if state["position"] > len(self.dataset):
            raise CheckpointError(f"data loader state: position {state['position']} is past the end of the "
                                  f"dataset ({len(self.dataset)} prompts); was the dataset changed?")
        self._epoch, self._position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        self._order_epoch = -1
