"""Values that pass a ``> 0`` check but break a run later are refused by the config, naming the key."""

from __future__ import annotations

import pytest

from resilient_rl.errors import ConfigError
from resilient_rl.config.schema import load_config


@pytest.mark.parametrize("override, key", [
    ("actor.optim.lr=inf", "actor.optim.lr"),
    ("critic.optim.lr=nan", "critic.optim.lr"),
    ("recovery.call_timeout_s=inf", "recovery.call_timeout_s"),
    ("recovery.failure_window_s=nan", "recovery.failure_window_s"),
    ("telemetry.gpu_sample_interval_s=-inf", "telemetry.gpu_sample_interval_s"),
    ("telemetry.call_timeout_s=inf", "telemetry.call_timeout_s"),
    ("algorithm.gamma=nan", "algorithm.gamma"),
    ("actor.optim.betas=[0.9,nan]", "actor.optim.betas"),
    ("actor.optim.lr=1e400", "actor.optim.lr"),
])
def test_non_finite_floats_are_refused(override, key):
    with pytest.raises(ConfigError, match=rf"{key}=.*finite"):
        load_config(None, [override])


def test_a_duration_too_long_to_wait_on_is_refused():
    with pytest.raises(ConfigError, match=r"recovery\.call_timeout_s=1e\+300.*seconds"):
        load_config(None, ["recovery.call_timeout_s=1e300"])
    assert load_config(None, ["recovery.call_timeout_s=86400"]).recovery.call_timeout_s == 86400.0


def test_telemetry_calls_have_a_timeout_of_their_own():
    cfg = load_config(None, ["recovery.call_timeout_s=900"])
    assert (cfg.telemetry.call_timeout_s, cfg.recovery.call_timeout_s) == (30.0, 900.0)
    assert load_config(None, ["telemetry.call_timeout_s=5"]).telemetry.call_timeout_s == 5.0
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match=rf"telemetry\.call_timeout_s={bad}(\.0)?: must be > 0 seconds"):
            load_config(None, [f"telemetry.call_timeout_s={bad}"])


def test_a_huge_integer_for_a_float_is_a_config_error():
    with pytest.raises(ConfigError, match=r"actor\.optim\.lr"):
        load_config(None, ["actor.optim.lr=" + "9" * 400])


@pytest.mark.parametrize("overrides, key, why", [
    (["actor.mini_batch_size=7"], "actor.mini_batch_size=7", "divisible by actor.world_size=2"),
    (["critic.world_size=2", "critic.mini_batch_size=5"], "critic.mini_batch_size=5", "divisible by critic.world_size=2"),
    (["actor.mini_batch_size=24"], "actor.mini_batch_size=24", r"must divide data.batch_size \* rollout.n = 64"),
    (["data.batch_size=12", "actor.mini_batch_size=8", "critic.mini_batch_size=12"], "actor.mini_batch_size=8",
     r"must divide data.batch_size \* rollout.n = 12"),
])
def test_mini_batches_that_do_not_split_exactly_are_refused(overrides, key, why):
    with pytest.raises(ConfigError, match=rf"{key}.*{why}"):
        load_config(None, overrides)


def test_exact_mini_batch_splits_pass():
    cfg = load_config(None, ["data.batch_size=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
                             "actor.world_size=4"])
    assert cfg.actor.mini_batch_size == 8
    grpo = load_config(None, ["algorithm.adv_estimator=grpo", "rollout.n=4", "data.batch_size=16",
                              "actor.mini_batch_size=32", "critic.mini_batch_size=7"])
    assert not grpo.critic.enabled  # GRPO has no critic: its mini batch is not checked
