"""verl's RL data and reward functions: parquet rows with chat prompts and ground truths, read with
the same bad-input guarantees as JSONL (file, row and field named, before any worker), and
``compute_score(data_source, solution_str, ground_truth, extra_info)`` from a file."""

from __future__ import annotations

import json

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from resilient_rl.config.schema import load_config  # noqa: E402
from resilient_rl.data.loader import PromptDataset  # noqa: E402
from resilient_rl.data.tasks import ParquetTask, Sample, compute_rewards, get_task, read_parquet  # noqa: E402
from resilient_rl.data.tokenizer import CharTokenizer, HFTokenizer  # noqa: E402
from resilient_rl.data.verl_reward import VerlScore  # noqa: E402
from resilient_rl.errors import ConfigError, UserCodeError  # noqa: E402

TINY_TOKENIZER = "pkg://resilient_rl/data/tiny_tokenizer"
#: A config small enough for two prompts (GRPO: no critic to size).
SMALL = ["data.batch_size=2", "actor.mini_batch_size=2", "algorithm.adv_estimator=grpo", "rollout.n=2"]
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def gsm8k_row(i: int, question: str, answer: str) -> dict:
    """One row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": i, "question": question}}


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


ROWS = [gsm8k_row(0, "Ann has 3 pens and buys 4 more. How many pens?", "7"),
        gsm8k_row(1, "A box has 6 eggs. How many eggs are in 2 boxes?", "12")]

SCORE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(ground_truth in solution_str), "acc": 1.0}

def failing(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("bad reward")

def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
    return "high"
'''


def test_verls_gsm8k_rows_are_read_as_they_are(tmp_path):
    samples = read_parquet(write_parquet(tmp_path / "train.parquet", ROWS))
    assert len(samples) == 2
    first = samples[0]
    assert first.prompt == [{"role": "user", "content": ROWS[0]["prompt"][0]["content"]}]
    assert first.answer == "7" and first.data_source == "openai/gsm8k"
    assert first.extra_info == {"split": "train", "index": 0, "question": ROWS[0]["extra_info"]["question"]}
    assert first.source.endswith("train.parquet: row 0")


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("prompt"), r"no column 'prompt'"),
    (lambda r: r.update(prompt=[{"role": "user"}]), r"row 1: field 'prompt'\[0\] must be a chat message"),
    (lambda r: r.update(prompt=[]), r"row 1: field 'prompt' must be a list of chat messages"),
    (lambda r: r.update(reward_model={"style": "rule", "ground_truth": None}),
     r"row 1: field 'reward_model' must be a mapping with a 'ground_truth'"),
])
def test_bad_rows_name_the_file_the_row_and_the_field(tmp_path, change, message):
    rows = [dict(r) for r in ROWS]
    if "no column" in message:
        for r in rows:
            change(r)
    else:
        change(rows[1])
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ConfigError, match=r"bad\.parquet.*" + message):
        read_parquet(path)


def test_unreadable_and_empty_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path='.*missing.parquet': cannot read the parquet file"):
        read_parquet(str(tmp_path / "missing.parquet"))
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match=r"text.parquet'?: cannot read the parquet file"):
        read_parquet(str(tmp_path / "text.parquet"))
    schema = pa.schema([("prompt", pa.string()), ("reward_model", pa.struct([("ground_truth", pa.string())]))])
    pq.write_table(schema.empty_table(), tmp_path / "empty.parquet")
    with pytest.raises(ConfigError, match=r"the parquet file holds no rows"):
        read_parquet(str(tmp_path / "empty.parquet"))


def test_chat_prompts_go_through_the_tokenizers_chat_template(tmp_path):
    tok = HFTokenizer.from_pretrained(TINY_TOKENIZER)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tok.format_prompt(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.format_prompt("2+2?") == tok.format_prompt([{"role": "user", "content": "2+2?"}])
    samples = read_parquet(write_parquet(tmp_path / "train.parquet", ROWS))
    ds = PromptDataset(samples, tok)
    row = ds.input_ids[0][ds.attention_mask[0].bool()].tolist()
    assert tok.hf.decode(row) == tok.format_prompt(samples[0].prompt)
    # Each row's prompt, data source and extra info stay one object each (not a 2-D array).
    assert ds.prompts.shape == ds.data_sources.shape == ds.extra_infos.shape == (2,)
    batch = ds.gather(np.array([1, 0]))
    assert list(batch["data_sources"]) == ["openai/gsm8k"] * 2 and batch["extra_infos"][0]["index"] == 1
    # Without a chat template, messages are refused, naming the row.
    with pytest.raises(ConfigError, match=r"train.parquet: row 0: the prompt is a list of chat messages"):
        PromptDataset(samples, CharTokenizer())
    plain = HFTokenizer.from_pretrained(TINY_TOKENIZER, chat_template=False)
    with pytest.raises(ConfigError, match=r"row 0: .*has no chat template applied \(data.chat_template=false\)"):
        PromptDataset(samples, plain)
    with pytest.raises(ConfigError, match=r"row 0 is \d+ tokens, longer than data.max_prompt_length=5"):
        PromptDataset(samples, tok, max_prompt_length=5)


def test_verls_compute_score_is_called_as_verl_calls_it(tmp_path):
    (tmp_path / "score.py").write_text(SCORE)
    score = VerlScore(str(tmp_path / "score.py"))
    assert score("so #### 7", "7", "openai/gsm8k", {"index": 0}) == 1.0  # a mapping's "score"
    with pytest.raises(UserCodeError, match=r"custom_reward_function.name='failing' .* raised ValueError: bad "
                                            r"reward while scoring response 'x'(.|\n)*line 6, in failing"):
        VerlScore(str(tmp_path / "score.py"), "failing")("x", "7", "s", None)
    with pytest.raises(ConfigError, match=r"returned 'high', not a number"):
        VerlScore(str(tmp_path / "score.py"), "not_a_number")("x", "7", "s", None)
    with pytest.raises(ConfigError, match=r"custom_reward_function.name='score': .* has no function 'score' "
                                          r"\(its functions: compute_score, failing, not_a_number\)"):
        VerlScore(str(tmp_path / "score.py"), "score")
    with pytest.raises(ConfigError, match=r"custom_reward_function.path='.*nope.py': no such file"):
        VerlScore(str(tmp_path / "nope.py"))
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(ConfigError, match=r"importing it raised ModuleNotFoundError"):
        VerlScore(str(tmp_path / "broken.py"))


def test_the_reward_gets_each_samples_data_source_and_extra_info(tmp_path):
    log = tmp_path / "calls.jsonl"
    (tmp_path / "score.py").write_text(f'''
import json
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open({str(log)!r}, "a") as f:
        f.write(json.dumps([data_source, solution_str, ground_truth, extra_info]) + "\\n")
    return 0.5
''')
    data = write_parquet(tmp_path / "train.parquet", ROWS)
    cfg = load_config(None, [f"data.train_files={data}", f"data.tokenizer={TINY_TOKENIZER}",
                             f"custom_reward_function.path={tmp_path / 'score.py'}"] + SMALL)
    task = get_task(cfg.data, cfg.custom_reward_function)
    assert isinstance(task, ParquetTask)
    tok = HFTokenizer.from_pretrained(TINY_TOKENIZER)
    rows = [tok.encode("it is 7", add_special_tokens=False), tok.encode("12", add_special_tokens=False)]
    scores = compute_rewards(task, tok, rows, ["7", "12"], ["openai/gsm8k", "other"], [{"index": 0}, None])
    assert scores.tolist() == [0.5, 0.5]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [["openai/gsm8k", "it is 7", "7", {"index": 0}], ["other", "12", "12", None]]


def test_a_file_of_prompts_needs_exactly_one_reward(tmp_path):
    data = write_parquet(tmp_path / "train.parquet", ROWS)
    small = SMALL
    with pytest.raises(ConfigError, match=r"data.task='parquet' needs a reward: data.reward_fn .* or "
                                          r"custom_reward_function.path"):
        load_config(None, [f"data.train_files={data}"] + small)
    with pytest.raises(ConfigError, match=r"custom_reward_function.path=.*data.reward_fn='exact_match' is set too"):
        load_config(None, [f"data.path={data}", "data.reward_fn=exact_match", "custom_reward_function.path=s.py"]
                    + small)
    with pytest.raises(ConfigError, match=r"is a parquet file but data.task='jsonl'"):
        load_config(None, [f"data.path={data}", "data.task=jsonl", "data.reward_fn=exact_match"] + small)
    # data.reward_fn (response, answer) scores verl's data too: the answer is the ground truth.
    cfg = load_config(None, [f"data.path={data}", "data.reward_fn=exact_match"] + small)
    task = get_task(cfg.data, cfg.custom_reward_function)
    assert task.reward("7", "7", data_source="openai/gsm8k", extra_info=None) == 1.0


def test_json_lines_and_built_in_tasks_are_unchanged(tmp_path):
    assert load_config(None, []).data.task == "copy"
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "12=", "answer": "12"}) + "\n")
    cfg = load_config(None, [f"data.path={data}", "data.reward_fn=exact_match", "data.batch_size=1",
                             "actor.mini_batch_size=2", "algorithm.adv_estimator=grpo", "rollout.n=2"])
    assert cfg.data.task == "jsonl"
    ds = PromptDataset.from_config(cfg.data, CharTokenizer())
    assert ds.data_sources is None and "data_sources" not in ds.gather(np.array([0]))
    assert Sample("1", "1").data_source is None


def test_the_built_in_gsm8k_reward_scores_verls_gsm8k_parquet(tmp_path):
    """verl's GSM8K parquet stores the bare number as its ground truth (no '#### n' line)."""
    from resilient_rl.data.rewards import gsm8k

    data = write_parquet(tmp_path / "train.parquet", ROWS)
    cfg = load_config(None, [f"data.path={data}", "data.reward_fn=gsm8k"] + SMALL)
    task = get_task(cfg.data)  # the references are checked as the task is built
    assert isinstance(task, ParquetTask)
    assert gsm8k("4 and 3 make #### 7", "7") == 1.0 and gsm8k("#### 8", "7") == 0.0 and gsm8k("#### 72", 72) == 1.0
    with pytest.raises(ConfigError, match="has no '#### <number>' line and is not a number"):
        gsm8k("#### 7", "seven")


def test_a_reward_that_edits_its_inputs_changes_neither_the_dataset_nor_a_replay(tmp_path):
    (tmp_path / "score.py").write_text('''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    extra_info["seen"] = extra_info.get("seen", 0) + 1
    return float(extra_info["seen"])
''')
    data = write_parquet(tmp_path / "train.parquet", ROWS)
    cfg = load_config(None, [f"data.path={data}", f"custom_reward_function.path={tmp_path / 'score.py'}"] + SMALL)
    task = get_task(cfg.data, cfg.custom_reward_function)
    tok = HFTokenizer.from_pretrained(TINY_TOKENIZER)
    ds = PromptDataset(read_parquet(data), tok)
    scores = []
    for _ in range(2):  # the same rows twice: a replayed step, or the prompts' next epoch
        batch = ds.gather(np.array([0, 1]))
        scores.append(compute_rewards(task, tok, [[5], [6]], batch["answers"], batch["data_sources"],
                                      batch["extra_infos"]).tolist())
    assert scores == [[1.0, 1.0], [1.0, 1.0]] and "seen" not in ds.extra_infos[0]


def test_a_compute_score_may_return_numpy_and_torch_scalars_as_verl_takes_them(tmp_path):
    (tmp_path / "score.py").write_text('''
import numpy as np, torch
def as_numpy_bool(data_source, solution_str, ground_truth, extra_info=None):
    return np.bool_(ground_truth in solution_str)
def as_tensor(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": torch.tensor(0.25)}
''')
    assert VerlScore(str(tmp_path / "score.py"), "as_numpy_bool")("so 7", "7", "s", None) == 1.0
    assert VerlScore(str(tmp_path / "score.py"), "as_tensor")("x", "7", "s", None) == 0.25
