"""Done when a verl user's GSM8K run trains as it is: a parquet file in verl's GSM8K layout (chat
prompts, reward_model.ground_truth, data_source, extra_info), a verl reward file
(``compute_score(data_source, solution_str, ground_truth, extra_info)``) and a verl command line,
end to end on CPU."""

from __future__ import annotations

import json
import math

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from resilient_rl.config.schema import load_config  # noqa: E402
from resilient_rl.errors import ConfigError  # noqa: E402
from resilient_rl.trainer.local_roles import LocalRoles  # noqa: E402
from resilient_rl.trainer.ppo import PPOTrainer  # noqa: E402

PROBLEMS = [("Ann has 3 pens and buys 4 more. How many pens?", "7"),
            ("A box has 6 eggs. How many eggs are in 2 boxes?", "12"),
            ("Bo had 10 cards and lost 3. How many are left?", "7"),
            ("A cup costs $5. How much do 3 cups cost?", "15"),
            ("Cy reads 2 pages a day. How many pages in 4 days?", "8")]
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."

# As verl's verl/utils/reward_score/gsm8k.py scores, plus a small length term so that a group's
# rewards differ (a gradient); each call is logged for the test to read.
REWARD = '''
import json
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    found = re.search(r"#### (\\-?[0-9\\.\\,]+)", solution_str)
    answer = found.group(1).replace(",", "") if found else None
    score = 1.0 if answer == ground_truth else 0.0
    with open(LOG, "a") as f:
        f.write(json.dumps({"data_source": data_source, "solution_str": solution_str,
                            "ground_truth": ground_truth, "extra_info": extra_info}) + "\\n")
    return score + 0.01 * len(solution_str)
'''


@pytest.fixture
def verl_run(tmp_path):
    """(a verl command line, the reward's call log) for a parquet file written as verl writes GSM8K."""
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": "train", "index": i, "question": q}} for i, (q, a) in enumerate(PROBLEMS)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    # verl's held-out split: the same layout (two of the problems, as a test file would hold others).
    held_out = [{**row, "extra_info": {**row["extra_info"], "split": "test"}} for row in rows[:2]]
    pq.write_table(pa.Table.from_pylist(held_out), tmp_path / "test.parquet")
    log = tmp_path / "calls.jsonl"
    (tmp_path / "gsm8k_reward.py").write_text(f"LOG = {str(log)!r}\n" + REWARD)
    line = [f"data.train_files={tmp_path / 'train.parquet'}", "data.train_batch_size=2",
            "data.max_prompt_length=96", "data.max_response_length=8",
            "data.tokenizer=pkg://resilient_rl/data/tiny_tokenizer",
            "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_epochs=1", "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.temperature=1.0",
            "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
            f"data.val_files={tmp_path / 'test.parquet'}",
            "trainer.total_epochs=1", "trainer.save_freq=1", "trainer.test_freq=1",
            "trainer.logger=['console','jsonl']", "trainer.project_name=verl-port",
            "trainer.experiment_name=gsm8k-grpo", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
            "trainer.nnodes=1", "trainer.device=cpu", "+trainer.val_before_train=False",
            f"custom_reward_function.path={tmp_path / 'gsm8k_reward.py'}", "custom_reward_function.name=compute_score",
            "reward_model.enable=False",
            # Not verl's: this test's output folder, no progress bar or exporter.
            f"trainer.output_dir={tmp_path / 'runs'}", "trainer.progress_bar=false",
            "telemetry.enabled=false"]
    return line, log, tmp_path


def _train(cfg, roles_factory=None) -> list[dict]:
    trainer = PPOTrainer(cfg, roles_factory=roles_factory)
    # One epoch of 5 prompts in batches of 2: 2 steps (the last incomplete batch is dropped).
    assert cfg.trainer.total_steps == 2
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


def _check_run(rows: list[dict], log) -> None:
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "reward/mean"):
            assert math.isfinite(r[key]), (key, r)
    # Validated after each step (test_freq=1) on the 2 held-out prompts, greedily (one sample each),
    # scored by the same compute_score per data source.
    for r in rows:
        assert r["val/samples"] == 2 and math.isfinite(r["val/reward_mean"]), r
        assert r["val/openai/gsm8k/reward_mean"] == r["val/reward_mean"]
    # Every response went through verl's compute_score with its row's data source, ground truth and
    # extra info: 2 steps x (2 prompts x 2 samples + 2 held-out prompts).
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(calls) == 12
    assert [c["extra_info"]["split"] for c in calls] == (["train"] * 4 + ["test"] * 2) * 2
    truths = {i: a for i, (_, a) in enumerate(PROBLEMS)}
    for call in calls:
        assert call["data_source"] == "openai/gsm8k" and isinstance(call["solution_str"], str)
        assert call["ground_truth"] == truths[call["extra_info"]["index"]]
    expected = sum(0.01 * len(c["solution_str"]) for c in calls[:4]) / 4
    assert rows[0]["reward/mean"] == pytest.approx(expected, abs=1e-5)  # nobody solves GSM8K here


def test_verls_gsm8k_data_reward_and_command_line_train_end_to_end(verl_run):
    line, log, tmp_path = verl_run
    cfg = load_config(None, line)
    assert (cfg.checkpoint.save_every, cfg.checkpoint.root) == (1, str(tmp_path / "ckpt"))
    assert cfg.model.max_seq_len == 96 + 8  # verl's context: max_prompt_length + max_response_length
    _check_run(_train(cfg, LocalRoles), log)
    assert (tmp_path / "runs" / "gsm8k-grpo" / "metrics.jsonl").is_file()


@pytest.mark.ray
def test_verls_gsm8k_run_trains_and_checkpoints_on_ray(ray_cluster, verl_run):
    line, log, tmp_path = verl_run
    cfg = load_config(None, line + ["actor.world_size=1", "ray.cpus_per_worker=0.05"])
    _check_run(_train(cfg), log)
    # trainer.save_freq=1 into trainer.default_local_dir, under the experiment's name.
    run = tmp_path / "ckpt" / "gsm8k-grpo"
    assert (run / "step_00000001" / "MANIFEST.json").is_file() and (run / "step_00000002" / "MANIFEST.json").is_file()


def test_bad_verl_data_fails_before_any_worker_starts(verl_run):
    line, _, tmp_path = verl_run
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "2+2?"}],
             "reward_model": {"style": "rule"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    cfg = load_config(None, [f"data.train_files={tmp_path / 'bad.parquet'}"] + line[1:] + ["data.train_batch_size=1",
                      "actor_rollout_ref.actor.ppo_mini_batch_size=1"])

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    with pytest.raises(ConfigError, match=r"bad.parquet: row 0: field 'reward_model' must be a mapping with a "
                                          r"'ground_truth'"):
        PPOTrainer(cfg, roles_factory=no_workers)
