"""Tokenizer, built-in and JSONL tasks, prompt dataset and the resumable loader."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from resilient_rl.errors import CheckpointError, ConfigError, TokenizerError, UserCodeError
from resilient_rl.config.schema import DataConfig, load_config
from resilient_rl.data.loader import PromptDataset, StatefulPromptLoader
from resilient_rl.data.tasks import (
    AddTask,
    CopyTask,
    JsonlTask,
    ReverseTask,
    Sample,
    compute_rewards,
    example_prompts_path,
    get_task,
    load_reward_fn,
    read_jsonl,
)
from resilient_rl.data.tokenizer import DEFAULT_ALPHABET, CharTokenizer

# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_special_ids():
    tok = CharTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(DEFAULT_ALPHABET) == 44
    text = "12+7=19 sort|max>"
    ids = tok.encode(text)
    assert len(ids) == len(text) and min(ids) >= 3
    assert tok.encode("0") == [3]
    assert tok.decode(ids) == text
    framed = tok.encode(text, add_bos=True, add_eos=True)
    assert framed[0] == 1 and framed[-1] == 2
    assert tok.decode(framed) == text
    assert tok.decode(framed, skip_special=False) == f"<bos>{text}<eos>"


def test_tokenizer_response_decoding_stops_at_eos():
    tok = CharTokenizer()
    row = torch.tensor(tok.encode("321") + [tok.eos_token_id] + tok.encode("99") + [0, 0])
    assert tok.decode_response(row) == "321"
    assert tok.decode(row) == "32199"
    assert tok.batch_decode_responses([[2, 5], [0, 5, 2]]) == ["", "2"]


def test_tokenizer_errors():
    tok = CharTokenizer()
    with pytest.raises(TokenizerError, match=r"'A' at position 2"):
        tok.encode("12A")
    with pytest.raises(TokenizerError, match="44"):
        tok.decode([44])
    with pytest.raises(TokenizerError, match="repeats"):
        CharTokenizer("aab")


# ---------------------------------------------------------------- built-in tasks


@pytest.mark.parametrize("task_cls, check", [
    (ReverseTask, lambda s: s.prompt.endswith(">") and s.answer == s.prompt[:-1][::-1]),
    (CopyTask, lambda s: s.prompt.endswith("=") and s.answer == s.prompt[:-1]),
    (AddTask, lambda s: s.answer == str(sum(int(x) for x in s.prompt[:-1].split("+")))),
])
def test_builtin_prompts_are_correct_and_seeded(task_cls, check):
    task = task_cls(min_digits=2, max_digits=3)
    samples = task.make_prompts(50, np.random.default_rng(0))
    assert len(samples) == 50 and all(check(s) for s in samples)
    assert {len(part) for s in samples for part in s.prompt[:-1].split("+")} == {2, 3}
    assert samples == task.make_prompts(50, np.random.default_rng(0))
    assert samples != task.make_prompts(50, np.random.default_rng(1))


def test_add_prompt_format_and_no_leading_zeros():
    samples = AddTask(1, 3).make_prompts(200, np.random.default_rng(3))
    for s in samples:
        a, b = s.prompt[:-1].split("+")
        assert s.prompt.endswith("=")
        assert not (len(a) > 1 and a[0] == "0") and not (len(b) > 1 and b[0] == "0")
    assert {len(a) for s in samples for a in s.prompt[:-1].split("+")} == {1, 2, 3}


@pytest.mark.parametrize("task", [ReverseTask(), CopyTask(), AddTask()])
def test_rewards_exact_partial_empty(task):
    assert task.reward("321", "321") == 1.0
    assert task.reward("", "321") == 0.0
    assert task.reward("391", "321") == pytest.approx(0.5 * 2 / 3)
    assert task.reward("3210", "321") == pytest.approx(0.5 * 3 / 4)  # overlong responses pay for the junk
    assert task.reward("999", "321") == 0.0
    strict = type(task)(partial_credit=False)
    assert strict.reward("391", "321") == 0.0 and strict.reward("321", "321") == 1.0


def test_exact_match_dominates_every_partial_score():
    task = ReverseTask()
    answer = "12"
    partials = [task.reward(r, answer) for r in ("1", "2", "13", "12x", "x2", "123456")]
    assert max(partials) <= 0.5 < task.reward(answer, answer)


def test_compute_rewards_decodes_up_to_eos():
    tok = CharTokenizer()
    task = ReverseTask()
    responses = torch.tensor([
        tok.encode("321") + [tok.eos_token_id, 0, 0],
        tok.encode("32") + [tok.eos_token_id] + tok.encode("1") + [0, 0],
        [tok.eos_token_id, 0, 0, 0, 0, 0],
        tok.encode("321321"),  # no eos within the budget: the whole response counts
    ])
    rewards = compute_rewards(task, tok, responses, ["321", "321", "321", "321"])
    assert rewards.dtype == np.float32
    np.testing.assert_allclose(rewards, [1.0, 0.5 * 2 / 3, 0.0, 0.5 * 3 / 6], rtol=1e-6)


def test_get_task_from_config():
    task = get_task(DataConfig(task="copy", min_digits=1, max_digits=1, partial_credit=False))
    assert isinstance(task, CopyTask) and task.reward("12", "13") == 0.0
    assert all(len(s.answer) == 1 for s in task.make_prompts(10, np.random.default_rng(0)))


# ---------------------------------------------------------------- JSONL task


def test_jsonl_task_with_shipped_file_and_reward_by_import_path():
    cfg = DataConfig(task="jsonl", path=example_prompts_path(), reward_fn="resilient_rl.data.tasks:exact_match")
    task = get_task(cfg)
    assert isinstance(task, JsonlTask)
    samples = task.make_prompts(5, np.random.default_rng(0))  # a file task returns its whole set
    with open(example_prompts_path()) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    assert [(s.prompt, s.answer) for s in samples] == [(r["prompt"], r["answer"]) for r in lines]
    assert len(samples) >= 20
    s = samples[0]
    assert task.reward(s.answer, s.answer) == 1.0 and task.reward(s.answer + "0", s.answer) == 0.0
    ds = PromptDataset.from_config(cfg, CharTokenizer())  # every shipped prompt fits the default alphabet
    assert len(ds) == len(samples)


def test_custom_reward_fn_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def starts(response, answer):\n"
                                            "    return 0.25 if response[:1] == answer[:1] else 0\n"
                                            "def bad(response, answer):\n    return 'x'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a>", "answer": "ab"}\n\n{"prompt": "b>", "answer": "ba"}\n')
    task = JsonlTask(str(data), "my_rewards:starts")
    assert task.reward("ax", "ab") == 0.25 and task.reward("x", "ab") == 0.0
    assert [s.source for s in task.make_prompts(0, np.random.default_rng(0))] == [f"{data}:1", f"{data}:3"]
    with pytest.raises(ConfigError, match=r"my_rewards:bad.*'x'"):
        JsonlTask(str(data), "my_rewards:bad").reward("a", "b")


def test_reward_fn_replaces_a_builtin_tasks_own_reward(tmp_path, monkeypatch):
    """data.reward_fn given with a built-in task scores its responses (as verl's custom reward
    replaces its built-in scoring), instead of being ignored for the task's partial match."""
    module = f"builtin_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(
        "CALLS = []\n"
        "def first_digit(response, answer):\n"
        "    CALLS.append((response, answer))\n"
        "    return 0.75 if response[:1] == answer[:1] else -1\n"
        "def broken(response, answer):\n    raise KeyError('oops')\n"
        "def picky(response, answer):\n    return 1.0\n"
        "def _refuse(answer):\n    raise ValueError('no ' + answer)\n"
        "picky.check_reference = _refuse\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["data.task=add", f"data.reward_fn={module}:first_digit", "data.partial_credit=true"])
    task = get_task(cfg.data, cfg.custom_reward_function)
    assert isinstance(task, AddTask)
    assert task.reward("19", "19") == 0.75 and task.reward("29", "19") == -1.0  # not partial_match's 0.25
    tok = CharTokenizer()
    rewards = compute_rewards(task, tok, torch.tensor([tok.encode("12") + [tok.eos_token_id], tok.encode("913")]),
                              ["19", "19"])
    np.testing.assert_array_equal(rewards, np.asarray([0.75, -1.0], dtype=np.float32))
    assert sys.modules[module].CALLS[-2:] == [("12", "19"), ("913", "19")]  # decoded text, cut at eos
    # A named built-in reward replaces it too.
    assert get_task(DataConfig(task="copy", reward_fn="exact_match")).reward("12", "13") == 0.0
    with pytest.raises(UserCodeError, match=rf"data.reward_fn='{module}:broken' raised KeyError"):
        get_task(DataConfig(task="copy", reward_fn=f"{module}:broken")).reward("1", "2")
    # Its check_reference sees every generated answer, at start.
    with pytest.raises(UserCodeError, match=r"prompt '\d+=': .*check_reference raised ValueError"):
        PromptDataset.from_config(DataConfig(task="copy", reward_fn=f"{module}:picky"), tok)
    with pytest.raises(ConfigError, match="cannot import module"):
        get_task(DataConfig(task="copy", reward_fn="no_such_module_xyz:fn"))
    sys.modules.pop(module, None)


@pytest.mark.parametrize("path, fragment", [
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("resilient_rl.data.tasks:no_such_fn", "has no attribute 'no_such_fn'"),
    ("resilient_rl.data.tasks", "'package.module:function'"),
    ("resilient_rl.data.tasks:DataConfig.task", "not callable"),
])
def test_bad_reward_import_path(path, fragment):
    with pytest.raises(ConfigError) as info:
        load_reward_fn(path)
    assert path in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize("content, line, fragment", [
    ('{"prompt": "1>", "answer": "1"}\n{"prompt": "2>", "answer": \n', 2, "not valid JSON"),
    ('{"prompt": "1>", "answer": "1"}\n\n["a", "b"]\n', 3, "expected an object"),
    ('{"prompt": "1>"}\n', 1, "'answer' must be a string"),
    ('{"prompt": "", "answer": "1"}\n', 1, "'prompt' must not be empty"),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path, content, line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        read_jsonl(str(path))
    assert f"{path}:{line}:" in str(info.value) and fragment in str(info.value)


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="missing.jsonl"):
        read_jsonl(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="no samples"):
        read_jsonl(str(tmp_path / "empty.jsonl"))


def test_untokenisable_prompt_names_its_line(tmp_path):
    path = tmp_path / "caps.jsonl"
    path.write_text('{"prompt": "ok>", "answer": "1"}\n{"prompt": "Caps>", "answer": "1"}\n')
    with pytest.raises(ConfigError, match=rf"{path}:2.*'C'"):
        PromptDataset(read_jsonl(str(path)), CharTokenizer())


# ---------------------------------------------------------------- dataset and loader


def test_dataset_left_pads_to_longest_prompt():
    tok = CharTokenizer()
    ds = PromptDataset([Sample("12>", "21"), Sample("1234>", "4321")], tok)
    assert ds.prompt_len == 6  # bos + 5 characters
    assert ds.input_ids.dtype == torch.int64 and ds.input_ids.shape == (2, 6)
    assert ds.input_ids[0].tolist() == [0, 0, 1] + tok.encode("12>")
    assert ds.attention_mask[0].tolist() == [0, 0, 1, 1, 1, 1]
    assert ds.attention_mask[1].tolist() == [1] * 6
    ds.check_fits(max_seq_len=12, max_new_tokens=6)
    with pytest.raises(ConfigError, match="model.max_seq_len=11"):
        ds.check_fits(max_seq_len=11, max_new_tokens=6)


def _dataset(n: int = 10) -> PromptDataset:
    return PromptDataset.from_task(ReverseTask(), CharTokenizer(), num_prompts=n, seed=0)


def _same(a: dict, b: dict) -> bool:
    return (torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["attention_mask"], b["attention_mask"])
            and np.array_equal(a["prompt_index"], b["prompt_index"]) and list(a["answers"]) == list(b["answers"])
            and list(a["prompts"]) == list(b["prompts"]))


def test_batch_contents_are_consistent():
    ds = _dataset()
    batch = StatefulPromptLoader(ds, batch_size=4, seed=3).next_batch()
    assert batch["input_ids"].shape == (4, ds.prompt_len) and batch["attention_mask"].shape == (4, ds.prompt_len)
    assert batch["prompt_index"].dtype == np.int64 and batch["answers"].dtype == object
    tok = CharTokenizer()
    for row, idx, prompt, answer in zip(batch["input_ids"], batch["prompt_index"], batch["prompts"], batch["answers"]):
        assert tok.decode(row) == prompt == ds.prompts[idx] and answer == ds.answers[idx]


def test_loader_order_is_a_function_of_seed_and_epoch_and_drops_last():
    ds = _dataset(10)
    loader = StatefulPromptLoader(ds, batch_size=4, shuffle=True, seed=7)
    assert loader.batches_per_epoch == 2
    seen = [loader.next_batch()["prompt_index"] for _ in range(4)]  # two epochs of two batches
    for epoch in (0, 1):
        expected = np.random.default_rng((7, epoch)).permutation(10)[:8]
        np.testing.assert_array_equal(np.concatenate(seen[2 * epoch:2 * epoch + 2]), expected)
        assert len(set(expected)) == 8  # no repeats within an epoch
    assert not np.array_equal(seen[0], seen[2])  # epochs are reshuffled
    again = StatefulPromptLoader(ds, batch_size=4, shuffle=True, seed=7)
    assert all(_same(again.next_batch(), ds.gather(idx)) for idx in seen)
    other = StatefulPromptLoader(ds, batch_size=4, shuffle=True, seed=8)
    assert not np.array_equal(other.next_batch()["prompt_index"], seen[0])
    plain = StatefulPromptLoader(ds, batch_size=4, shuffle=False)
    assert [plain.next_batch()["prompt_index"].tolist() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                                                 [0, 1, 2, 3]]


@pytest.mark.parametrize("consumed", [1, 2, 3, 5])  # mid-epoch, at and across epoch boundaries
def test_state_dict_resume_yields_identical_batches(consumed):
    ds = _dataset(10)
    original = StatefulPromptLoader(ds, batch_size=3, shuffle=True, seed=11)  # 3 batches/epoch, 1 dropped
    for _ in range(consumed):
        original.next_batch()
    state = json.loads(json.dumps(original.state_dict()))  # must survive JSON
    assert state["seed"] == 11 and state["epoch"] == consumed // 3 and state["position"] == 3 * (consumed % 3)
    restored = StatefulPromptLoader(ds, batch_size=3, shuffle=True, seed=0)  # seed comes from the state
    restored.load_state_dict(state)
    for _ in range(7):
        assert _same(original.next_batch(), restored.next_batch())
    assert original.state_dict() == restored.state_dict()


def test_load_state_dict_rejects_bad_states():
    loader = StatefulPromptLoader(_dataset(10), batch_size=3)
    with pytest.raises(CheckpointError, match="'position'"):
        loader.load_state_dict({"epoch": 0, "seed": 0})
    with pytest.raises(CheckpointError, match="'epoch'"):
        loader.load_state_dict({"epoch": -1, "position": 0, "seed": 0})
    with pytest.raises(CheckpointError, match="past the end"):
        loader.load_state_dict({"epoch": 0, "position": 11, "seed": 0})


def test_loader_rejects_batch_larger_than_dataset():
    with pytest.raises(ConfigError, match="data.batch_size=11"):
        StatefulPromptLoader(_dataset(10), batch_size=11)


def test_a_response_decodes_without_the_ids_a_larger_model_may_sample():
    """A model built with more rows than the character tokenizer has ids may sample the spare
    ones: they are dropped, as a Hugging Face tokenizer drops them, not an error at step 1."""
    tok = CharTokenizer()
    ids = tok.encode("12") + [tok.vocab_size + 7] + tok.encode("3") + [tok.eos_token_id] + tok.encode("9")
    assert tok.decode_response(ids) == "123"
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
