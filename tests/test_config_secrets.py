"""Credentials in checkpoint.storage_options never reach the saved config.yaml; the rest does."""

from __future__ import annotations

import logging

from resilient_rl.config.schema import REDACTED, config_digest, load_config
from resilient_rl.run.folder import RunDir

SECRETS = ["checkpoint.storage_options.key=AKIAEXAMPLEKEY", "checkpoint.storage_options.secret=s3cr3t-value",
           "checkpoint.storage_options.client_kwargs.endpoint_url=http://127.0.0.1:9000",
           "checkpoint.storage_options.client_kwargs.aws_session_token=session-tok",
           "checkpoint.storage_options.requester_pays=true"]


def test_saved_config_redacts_credentials_and_keeps_other_options(tmp_path, caplog):
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", *SECRETS])
    assert cfg.checkpoint.storage_options["secret"] == "s3cr3t-value"  # the live run still has them
    run_dir = RunDir(str(tmp_path), cfg.trainer.run_name)
    run_dir.save_config(cfg)
    text = (run_dir.path / "config.yaml").read_text()
    for secret in ("AKIAEXAMPLEKEY", "s3cr3t-value", "session-tok"):
        assert secret not in text
    assert text.count(REDACTED) == 3 and "http://127.0.0.1:9000" in text
    with caplog.at_level(logging.WARNING, logger="resilient_rl.config.schema"):
        back = load_config(str(run_dir.path / "config.yaml"))
    assert back.checkpoint.storage_options == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"},
                                               "requester_pays": True}
    assert "checkpoint.storage_options.secret was redacted" in caplog.text
    again = load_config(str(run_dir.path / "config.yaml"), ["checkpoint.storage_options.secret=from-cli"])
    assert again.checkpoint.storage_options["secret"] == "from-cli"


def test_digest_ignores_credentials_but_not_other_options():
    a = load_config(None, SECRETS)
    b = load_config(None, [*SECRETS, "checkpoint.storage_options.secret=rotated"])
    c = load_config(None, [*SECRETS, "checkpoint.storage_options.client_kwargs.endpoint_url=http://other"])
    assert config_digest(a) == config_digest(b) != config_digest(c)


def test_a_malformed_override_is_explained_in_full_not_redacted(capsys):
    from resilient_rl.cli import EXIT_ERROR, main

    assert main(["train", "trainer.total_steps"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "override 'trainer.total_steps' must have the form section.field=value, e.g. trainer.total_steps=50" in err
    assert REDACTED not in err
