"""Which config keys a resume may change, and comparing a new config with a checkpoint's.

A checkpoint holds state whose shape and meaning follow from the config it was written with: the
model's tensors, the optimiser's moments, the data order, the role world sizes, the algorithm. A
resume with a different value for one of those keys would fail deep inside a worker (a shape
mismatch reported as a corrupt checkpoint) or, worse, continue a different experiment under the
same run name. So a resume is compared key by key with the saved config before anything is
written, and only the keys of :data:`RESUME_MAY_CHANGE` may differ: how long the run goes on, the
learning rate, where results and logs go, how checkpoints are kept, how failures are handled,
telemetry and the Ray cluster. A key naming a file the run reads (:data:`FILE_KEYS`) may point
to another path holding the content the checkpoint recorded (a run moved to another mount point).
Every other difference is a ConfigError naming the keys.

The same path may hold other content than the checkpoint recorded (a data file regenerated, a
tokenizer folder updated, a reward file edited in place): :func:`check_files_in_place` compares
the recorded digests with the current files even when the configs are equal. A changed data file
or tokenizer is refused (the saved data position and token ids follow from what was recorded);
an edited reward file is resumed with a warning (:data:`EDITABLE_IN_PLACE`).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from resilient_rl.config.file_digests import FILE_KEYS, split_recorded
from resilient_rl.errors import ConfigError

logger = logging.getLogger(__name__)

#: How a role's state is laid out and computed, not what it is: a checkpoint loads into another
#: world size, strategy or node layout (it is resharded at load), and the memory and speed knobs
#: (micro-batches, recomputation, compilation of the roles and of the rollout's decode step, packing)
#: change no tensor that is saved.
_LAYOUT = tuple(f"{role}.world_size" for role in ("actor", "critic", "ref", "rollout")) + tuple(
    f"{role}.{key}" for role in ("actor", "critic") for key in (
        "strategy", "reshard_after_forward", "micro_batch_tokens", "activation_checkpointing", "compile",
        "compile_elementwise")) + (
    "actor.packing", "actor.compile_head", "ref.reshard_after_forward", "rollout.weight_transfer", "rollout.engine",
    "rollout.finish_check_every", "rollout.compact_min_fraction", "rollout.cuda_graphs", "rollout.compile",
    "trainer.device", "trainer.placement", "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.role_nnodes",
    "trainer.sharding", "trainer.deterministic")

#: Dotted keys (a section name covers every key under it) that may differ between a checkpoint's
#: config and the config that resumes it. None of them changes the shape of the saved state or the
#: data order; the learning rates take effect from the first resumed step (the saved LR schedule
#: is re-based on them, see ``workers/checkpointing.py``). Listed in README.md ("Changing the
#: config on resume").
RESUME_MAY_CHANGE: tuple[str, ...] = _LAYOUT + (
    "trainer.total_steps",
    "trainer.total_epochs",  # sets trainer.total_steps
    "trainer.run_name",  # path:<step folder> of another run continues under a new name
    "trainer.output_dir",
    "trainer.log_every",
    "trainer.progress_bar",
    "trainer.loggers",
    "trainer.project_name",
    "trainer.network_interface",
    "trainer.nonfinite",
    "trainer.max_nonfinite",
    "trainer.preempt_grace_s",  # how long a preemption may take to save, not what is saved
    # Validation reads the weights and never writes them: what it scores and how often may change.
    "trainer.test_freq",
    "trainer.val_before_train",
    "data.val_path",
    "data.val_num_prompts",
    "data.val_batch_size",
    "rollout.val_kwargs",
    "actor.optim.lr",
    "critic.optim.lr",
    "checkpoint",  # root, save interval, retention, resume, storage options, leases, timeouts
    "recovery",  # failure budget, timeouts, snapshots, spares
    "telemetry",
    "ray",
)


#: File keys whose content may change at the same path on resume, with a warning naming both digests: the
#: reward's code. It is not part of the saved state and nothing saved is indexed by it (a reward fixed mid-run
#: scores the resumed steps), and ``data.reward_fn``, an import path, is compared by its name, never by its
#: code; so, as another ``data.reward_fn`` is, a reward file at another path with other content is refused.
EDITABLE_IN_PLACE: tuple[str, ...] = ("custom_reward_function.path",)


def may_change_on_resume(key: str) -> bool:
    """Whether dotted ``key`` is one of (or under one of) :data:`RESUME_MAY_CHANGE`."""
    return any(key == allowed or key.startswith(allowed + ".") for allowed in RESUME_MAY_CHANGE)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists are values (compared whole)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_keys(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two configs as plain data (see
    ``config.schema.redacted_config_dict``). ``checkpoint.takeover`` is one start's choice and
    never counts; a key the saved config lacks (written by an older version) is compared with
    the new config's default."""
    from resilient_rl.config.schema import Config, config_to_dict

    old = flatten(config_to_dict(Config()))
    old.update(flatten(saved))
    now = flatten(new)
    keys = sorted(k for k in old.keys() | now.keys() if old.get(k) != now.get(k))
    return [k for k in keys if k != "checkpoint.takeover"]


def _file_verdicts(refused: list[str], old: Mapping[str, Any], now: Mapping[str, Any],
                   saved_files: Mapping[str, str] | None,
                   new_files: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """Of the ``refused`` keys, (those naming a file moved with its content unchanged, a note per
    file key that stays refused saying why its content could not clear it)."""
    moved, notes = [], {}
    for key in refused:
        was, is_ = old.get(key), now.get(key)
        if key not in FILE_KEYS or not isinstance(was, str) or not isinstance(is_, str):
            continue  # not a file, or one set where none was (or the reverse): a change of the config
        if key not in new_files:
            continue  # not a local path (a tokenizer's hub name) or unreadable: compared by name
        if saved_files is None:
            notes[key] = (" (the checkpoint predates content digests of the files a config names, so a moved "
                          "file cannot be told from a changed one)")
        elif key not in saved_files:
            notes[key] = " (the checkpoint recorded no content digest of it: it named no local file)"
        elif saved_files[key] != new_files[key]:
            notes[key] = (f" (the content differs: sha256 {saved_files[key]} recorded with the checkpoint, "
                          f"{new_files[key]} now)")
        else:
            moved.append(key)
    return moved, notes


def _in_place(old: Mapping[str, Any], now: Mapping[str, Any], saved_files: Mapping[str, str] | None,
              new_files: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """Of the file keys naming the same path as when the checkpoint was written and another content
    than it recorded, (a refusal detail of each that may not change in place, those that may)."""
    refused, allowed = [], []
    for key in FILE_KEYS:
        path = old.get(key)
        if (not saved_files or key not in saved_files or key not in new_files or not isinstance(path, str)
                or path != now.get(key) or saved_files[key] == new_files[key]):
            continue
        if key in EDITABLE_IN_PLACE:
            allowed.append(key)
        else:
            refused.append(f"{key} {path!r} (sha256 {saved_files[key]} recorded with the checkpoint, "
                           f"{new_files[key]} now)")
    return refused, allowed


def check_files_in_place(saved: Mapping[str, Any], new: Mapping[str, Any], where: str) -> list[str]:
    """Compare the content digests a checkpoint recorded (``saved``, found at ``where``) with those
    of the files the resuming config (``new``) names at the same paths, both as a checkpoint records
    them; whatever else differs is :func:`check_resume_config`'s. Raises ConfigError naming each
    data file or tokenizer changed in place since the checkpoint was written; warns naming each
    reward file edited in place (:data:`EDITABLE_IN_PLACE`) and returns their keys. A checkpoint
    that recorded no digests (written before them) is not compared."""
    saved, saved_files = split_recorded(saved)
    new, new_files = split_recorded(new)
    old, now = flatten(saved), flatten(new)
    refused, allowed = _in_place(old, now, saved_files, new_files or {})
    if refused:
        raise ConfigError(
            f"cannot resume {where}: {'; '.join(refused)} changed in place since the checkpoint was written, and the "
            f"checkpoint's state (the data loader's position, the token ids the model learned) follows from the "
            f"recorded content. Restore the original file (at that path, or point the key at a copy of it), or "
            f"start over with checkpoint.resume=off (or another trainer.run_name)")
    for key in allowed:
        logger.warning("resuming %s with %s %r edited in place since the checkpoint was written (sha256 %s recorded "
                       "with the checkpoint, %s now): a reward's code is not part of the saved state, so the resumed "
                       "steps are scored by the file as it is now", where, key, old[key], saved_files[key],
                       new_files[key])
    return allowed


def check_resume_config(saved: Mapping[str, Any], new: Mapping[str, Any], where: str) -> list[str]:
    """Compare the config a checkpoint was written with (``saved``, found at ``where``) with the
    config resuming it, both as a checkpoint records them (with their files' content digests, see
    :mod:`resilient_rl.config.file_digests`). Raises ConfigError naming every key that may not
    change on resume; a file key whose path changed is allowed when the content is the one the
    checkpoint recorded, and one whose path did not is checked by :func:`check_files_in_place`.
    Returns the keys that changed (all of them allowed), after logging a warning that names them
    (a moved file's names both paths)."""
    recorded, recording = saved, new
    saved, saved_files = split_recorded(saved)
    new, new_files = split_recorded(new)
    new_files = new_files or {}
    changed = changed_keys(saved, new)
    old, now = flatten(saved), flatten(new)
    refused = [k for k in changed if not may_change_on_resume(k)]
    moved, notes = _file_verdicts(refused, old, now, saved_files, new_files)
    refused = [k for k in refused if k not in moved]
    if refused:
        detail = "; ".join(f"{k}: {old.get(k, '(default)')!r} -> {now.get(k)!r}{notes.get(k, '')}" for k in refused)
        in_place = _in_place(old, now, saved_files, new_files)[0]
        if in_place:  # named too: one refusal says all that must be put back
            detail += f"; and {'; '.join(in_place)} changed in place since the checkpoint was written"
        files = (" (for a file: its original content, at the old path or a new one)"
                 if in_place or any(k in FILE_KEYS for k in refused) else "")
        raise ConfigError(
            f"cannot resume {where} with a changed {detail}: the checkpoint's state was built for the saved "
            f"value. Resume with the saved value{files}, or start over with checkpoint.resume=off (or another "
            f"trainer.run_name). Keys that may change on resume: {', '.join(RESUME_MAY_CHANGE)}; and, to another "
            f"path holding the same content, {', '.join(FILE_KEYS)}")
    check_files_in_place(recorded, recording, where)
    for key in moved:
        logger.warning("resuming %s with %s moved: %r -> %r holds the same content (sha256 %s)", where, key,
                       old[key], now[key], new_files[key])
    others = [k for k in changed if k not in moved]
    if others:
        logger.warning("resuming %s with a changed %s (allowed on resume)", where, ", ".join(others))
    return changed
