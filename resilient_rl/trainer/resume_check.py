"""Before a controller writes anything: does its config fit the checkpoint it is about to resume?

The checkpoint a resume loads (``checkpoint.resume=auto``: the run's newest committed step;
``path:<step folder>``: that step) records the digest of the config it was written with in its
manifest, and, since this version, the config itself in ``trainer_state.json``, later with the
content digests of the files it names (so that a file moved to another path is told from a
changed one). An older checkpoint has only the digest: the run folder's ``config.yaml``
(written by the start that saved it, or by a later start that was itself checked) stands in for
it. The keys that differ are then checked by :func:`resilient_rl.config.resume.check_resume_config`.
Where the config digests are equal, the files the config names may still hold other content than
the checkpoint recorded (edited in place): when the config names a file and the checkpoint
recorded its digest, :func:`resilient_rl.config.resume.check_files_in_place` compares them (the
current digests are those the start already computed, see :func:`checkpoint_config`).

Everything here only reads. A checkpoint whose manifest or trainer state cannot be read is left
to the restore, which reports it and falls back to an older one: with ``auto`` the check does the
same, and compares the newest step of the timeline it can read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from resilient_rl.checkpoint import CheckpointManager
from resilient_rl.config.file_digests import RECORD_KEY, file_digests, with_file_digests
from resilient_rl.config.resume import check_files_in_place, check_resume_config
from resilient_rl.config.schema import redacted_config_dict
from resilient_rl.errors import ConfigError, RRLError

logger = logging.getLogger(__name__)

#: The key of ``trainer_state.json`` that holds the config the checkpoint was written with.
CONFIG_KEY = "config"


def checkpoint_config(cfg, digests: dict[str, str] | None = None) -> dict[str, Any]:
    """What a checkpoint records of ``cfg``: the config (credentials redacted, as in
    ``config.yaml``) and the content digests of the files it names: ``digests`` when given
    (:func:`named_file_digests`, taken before the files were read), else computed now
    (:func:`resilient_rl.config.file_digests.with_file_digests`: each is read once per start)."""
    config = redacted_config_dict(cfg)
    return with_file_digests(config) if digests is None else {**config, RECORD_KEY: dict(digests)}


def named_file_digests(cfg) -> dict[str, str]:
    """The content digests of the files ``cfg`` names, taken before the trainer reads them: a file
    edited while the start reads it is then recorded by what it held before, and a resume after
    that refuses it, instead of recording the edit beside data read before it."""
    return file_digests(redacted_config_dict(cfg))


def _resumed_steps(cfg, manager: CheckpointManager) -> list[tuple[CheckpointManager, int]]:
    """(manager, step) of the checkpoints ``checkpoint.resume`` may load, the first first: the one
    it names, or with ``auto`` the timeline's steps newest first (the restore falls back along
    them); none for ``off``."""
    resume = cfg.checkpoint.resume
    if resume == "off":
        return []
    if resume.startswith("path:"):
        from resilient_rl.checkpoint.restore import split_step_url

        root, run, step = split_step_url(resume[5:])
        other = CheckpointManager(root, run, storage_options=manager.storage_options)
        return [(other, step)] if other.is_committed(step) else []
    return [(manager, step) for step in reversed(manager.timeline_steps())]


def _readable(found: list[tuple[CheckpointManager, int]], digest: str,
              names_files: bool) -> tuple[CheckpointManager, int, str, object] | None:
    """The first of ``found`` whose manifest (and, where its config digest is another than
    ``digest`` or the config ``names_files`` with a content digest, trainer state) reads:
    (manager, step, its config digest, its recorded config or None); None when none does."""
    for source, step in found:
        try:
            saved_digest = source.load_manifest(step).config_digest
            needed = saved_digest and (saved_digest != digest or names_files)
            saved = source.load_trainer_state(step).get(CONFIG_KEY) if needed else None
        except ConfigError:
            raise
        except (RRLError, OSError) as exc:  # unreadable: the restore reports it (and tries an older step)
            logger.warning("config check before resuming: %s cannot be read (%s); checking an older step",
                           source.step_dir(step), exc)
            continue
        return source, step, saved_digest, saved
    return None


def _run_folder_config(run_path: Path) -> dict[str, Any] | None:
    path = run_path / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def check_resume(cfg, manager: CheckpointManager, run_path: Path, digest: str,
                 current: dict[str, Any] | None = None) -> str | None:
    """Refuse (ConfigError naming the keys) a resume whose config differs from the resumed
    checkpoint's in a key that may not change; warn naming the keys that changed otherwise.
    Whatever the digests, a data file or tokenizer the config names at the path the checkpoint
    recorded is refused when its content differs from what it recorded (an edited reward file is
    warned about). Returns the checkpoint's config digest when it differs from ``digest`` and was
    accepted (a restore of it is then not warned about again), else None."""
    current = checkpoint_config(cfg)  # the digests the start computed: a stat of each file, no read
    try:
        readable = _readable(_resumed_steps(cfg, manager), digest, bool(current[RECORD_KEY]))
    except ConfigError:
        raise
    except (RRLError, OSError) as exc:  # the folder cannot be listed: the restore reports it
        logger.debug("config check before resuming skipped: %s", exc)
        return None
    if readable is None:
        return None
    source, step, saved_digest, saved = readable
    if not saved_digest:
        return None
    where = f"checkpoint {source.step_dir(step)}"
    if saved_digest == digest:  # the same config: the files it names may still have changed in place
        if isinstance(saved, dict):
            check_files_in_place(saved, current, where)
        return None
    if not isinstance(saved, dict) and source.same_run(manager):
        saved = _run_folder_config(run_path)  # an older checkpoint: the run's saved config stands in
        where += f" (its config: {run_path / 'config.yaml'})"
    if not isinstance(saved, dict):
        logger.warning("resuming %s, written with a different config (digest %s, now %s); it records no config, "
                       "so the keys that changed cannot be named", where, saved_digest, digest)
        return saved_digest
    check_resume_config(saved, current, where)
    return saved_digest

