"""``trainer.deterministic``: deterministic kernels and the cuBLAS workspace, set before CUDA."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from resilient_rl.config.schema import load_config
from resilient_rl.errors import ConfigError
from resilient_rl.workers import determinism
from resilient_rl.workers.determinism import CUBLAS_ENV, CUBLAS_WORKSPACE, apply_deterministic


@pytest.fixture
def restore_torch(monkeypatch):
    monkeypatch.delenv(CUBLAS_ENV, raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]


def test_deterministic_mode_sets_kernels_and_the_cublas_workspace(restore_torch):
    assert apply_deterministic(False) is False and CUBLAS_ENV not in os.environ
    assert apply_deterministic(True) is True
    assert os.environ[CUBLAS_ENV] == CUBLAS_WORKSPACE
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


def test_cuda_initialised_too_early_is_reported(restore_torch, monkeypatch, caplog):
    # Honest fake: CPU-only torch cannot initialise CUDA, so say it was initialised.
    monkeypatch.setattr(determinism.torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger=determinism.__name__):
        apply_deterministic(True)
    assert "CUDA was initialised before CUBLAS_WORKSPACE_CONFIG" in caplog.text


def test_the_config_key_is_typed():
    assert load_config(None, ["trainer.deterministic=true"]).trainer.deterministic is True
    assert load_config(None, []).trainer.deterministic is False
    with pytest.raises(ConfigError, match="trainer.deterministic"):
        load_config(None, ["trainer.deterministic=sometimes"])


def test_a_worker_applies_it_in_its_constructor(restore_torch):
    from resilient_rl.config.schema import config_to_dict
    from resilient_rl.workers.roles import RoleWorker

    cfg = load_config(None, ["trainer.deterministic=true", "trainer.device=cpu"])
    RoleWorker(config_to_dict(cfg), vocab_size=32, eos_token_id=1, pad_token_id=0)
    assert torch.are_deterministic_algorithms_enabled() and os.environ[CUBLAS_ENV] == CUBLAS_WORKSPACE
