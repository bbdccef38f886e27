"""No credential leaves the process: one redaction for config.yaml, trackers, status, events, logs."""

from __future__ import annotations

import logging
import sys

import pytest

from resilient_rl.config.schema import load_config, redacted_config_dict
from resilient_rl.config.secrets import REDACTED, is_secret_key, redact, redact_text, remember_secrets
from resilient_rl.trainer.hooks import TrainerHook

SPELLINGS = ["key", "secret", "token", "aws_secret_access_key", "secretAccessKey", "accessKey", "apiKey",
             "api_key", "X-Api-Key", "Authorization", "authorization", "passphrase", "password", "session_token",
             "SessionToken", "client_secret", "account_key", "sas_token", "connection_string", "credentials"]


@pytest.mark.parametrize("key", SPELLINGS)
def test_every_spelling_of_a_credential_key_is_redacted(key):
    out = redact({"client_kwargs": {"headers": {key: "hunter2-value"}}, "region_name": "eu-west-1"})
    assert out == {"client_kwargs": {"headers": {key: REDACTED}}, "region_name": "eu-west-1"}


@pytest.mark.parametrize("key", ["endpoint_url", "region_name", "max_new_tokens", "use_ssl", "anon", "bucket",
                                 "tokenizer", "requester_pays", "keep_last"])
def test_settings_are_not_credentials(key):
    assert not is_secret_key(key)


@pytest.mark.parametrize("text, secret", [
    ("https://alice:pw-0xdeadbeef@minio.local:9000/bucket", "pw-0xdeadbeef"),
    ("s3://AKIAUSERKEY:verysecret@bucket/run", "verysecret"),
    ("https://host/obj?X-Amz-Signature=abcdef0123&X-Amz-Date=20260101", "abcdef0123"),
    ("https://acct.blob.core.windows.net/c?sv=2020&sas_token=sig-999999", "sig-999999"),
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload", "eyJhbGciOiJIUzI1NiJ9"),
])
def test_credentials_inside_strings_are_redacted(text, secret):
    assert secret not in redact({"root": text})["root"]
    assert secret not in redact_text(f"could not open {text}")


def test_log_text_loses_every_secret_the_process_has_seen():
    remember_secrets({"storage_options": {"apiKey": "zq-remembered-7781"}})
    assert redact_text("boto said: invalid key zq-remembered-7781 for bucket") == \
        f"boto said: invalid key {REDACTED} for bucket"
    assert redact_text("checkpoint.storage_options.secret=plain-override") == \
        f"checkpoint.storage_options.secret={REDACTED}"
    assert redact_text("lease token: 5, step 3") == "lease token: 5, step 3"  # numbers are not credentials


def test_whole_config_is_redacted_not_only_storage_options():
    cfg = load_config(None, ["checkpoint.root=s3://user:rootpw-1234@bucket/x",
                             "checkpoint.storage_options.secretAccessKey=camel-secret-1"])
    data = redacted_config_dict(cfg)
    assert "rootpw-1234" not in str(data) and "camel-secret-1" not in str(data)
    assert data["checkpoint"]["root"] == f"s3://{REDACTED}@bucket/x"


# The credentials of the end-to-end run: long, unique strings, grepped for in every byte written.
KEY, SECRET, TOKEN = "AKIARRLTESTKEY0001", "rrl-secret-value-31415", "rrl-session-token-27182"


def test_a_run_with_s3_credentials_and_every_tracker_writes_no_secret(tmp_path, moto, monkeypatch):
    if isinstance(moto, str):
        pytest.skip(moto)
    from resilient_rl.trainer.local_roles import LocalRoles
    from resilient_rl.trainer.ppo import PPOTrainer

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "runs"))
    overrides = [f"checkpoint.storage_options.secret={SECRET}", f"checkpoint.storage_options.token={TOKEN}"]
    # A key given on the command line (as the README says not to) must not be recorded either.
    monkeypatch.setattr(sys, "argv", ["resilient-rl", "train", *overrides])
    cfg = load_config(None, [
        "trainer.total_steps=2", "trainer.progress_bar=false", "data.batch_size=8", "data.num_prompts=16",
        "actor.mini_batch_size=8", "critic.mini_batch_size=8", "model.hidden_size=32", "model.num_layers=1",
        "model.intermediate_size=64", "telemetry.enabled=false", "trainer.run_name=secret-run",
        "trainer.loggers=[console,jsonl,tensorboard,wandb,mlflow]", f"trainer.output_dir={tmp_path}/runs",
        "checkpoint.root=s3://ckpt/secret-test", f"checkpoint.storage_options.key={KEY}",
        f"checkpoint.storage_options.client_kwargs.endpoint_url={moto.endpoint_url}",
        "checkpoint.storage_options.skip_instance_cache=true", *overrides])

    class CarelessLog(TrainerHook):  # a message quoting the options, as a library's error might
        def on_step_start(self, trainer, step):
            logging.getLogger("resilient_rl.test").warning("opened storage with %s",
                                                           trainer.cfg.checkpoint.storage_options)
            trainer.run_dir.event("failure", step=step, role="actor", rank=0, cause="died",
                                  message=f"s3://{KEY}:{SECRET}@ckpt unreachable")

    trainer = PPOTrainer(cfg, roles_factory=LocalRoles, hooks=[CarelessLog()])
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"config.yaml", "train.log", "events.jsonl", "metrics.jsonl"} <= names
    assert any(p.suffix == ".wandb" for p in files) and any("tfevents" in p.name for p in files)
    assert any("mlruns" in p.parts for p in files)
    leaks = {str(p.relative_to(tmp_path)): s for p in files for s in (KEY, SECRET, TOKEN)
             if s.encode() in p.read_bytes()}
    assert leaks == {}
    assert REDACTED in (trainer.run_dir.path / "train.log").read_text()


def test_status_never_passes_the_placeholder_as_a_credential(tmp_path, monkeypatch):
    """``status`` opens the storage with the user's own credentials, not with "<redacted>"."""
    import resilient_rl.checkpoint.inspect as export
    from resilient_rl.run_status import gather_status
    from resilient_rl.run.folder import RunDir

    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", f"checkpoint.root={tmp_path}/ckpt",
                             "checkpoint.storage_options.secret=status-secret-1", "checkpoint.storage_options.x=1"])
    run_dir = RunDir(str(tmp_path), cfg.trainer.run_name)
    run_dir.save_config(cfg)
    seen = []
    real = export.inspect_run

    def spy(loc, deep, storage_options=None):
        seen.append(storage_options)
        return real(loc, deep, storage_options={})

    monkeypatch.setattr(export, "inspect_run", spy)
    gather_status(str(run_dir.path))
    assert seen == [{"x": 1}]


def test_prose_about_authentication_is_left_alone():
    text = "Token authentication is enabled for this Ray cluster. Basic authentication needs a password."
    assert redact_text(text) == text


def test_the_cli_error_line_is_redacted(capsys, monkeypatch):
    from resilient_rl import cli
    from resilient_rl.errors import StorageError

    def fails(args):
        raise StorageError("open failed for s3://AKIACLIKEY:cli-secret-0042@bucket/run")

    monkeypatch.setattr(cli, "cmd_train", fails)
    monkeypatch.setattr(cli, "_setup_logging", lambda quiet: None)
    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    for action in parser._subparsers._group_actions[0].choices.values():
        if action.get_default("func") is not None and action.prog.endswith(" train"):
            action.set_defaults(func=fails)
    assert cli.main(["train"]) == cli.EXIT_RUNTIME
    err = capsys.readouterr().err
    assert "cli-secret-0042" not in err and "s3://<redacted>@bucket/run" in err
