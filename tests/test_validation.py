"""Validation sets: config keys and verl's aliases, held-out data and its errors, and the passes a
run makes (val/ metrics in metrics.jsonl, the trackers, Prometheus and plot), with training
unchanged by them. Runs use single-process roles (no Ray); a worker killed during a pass is
chaos/test_validation_faults.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from resilient_rl.config.schema import load_config
from resilient_rl.data.held_out import generated_held_out, held_out_dataset
from resilient_rl.data.loader import PromptDataset
from resilient_rl.data.tasks import CopyTask, get_task
from resilient_rl.data.tokenizer import build_tokenizer
from resilient_rl.errors import ConfigError
from resilient_rl.plot import build_figure
from resilient_rl.run.folder import deterministic_view
from resilient_rl.run.info import open_run
from resilient_rl.telemetry import TrainerMetrics
from resilient_rl.trainer.local_roles import LocalRoles
from resilient_rl.trainer.ppo import PPOTrainer
from resilient_rl.trainer.validation import summarize

TINY = ["trainer.total_steps=4", "data.batch_size=8", "data.num_prompts=32", "actor.mini_batch_size=8",
        "critic.mini_batch_size=8", "trainer.progress_bar=false", "trainer.device=cpu", "model.hidden_size=32",
        "model.num_layers=1", "telemetry.enabled=false"]
VALIDATE = ["data.val_num_prompts=10", "data.val_batch_size=4", "trainer.test_freq=3", "trainer.val_before_train=true"]


def _cfg(tmp_path, name: str, *extra: str):
    return load_config(None, [*TINY, f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", *extra])


def _fit(cfg) -> PPOTrainer:
    trainer = PPOTrainer(cfg, roles_factory=LocalRoles)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return trainer


def _without_val(rows):
    return [{k: v for k, v in r.items() if not k.startswith("val/") and k != "timing/val_s"}
            for r in deterministic_view(rows) if r["step"] > 0]


# -- config ----------------------------------------------------------------------------------

def test_verl_command_line_validation_keys(tmp_path):
    val = tmp_path / "val.jsonl"
    cfg = load_config(None, ["data.train_files=[train.jsonl]", f"data.val_files=[{val}]", "data.reward_fn=exact_match",
                             "trainer.test_freq=5", "trainer.val_before_train=True", "data.val_batch_size=16",
                             "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
                             "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
                             "actor_rollout_ref.rollout.val_kwargs.top_p=0.9",
                             "actor_rollout_ref.rollout.val_kwargs.n=2",
                             "actor_rollout_ref.rollout.val_kwargs.top_k=-1"])
    assert (cfg.data.val_path, cfg.data.val_batch_size) == (str(val), 16)
    assert (cfg.trainer.test_freq, cfg.trainer.val_before_train) == (5, True)
    kw = cfg.rollout.val_kwargs
    assert (kw.do_sample, kw.temperature, kw.top_p, kw.n) == (True, 0.6, 0.9, 2)
    # verl's "off": -1, and its defaults (greedy, one response).
    cfg = load_config(None, ["trainer.test_freq=-1", "data.val_batch_size=null"])
    assert cfg.trainer.test_freq == 0 and not cfg.rollout.val_kwargs.do_sample and cfg.rollout.val_kwargs.n == 1


@pytest.mark.parametrize("overrides,key", [
    (["trainer.test_freq=2"], "trainer.test_freq"),
    (["trainer.val_before_train=true"], "trainer.val_before_train"),
    (["data.val_num_prompts=-1"], "data.val_num_prompts"),
    (["data.val_num_prompts=4", "data.path=p.jsonl", "data.reward_fn=exact_match"], "data.val_num_prompts"),
    (["data.val_num_prompts=4", "data.val_path=v.jsonl"], "data.val_num_prompts"),
    (["data.val_path=v.parquet"], "data.val_path"),
    (["data.val_batch_size=0"], "data.val_batch_size"),
    (["rollout.val_kwargs.n=0"], "rollout.val_kwargs.n"),
    (["rollout.val_kwargs.top_p=0"], "rollout.val_kwargs.top_p"),
    (["rollout.val_kwargs.temperature=-1"], "rollout.val_kwargs.temperature"),
    (["data.val_files=[a.jsonl,b.jsonl]"], "data.val_files"),
])
def test_bad_validation_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


# -- held-out data -----------------------------------------------------------------------------

def test_a_builtin_tasks_held_out_prompts_are_not_training_prompts_and_reproducible():
    task = CopyTask(1, 2)
    train = {s.prompt for s in task.make_prompts(40, np.random.default_rng(0))}
    held = generated_held_out(task, 20, 0, train)
    assert len(held) == 20 and not {s.prompt for s in held} & train
    assert len({s.prompt for s in held}) == 20
    assert [s.prompt for s in generated_held_out(task, 20, 0, train)] == [s.prompt for s in held]
    with pytest.raises(ConfigError, match=r"data\.val_num_prompts=200"):
        generated_held_out(task, 200, 0, train)  # copy of 1-2 digits has 110 prompts


def _file_cfg(tmp_path, val_lines: list[str], *extra: str):
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"prompt": f"{i}{i}=", "answer": f"{i}{i}"}) for i in range(8)) + "\n")
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(val_lines) + "\n")
    return _cfg(tmp_path, "file", f"data.path={train}", f"data.val_path={val}", "data.reward_fn=exact_match",
                "trainer.test_freq=2", *extra), str(val)


@pytest.mark.parametrize("lines,where", [
    (['{"prompt": "12=", "answer": "12"}', "{not json"], ":2: not valid JSON"),
    (['{"prompt": "12=", "answer": 12}'], ":1: field 'answer' must be a string"),
    (['{"prompt": "", "answer": "1"}'], ":1: field 'prompt' must not be empty"),
    (["", "  "], "data.val_path="),
])
def test_a_bad_validation_file_is_named_before_any_worker_starts(tmp_path, lines, where):
    cfg, val = _file_cfg(tmp_path, lines)
    started = []
    with pytest.raises(ConfigError) as err:
        PPOTrainer(cfg, roles_factory=lambda *a: started.append(a))
    assert where in str(err.value) and (val in str(err.value))
    assert not started


def test_a_missing_validation_file_and_an_overlong_prompt_are_config_errors(tmp_path):
    cfg, val = _file_cfg(tmp_path, ['{"prompt": "12=", "answer": "12"}'])
    cfg.data.val_path = str(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match=r"data\.val_path=.*missing\.jsonl"):
        PPOTrainer(cfg, roles_factory=LocalRoles)
    cfg, val = _file_cfg(tmp_path, ['{"prompt": "1234567=", "answer": "1"}'], "data.max_prompt_length=6")
    with pytest.raises(ConfigError, match=rf"{val}:1 is \d+ tokens, longer than data\.max_prompt_length=6"):
        PPOTrainer(cfg, roles_factory=LocalRoles)


def test_held_out_file_is_scored_by_the_training_reward(tmp_path):
    cfg, _ = _file_cfg(tmp_path, ['{"prompt": "12=", "answer": "12"}', '{"question": "34=", "answer": "34"}'])
    task = get_task(cfg.data)
    tokenizer = build_tokenizer(cfg.data, task)
    train = PromptDataset.from_config(cfg.data, tokenizer, task)
    held = held_out_dataset(cfg.data, tokenizer, task, train)
    assert list(held.prompts) == ["12=", "34="] and list(held.answers) == ["12", "34"]
    metrics = summarize(np.array([1.0, 0.5, np.nan], dtype=np.float32), np.array([2.0, 3.0, 4.0]),
                        np.array(["a", "b", "b"], dtype=object), 0.1)
    assert metrics["val/reward_mean"] == pytest.approx(0.5) and metrics["val/accuracy"] == pytest.approx(1 / 3)
    assert metrics["val/reward_nonfinite"] == 1 and metrics["val/b/reward_mean"] == pytest.approx(0.25)


# -- a run that validates ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("val")
    plain = _fit(_cfg(tmp, "plain"))
    validated = _fit(_cfg(tmp, "validated", *VALIDATE, "trainer.loggers=[console,jsonl,tensorboard]"))
    return plain, validated


def test_validation_rows_and_training_unchanged(runs):
    plain, validated = runs
    rows = validated.run_dir.read_metrics()
    # Before training, after every 3rd step and after the last.
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in rows if "val/reward_mean" in r] == [0, 3, 4]
    assert rows[0].keys() >= {"val/reward_mean", "val/accuracy", "val/response_length_mean", "timing/val_s"}
    assert all(r["val/samples"] == 10 for r in rows if "val/samples" in r)
    # Training saw nothing of it: the same rows (and so the same updates) as without validation.
    assert _without_val(rows) == _without_val(plain.run_dir.read_metrics())


def test_sampled_validation_is_reproducible_and_leaves_training_alone(runs, tmp_path):
    plain, _ = runs
    sampled = [*VALIDATE, "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=1.0",
               "rollout.val_kwargs.n=2"]
    first, again = (_fit(_cfg(tmp_path, name, *sampled)).run_dir.read_metrics() for name in ("s1", "s2"))
    assert deterministic_view(first) == deterministic_view(again)
    assert first[0]["val/samples"] == 20
    assert _without_val(first) == _without_val(plain.run_dir.read_metrics())


def test_trackers_receive_the_val_metrics(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, validated = runs
    acc = EventAccumulator(str(validated.run_dir.path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("val/reward_mean")] == [0, 3, 4]
    log = (validated.run_dir.path / "train.log").read_text()
    assert "step 0 val/reward_mean=" in log


def test_plot_draws_the_validation_passes(runs):
    _, validated = runs
    fig = build_figure(open_run(str(validated.run_dir.path)))
    reward = fig.get_axes()[0]
    (line,) = [a for a in reward.get_lines() if a.get_gid() == "validation"]
    assert list(line.get_xdata()) == [0, 3, 4]
    assert "4 steps" in fig.get_suptitle()


def test_prometheus_gets_the_last_pass():
    metrics = TrainerMetrics(run="v")
    text = metrics.registry.get_sample_value
    assert text("rrl_val_reward_mean") is None  # absent until a pass
    metrics.observe_validation(0.25, 0.5)
    assert (text("rrl_val_reward_mean"), text("rrl_val_accuracy_ratio")) == (0.25, 0.5)


def test_a_verl_parquet_validation_file_keeps_its_data_sources(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    def row(i: int, source: str) -> dict:
        return {"data_source": source, "prompt": [{"role": "user", "content": f"{i}{i}="}], "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": f"{i}{i}"}, "extra_info": {"index": i}}

    for name, rows in (("train", [row(i, "copy") for i in range(4)]), ("val", [row(7, "a"), row(8, "b")])):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
    score = tmp_path / "score.py"
    score.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                     "    return float(solution_str == ground_truth)\n")
    cfg = load_config(None, [f"data.train_files={tmp_path / 'train.parquet'}",
                             f"data.val_files={tmp_path / 'val.parquet'}",
                             f"custom_reward_function.path={score}", "data.batch_size=2", "actor.mini_batch_size=2",
                             "critic.mini_batch_size=2", "data.tokenizer=pkg://resilient_rl/data/tiny_tokenizer"])
    task = get_task(cfg.data, cfg.custom_reward_function)
    tokenizer = build_tokenizer(cfg.data, task)
    held = held_out_dataset(cfg.data, tokenizer, task, PromptDataset.from_config(cfg.data, tokenizer, task))
    assert list(held.data_sources) == ["a", "b"] and held.extra_infos[0] == {"index": 7}
    batch = held.gather(np.arange(2))
    assert list(batch["data_sources"]) == ["a", "b"]
