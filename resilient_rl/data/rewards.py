"""Reward functions ``(response, answer) -> float`` and the names a config can use for them.

``data.reward_fn`` is either one of :data:`REWARDS`' names (``exact_match``, ``partial_match``,
``gsm8k``) or an import path ``package.module:function``. A reward may carry a
``check_reference(answer)`` attribute: the JSONL task calls it on every reference answer when the
file is loaded, so a malformed reference fails at start-up naming its line, not mid-run.
"""

from __future__ import annotations

import math
import re
import traceback
from typing import Callable, Optional

from resilient_rl.errors import ConfigError

RewardFn = Callable[[str, str], float]

# A number as written in word problems: thousands separators ("1,234"), decimals, a sign.
# The comma form is tried first so "1,234" is one number, while "3, 4" stays two.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
GSM8K_MARK = "####"


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback from the frame that called into the user's code on (our own frames
    above it say nothing about the user's bug)."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response equals the answer, else 0.0."""
    return 1.0 if response == answer else 0.0


def partial_match(response: str, answer: str) -> float:
    """1.0 for an exact match, else half the fraction of positions that agree.

    The fraction is over the longer of the two strings, so trailing junk is not free, and it is
    scaled by 0.5 so that any exact match outranks every partial one. An empty response scores 0.
    """
    if response == answer:
        return 1.0
    if not response or not answer:
        return 0.0
    agree = sum(r == a for r, a in zip(response, answer))
    return 0.5 * agree / max(len(response), len(answer))


def _to_float(text: str) -> float:
    return float(text.replace(",", ""))


def parse_numbers(text: str) -> list[float]:
    """Every number in ``text``, in order ("1,234" is 1234.0; "$5" is 5.0)."""
    return [_to_float(m.group()) for m in _NUMBER.finditer(text)]


def extract_final_answer(text: str) -> Optional[float]:
    """The final numeric answer of ``text``: the first number after the last '####' if there is one,
    else the last number of the text; None when there is no number where one is looked for."""
    if GSM8K_MARK in text:
        numbers = parse_numbers(text.rsplit(GSM8K_MARK, 1)[1])
        return numbers[0] if numbers else None
    numbers = parse_numbers(text)
    return numbers[-1] if numbers else None


def gsm8k_reference(answer: str) -> float:
    """The number after '####' in a GSM8K reference answer, or the answer itself where it is one
    number (verl's GSM8K parquet stores the bare number as its ground truth); ConfigError otherwise."""
    answer = str(answer)
    if GSM8K_MARK not in answer:
        numbers = parse_numbers(answer)
        if len(numbers) == 1 and _NUMBER.fullmatch(answer.strip().replace("$", "")):
            return numbers[0]
        raise ConfigError(f"gsm8k reward: reference answer {answer[-60:]!r} has no '{GSM8K_MARK} <number>' line "
                          "and is not a number")
    value = extract_final_answer(answer)
    if value is None:
        raise ConfigError(f"gsm8k reward: reference answer {answer[-60:]!r} has no number after '{GSM8K_MARK}'")
    return value


def gsm8k(response: str, answer: str) -> float:
    """1.0 when the response's final number (see :func:`extract_final_answer`) equals the number
    after '####' in the reference answer, compared as numbers ("1,234" == "1234.0"), else 0.0."""
    expected = gsm8k_reference(answer)
    got = extract_final_answer(response)
    if got is None:
        return 0.0
    return 1.0 if math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9) else 0.0


gsm8k.check_reference = gsm8k_reference  # type: ignore[attr-defined]

#: Rewards a config can name without an import path (``data.reward_fn: gsm8k``); the config
#: validates names against :data:`resilient_rl.config.sections.BUILTIN_REWARDS`, the same list.
REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "partial_match": partial_match, "gsm8k": gsm8k}


def get_reward(name: str) -> RewardFn:
    """The registered reward ``name``; ConfigError listing the names otherwise."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ConfigError(f"data.reward_fn={name!r} is not a registered reward ({', '.join(REWARDS)}) "
                          "nor an import path 'package.module:function'") from None
