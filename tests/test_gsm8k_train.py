"""End to end: a GSM8K-format JSONL task, a Hugging Face tokenizer from a local folder (with its
chat template) and a tiny Llama built from its config train with GRPO, in-process and on Ray.

The tokenizer is trained in the test; the reward is the ``gsm8k`` reward wrapped by a probe that
records what it was called with, so the test sees decoded rollouts going through it.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from resilient_rl.data.make_tokenizer import train_tokenizer
from resilient_rl.errors import ConfigError
from resilient_rl.config.schema import load_config
from resilient_rl.trainer.local_roles import LocalRoles
from resilient_rl.config.paths import resolve_path
from resilient_rl.trainer.ppo import PPOTrainer
from resilient_rl.data.tokenizer import HFTokenizer

PROBLEMS = [("Ann has 3 pens and buys 4 more. How many pens?", "3+4=<<3+4=7>>7\n#### 7"),
            ("A box has 6 eggs. How many eggs are in 2 boxes?", "6*2=<<6*2=12>>12\n#### 12"),
            ("Bo had 10 cards and lost 3. How many are left?", "10-3=<<10-3=7>>7\n#### 7"),
            ("A cup costs $5. How much do 3 cups cost?", "5*3=<<5*3=15>>15\n#### 15")]

PROBE = '''
from resilient_rl.data.rewards import gsm8k

CALLS = []

def scored(response, answer):
    """gsm8k, recorded, plus a small length term so that a group's rewards differ (a gradient)."""
    score = gsm8k(response, answer)
    CALLS.append((response, answer, score))
    return score + 0.01 * len(response)
'''


@pytest.fixture
def gsm8k_setup(tmp_path, monkeypatch):
    """(overrides for the shipped gsm8k_llama.yaml, the probe module) with files under tmp_path."""
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS))
    tok = train_tokenizer([t for pair in PROBLEMS for t in pair], tmp_path / "tok", vocab_size=300)
    module = f"gsm8k_probe_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = [f"data.path={data}", f"data.tokenizer={tok}", f"data.reward_fn={module}:scored",
                 "data.batch_size=4", "rollout.n=2", "rollout.max_new_tokens=12", "actor.mini_batch_size=4",
                 "trainer.total_steps=2", "trainer.progress_bar=false", "trainer.device=cpu",
                 "telemetry.enabled=false", f"trainer.output_dir={tmp_path}/runs",
                 f"checkpoint.root={tmp_path}/ckpt", "ray.cpus_per_worker=0.05"]
    yield overrides, module
    sys.modules.pop(module, None)


def _check_history(trainer: PPOTrainer, rows: list[dict], calls: list, steps: int) -> None:
    cfg = trainer.cfg
    per_step = cfg.data.batch_size * cfg.rollout.n
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "reward/mean"):
            assert math.isfinite(r[key]), (key, r)
    assert any(r["actor/grad_norm"] > 0 for r in rows)
    # Every rollout went through the reward, as decoded text, against a '####' reference answer.
    assert len(calls) == steps * per_step
    answers = {a for _, a in PROBLEMS}
    assert all(isinstance(resp, str) and ans in answers for resp, ans, _ in calls)
    assert any(resp.strip() for resp, _, _ in calls)
    for r, i in zip(rows, range(0, len(calls), per_step)):
        batch = calls[i:i + per_step]
        expected = sum(s + 0.01 * len(resp) for resp, _, s in batch) / per_step
        assert r["reward/mean"] == pytest.approx(expected, rel=1e-5)


def test_gsm8k_llama_trains_in_process(gsm8k_setup):
    overrides, module = gsm8k_setup
    cfg = load_config(resolve_path("pkg://resilient_rl/configs/gsm8k_llama.yaml"), overrides)
    trainer = PPOTrainer(cfg, roles_factory=LocalRoles)
    assert isinstance(trainer.tokenizer, HFTokenizer) and trainer.tokenizer.use_chat_template
    try:
        rows = trainer.fit()
        assert type(trainer.roles.actor.model).__name__ == "LlamaForCausalLM"
        vocab = trainer.roles.actor.model.get_input_embeddings().num_embeddings
        assert vocab == trainer.tokenizer.vocab_size == len(trainer.tokenizer.hf)
    finally:
        trainer.shutdown()
    _check_history(trainer, rows, sys.modules[module].CALLS, steps=2)


@pytest.mark.ray
def test_gsm8k_llama_trains_on_ray(ray_cluster, gsm8k_setup):
    overrides, module = gsm8k_setup
    cfg = load_config(resolve_path("pkg://resilient_rl/configs/gsm8k_llama.yaml"),
                      overrides + ["actor.world_size=1", "checkpoint.save_every=0",
                                   "trainer.run_name=gsm8k-ray"])
    trainer = PPOTrainer(cfg)
    try:
        rows = trainer.fit()
        assert set(trainer.roles.groups["rollout"].weights_version()) == {2}
    finally:
        trainer.shutdown()
    _check_history(trainer, rows, sys.modules[module].CALLS, steps=2)


def test_too_small_model_vocabulary_fails_before_any_worker_starts(gsm8k_setup):
    overrides, _ = gsm8k_setup
    cfg = load_config(resolve_path("pkg://resilient_rl/configs/gsm8k_llama.yaml"),
                      overrides + ["model.hf_config.vocab_size=100"])
    with pytest.raises(ConfigError, match=r"model.hf_config.vocab_size=100 is smaller than the tokenizer's "
                                          r"vocabulary \(300 ids"):
        PPOTrainer(cfg, roles_factory=LocalRoles)
