"""Verifiable tasks: prompts with known answers and a reward that checks a response against them.

Built in: ``reverse`` ("123>" -> "321"), ``copy`` ("123=" -> "123") and ``add`` ("12+7=" -> "19"),
generated from a seeded numpy Generator and scored by partial (or exact) match unless
``data.reward_fn`` names another reward, which then replaces theirs (as verl's custom reward
replaces its built-in scoring). ``jsonl`` reads ``{"prompt": ..., "answer": ...}`` lines
(or GSM8K's ``{"question": ..., "answer": ...}``) from a file, ``parquet`` verl's RL data
(:mod:`resilient_rl.data.parquet`: chat prompts, ground truths, data sources). A file's responses
are scored with a registered reward (:mod:`resilient_rl.data.rewards`: ``exact_match``,
``partial_match``, ``gsm8k``), a user function ``(response, answer)`` given by import path
``module:function``, or verl's ``compute_score(data_source, solution_str, ground_truth,
extra_info)`` from a file (:mod:`resilient_rl.data.verl_reward`).
"""

from __future__ import annotations

import importlib
import importlib.resources
import json
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, Sequence, Union

import fsspec
import numpy as np

from resilient_rl.errors import ConfigError, DataProtoError, UserCodeError
from resilient_rl.config.data_sections import DataConfig, default_task
from resilient_rl.config.paths import resolve_path
from resilient_rl.data.parquet import read_parquet_rows
from resilient_rl.data.rewards import RewardFn, exact_match, get_reward, partial_match, user_traceback
from resilient_rl.data.verl_reward import VerlScore
from resilient_rl.data.tokenizer import Tokenizer

__all__ = ["AddTask", "CopyTask", "FileTask", "JsonlTask", "ParquetTask", "ReverseTask", "RewardFn", "Sample", "Task",
           "UserReward", "compute_rewards", "exact_match", "example_prompts_path", "get_task", "load_reward_fn",
           "partial_match", "read_jsonl", "read_parquet"]


@dataclass(frozen=True)
class Sample:
    """One prompt and its reference answer; ``source`` says where it came from (file:line).

    From verl's data: ``prompt`` may be a list of chat messages (``{"role", "content"}``, rendered
    by the tokenizer's chat template), ``answer`` is the row's ground truth as it is, and
    ``data_source`` and ``extra_info`` go to the reward function with each response."""

    prompt: Union[str, list]
    answer: Any
    source: Optional[str] = None
    data_source: Optional[str] = None
    extra_info: Optional[dict] = None


class Task(Protocol):
    """What the trainer needs from a task: prompts to sample from and a reward to score with."""

    name: str

    def make_prompts(self, n: int, rng: np.random.Generator) -> list[Sample]:
        """``n`` samples drawn with ``rng`` (a file-backed task returns its fixed set)."""
        ...

    def reward(self, response: str, answer: str) -> float:
        """Score of ``response`` (decoded, up to eos) against ``answer``. A task whose samples carry
        a data source and extra info (verl's data) also takes ``data_source=`` and ``extra_info=``."""
        ...


class _DigitTask:
    """Shared parts of the built-in tasks: digit-length range and reward."""

    name = "digits"
    #: Characters of every prompt and answer: a small vocabulary makes a random policy hit the
    #: right token far more often, which is what lets RL from scratch learn quickly.
    alphabet = "0123456789+=>"

    def __init__(self, min_digits: int = 2, max_digits: int = 3, partial_credit: bool = True,
                 reward_fn: Optional[str] = None):
        if not 1 <= min_digits <= max_digits:
            raise ConfigError(f"data.min_digits={min_digits} and data.max_digits={max_digits} must satisfy "
                              "1 <= min_digits <= max_digits")
        self.min_digits, self.max_digits, self.partial_credit = min_digits, max_digits, partial_credit
        # data.reward_fn replaces the built-in score; it is loaded now so a bad path fails at start.
        self.user_reward = UserReward(reward_fn) if reward_fn is not None else None

    def _digits(self, rng: np.random.Generator) -> str:
        length = int(rng.integers(self.min_digits, self.max_digits + 1))
        return "".join(str(int(d)) for d in rng.integers(0, 10, size=length))

    def make_prompts(self, n: int, rng: np.random.Generator) -> list[Sample]:
        """``n`` samples, a pure function of ``rng``'s state (their answers checked by
        ``data.reward_fn``'s ``check_reference``, where it has one)."""
        samples = [self._sample(rng) for _ in range(n)]
        self.check_references(samples)
        return samples

    def check_references(self, samples: Sequence[Sample]) -> None:
        """See :meth:`UserReward.check_references` (the built-in score takes any answer)."""
        if self.user_reward is not None:
            self.user_reward.check_references(samples)

    def _sample(self, rng: np.random.Generator) -> Sample:
        raise NotImplementedError

    def reward(self, response: str, answer: str) -> float:
        """``data.reward_fn``'s score where it is set, else exact match, with partial credit if
        configured (see :func:`partial_match`)."""
        if self.user_reward is not None:
            return self.user_reward(response, answer)
        return partial_match(response, answer) if self.partial_credit else exact_match(response, answer)


class ReverseTask(_DigitTask):
    """Reverse a digit string: "123>" -> "321"."""

    name = "reverse"

    def _sample(self, rng: np.random.Generator) -> Sample:
        digits = self._digits(rng)
        return Sample(prompt=f"{digits}>", answer=digits[::-1])


class CopyTask(_DigitTask):
    """Repeat a digit string: "123=" -> "123"."""

    name = "copy"

    def _sample(self, rng: np.random.Generator) -> Sample:
        digits = self._digits(rng)
        return Sample(prompt=f"{digits}=", answer=digits)


class AddTask(_DigitTask):
    """Add two numbers without leading zeros: "12+7=" -> "19"."""

    name = "add"

    def _number(self, rng: np.random.Generator) -> int:
        length = int(rng.integers(self.min_digits, self.max_digits + 1))
        low = 0 if length == 1 else 10 ** (length - 1)
        return int(rng.integers(low, 10**length))

    def _sample(self, rng: np.random.Generator) -> Sample:
        a, b = self._number(rng), self._number(rng)
        return Sample(prompt=f"{a}+{b}=", answer=str(a + b))


def load_reward_fn(import_path: str) -> RewardFn:
    """A registered reward by name, or ``package.module:function`` imported; errors name the value."""
    if ":" not in import_path:
        return get_reward(import_path)
    module_name, sep, attr = import_path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"data.reward_fn={import_path!r} must have the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"data.reward_fn={import_path!r}: cannot import module {module_name!r}: {e}") from e
    except Exception as e:  # the user's module fails as it is imported (a syntax error, a failing statement)
        raise ConfigError(f"data.reward_fn={import_path!r}: importing module {module_name!r} raised "
                          f"{type(e).__name__}: {e}\n{user_traceback(e)}") from e
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"data.reward_fn={import_path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"data.reward_fn={import_path!r} is not callable (got {type(obj).__name__})")
    return obj  # type: ignore[return-value]


class UserReward:
    """``data.reward_fn`` (a registered name or an import path) loaded and called as the user's
    code: an exception it raises is the user's (UserCodeError with its traceback and the response
    it was scoring), not the trainer's, and what it returns is checked to be a real number."""

    def __init__(self, import_path: str):
        self.path = import_path
        self.fn = load_reward_fn(import_path)

    def __call__(self, response: str, answer: Any) -> float:
        try:
            value = self.fn(response, answer)
        except Exception as e:
            raise UserCodeError(f"data.reward_fn={self.path!r} raised {type(e).__name__}: {e} while "
                                f"scoring response {response[:200]!r} against answer {str(answer)[:200]!r}\n"
                                f"{user_traceback(e)}") from e
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"data.reward_fn={self.path!r} returned {value!r}, not a number") from None

    def check_references(self, samples: Sequence[Sample]) -> None:
        """Check each sample's answer with the reward's ``check_reference`` (where it has one):
        a ConfigError naming the sample (its file:line, or its prompt) for an answer the reward
        cannot score, so it fails at start, not mid-run."""
        check = getattr(self.fn, "check_reference", None)
        if check is None:
            return
        for sample in samples:
            where = sample.source or f"prompt {sample.prompt!r}"
            try:
                check(sample.answer)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
            except Exception as e:
                raise UserCodeError(f"{where}: data.reward_fn={self.path!r}: its check_reference "
                                    f"raised {type(e).__name__}: {e}\n{user_traceback(e)}") from e


def example_prompts_path() -> str:
    """Path of the small JSONL prompt file shipped with the package (scored by :func:`exact_match`)."""
    return str(importlib.resources.files("resilient_rl") / "data" / "example_prompts.jsonl")


#: Field names of a record's prompt, tried in order ("question" is GSM8K's).
PROMPT_KEYS = ("prompt", "question")


def read_jsonl(path: str, key: str = "data.path") -> list[Sample]:
    """Samples from a JSONL file (any fsspec URL or ``pkg://package/file``); blank lines are skipped,
    errors name file:line (and ``key``, the config key that names the file, where no line is to
    blame). A record's prompt is its ``prompt`` field, or ``question`` (GSM8K)."""
    try:
        with fsspec.open(resolve_path(path, key), "r", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}={path!r}: cannot read prompt file: {e}") from e
    samples = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: expected an object with 'prompt' and 'answer', got {type(record).__name__}")
        prompt_key = next((k for k in PROMPT_KEYS if k in record), PROMPT_KEYS[0])
        for key in (prompt_key, "answer"):
            if not isinstance(record.get(key), str):
                raise ConfigError(f"{where}: field {key!r} must be a string, got {record.get(key)!r}")
        if not record[prompt_key]:
            raise ConfigError(f"{where}: field {prompt_key!r} must not be empty")
        samples.append(Sample(prompt=record[prompt_key], answer=record["answer"], source=where))
    if not samples:
        raise ConfigError(f"{key}={path!r}: the prompt file holds no samples")
    return samples


def read_parquet(path: str, key: str = "data.path") -> list[Sample]:
    """Samples of verl's parquet file (:func:`resilient_rl.data.parquet.read_parquet_rows`)."""
    return [Sample(**row) for row in read_parquet_rows(path, key)]


class FileTask:
    """Prompts read from a file, scored by ``reward_fn`` (a registered name or an import path, called
    ``(response, answer)``) or by verl's ``compute_score`` from a file (``compute_score``: the
    ``custom_reward_function`` section, or a ``(path, name)`` pair). Exactly one is given."""

    name = "file"

    def __init__(self, path: str, reward_fn: Optional[str] = None, compute_score: Any = None):
        self.path, self.reward_fn_path = path, reward_fn
        if (reward_fn is None) == (compute_score is None):
            raise ConfigError(f"data.path={path!r} needs one reward: data.reward_fn or custom_reward_function.path")
        self._verl: Optional[VerlScore] = None
        if compute_score is not None:
            score_path, score_name = (compute_score if isinstance(compute_score, tuple)
                                      else (compute_score.path, compute_score.name))
            self._verl = VerlScore(score_path, score_name)
            self._reward: Optional[UserReward] = None
        else:
            self._reward = UserReward(reward_fn)
        self._samples = self.read(path)
        self.check_references(self._samples)

    def check_references(self, samples: Sequence[Sample]) -> None:
        """See :meth:`UserReward.check_references` (verl's ``compute_score`` has no such check)."""
        if self._reward is not None:
            self._reward.check_references(samples)

    @staticmethod
    def read(path: str) -> list[Sample]:
        """The file's samples (each subclass reads its format)."""
        raise NotImplementedError

    def make_prompts(self, n: int, rng: np.random.Generator) -> list[Sample]:
        """Every sample of the file, in file order: a file task has a fixed set, so ``n`` is ignored."""
        return list(self._samples)

    def reward(self, response: str, answer: Any, data_source: Optional[str] = None,
               extra_info: Optional[dict] = None) -> float:
        """The user function's score (:class:`UserReward`, or verl's ``compute_score``)."""
        if self._verl is not None:
            return self._verl(response, answer, data_source, extra_info)
        return self._reward(response, answer)


class JsonlTask(FileTask):
    """Prompts read from a JSONL file (:func:`read_jsonl`)."""

    name = "jsonl"
    read = staticmethod(read_jsonl)


class ParquetTask(FileTask):
    """verl's RL data: prompts read from a parquet file (:func:`read_parquet`)."""

    name = "parquet"
    read = staticmethod(read_parquet)


def get_task(data_cfg: DataConfig, custom_reward: Any = None) -> Task:
    """The task named by ``data_cfg.task`` (null: the one ``data.path`` means), configured from the
    data section; ``custom_reward`` is the root config's ``custom_reward_function`` section."""
    builtin = {"reverse": ReverseTask, "copy": CopyTask, "add": AddTask}
    files = {"jsonl": JsonlTask, "parquet": ParquetTask}
    task = data_cfg.task if data_cfg.task is not None else default_task(data_cfg.path)
    if task in builtin:
        return builtin[task](data_cfg.min_digits, data_cfg.max_digits, data_cfg.partial_credit, data_cfg.reward_fn)
    if task in files:
        score = custom_reward if custom_reward is not None and getattr(custom_reward, "path", None) else None
        if data_cfg.path is None or (data_cfg.reward_fn is None and score is None):
            raise ConfigError(f"data.task={task!r} needs data.path and a reward: data.reward_fn or "
                              "custom_reward_function.path")
        return files[task](data_cfg.path, data_cfg.reward_fn if score is None else None, score)
    raise ConfigError(f"data.task={task!r}: allowed values are {', '.join(builtin)}, {', '.join(files)}")


def compute_rewards(task: Task, tokenizer: Tokenizer, responses: Iterable[Sequence[int]],
                    answers: Sequence[Any], data_sources: Optional[Sequence[Any]] = None,
                    extra_infos: Optional[Sequence[Any]] = None) -> np.ndarray:
    """Score a batch of generated responses (token ids, cut at eos) against their answers: float32 [B].
    ``data_sources`` and ``extra_infos`` (verl's data: one per response) go to the reward with each."""
    texts = [tokenizer.decode_response(row) for row in responses]
    if len(texts) != len(answers):
        raise DataProtoError(f"compute_rewards got {len(texts)} responses but {len(answers)} answers")
    if data_sources is None:
        return np.asarray([task.reward(t, a) for t, a in zip(texts, answers)], dtype=np.float32)
    infos = extra_infos if extra_infos is not None else [None] * len(texts)
    if not len(data_sources) == len(infos) == len(texts):
        raise DataProtoError(f"compute_rewards got {len(texts)} responses but {len(data_sources)} data sources "
                             f"and {len(infos)} extra infos")
    return np.asarray([task.reward(t, a, data_source=d, extra_info=e)
                       for t, a, d, e in zip(texts, answers, data_sources, infos)], dtype=np.float32)
