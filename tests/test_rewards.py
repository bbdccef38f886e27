"""The reward functions: GSM8K answer extraction and numeric comparison, the registry, reference checks."""

from __future__ import annotations

import json

import pytest

from resilient_rl.errors import ConfigError
from resilient_rl.data.rewards import REWARDS, extract_final_answer, gsm8k, parse_numbers
from resilient_rl.data.tasks import JsonlTask, load_reward_fn

REF = "She buys 3*4=<<3*4=12>>12 apples.\nThen 12+30=<<12+30=42>>42.\n#### 42"


@pytest.mark.parametrize("response, score", [
    ("The answer is 42", 1.0),                      # last number
    ("3 boxes of 14 make 42.", 1.0),                 # last number, sentence end
    ("#### 42", 1.0),
    ("12+30=42\n#### 42.0", 1.0),                    # numeric, not textual, comparison
    ("first 42 then 41", 0.0),                       # the last number counts, not any number
    ("#### 42 and later 7", 1.0),                    # after '####' the first number counts
    ("I think 7", 0.0),
    ("no number here", 0.0),
    ("", 0.0),
    ("#### ", 0.0),                                  # '####' with nothing after it
    ("####42", 1.0),
    ("$42", 1.0),
])
def test_gsm8k_reward(response, score):
    assert gsm8k(response, REF) == score


def test_gsm8k_thousands_separators_and_decimals():
    assert gsm8k("It costs 1,234 dollars", "...\n#### 1234") == 1.0
    assert gsm8k("It costs 1234", "...\n#### 1,234") == 1.0
    assert gsm8k("It costs 1,235", "...\n#### 1,234") == 0.0
    assert gsm8k("so 2.5 hours", "...\n#### 2.5") == 1.0
    assert gsm8k("owes -7", "...\n#### -7") == 1.0
    assert gsm8k("owes 7", "...\n#### -7") == 0.0
    assert parse_numbers("1,234,567 and 3, 4 and 0.5") == [1234567.0, 3.0, 4.0, 0.5]
    assert extract_final_answer("nothing") is None


def test_gsm8k_reference_without_final_answer_is_an_error():
    with pytest.raises(ConfigError, match="no '#### <number>' line"):
        gsm8k("42", "the answer is 42")
    with pytest.raises(ConfigError, match="no number after '####'"):
        gsm8k("42", "reasoning\n#### none")


def test_registered_rewards_by_name():
    assert load_reward_fn("gsm8k") is gsm8k is REWARDS["gsm8k"]
    assert load_reward_fn("exact_match")("a", "a") == 1.0
    with pytest.raises(ConfigError, match=r"'nope' is not a registered reward \(exact_match, partial_match, gsm8k\)"):
        load_reward_fn("nope")


def test_jsonl_task_reads_gsm8k_records_and_checks_references(tmp_path):
    good = tmp_path / "g.jsonl"
    good.write_text(json.dumps({"question": "What is 2+3?", "answer": "2+3=<<2+3=5>>5\n#### 5"}) + "\n")
    task = JsonlTask(str(good), "gsm8k")
    (sample,) = task.make_prompts(0, None)
    assert sample.prompt == "What is 2+3?" and task.reward("it is 5", sample.answer) == 1.0
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"question": "q1", "answer": "#### 1"}) + "\n"
                   + json.dumps({"question": "q2", "answer": "two"}) + "\n")
    with pytest.raises(ConfigError, match=rf"{bad}:2: gsm8k reward: .*no '#### <number>' line"):
        JsonlTask(str(bad), "gsm8k")
    JsonlTask(str(bad), "exact_match")  # other rewards do not require the '####' form


def test_shipped_gsm8k_sample_is_consistent():
    """Every shipped problem has a '####' answer, and every <<a=b>> calculation in it is right."""
    import re

    task = JsonlTask("pkg://resilient_rl/data/gsm8k_sample.jsonl", "gsm8k")
    samples = task.make_prompts(0, None)
    assert len(samples) >= 50
    for s in samples:
        final = s.answer.rsplit("####", 1)[1].strip()
        assert task.reward(f"so the answer is {final}", s.answer) == 1.0
        calcs = re.findall(r"<<([^=>]+)=([^>]+)>>", s.answer)
        assert calcs, s.source
        for expr, value in calcs:
            assert float(eval(expr, {"__builtins__": {}})) == float(value), (s.source, expr, value)


def test_the_config_accepts_exactly_the_registered_reward_names():
    from resilient_rl.config.sections import BUILTIN_REWARDS
    from resilient_rl.data.rewards import REWARDS

    assert tuple(REWARDS) == BUILTIN_REWARDS
