"""Checkpoint tooling behind the command line: find, inspect, verify and export a run's checkpoints.

A checkpoint is named on the command line in one of three ways (see :func:`locate`):

- a run name, under a checkpoint root (``ppo-copy`` with ``--root checkpoints``);
- a run folder URL (``checkpoints/ppo-copy``, ``s3://bucket/ckpt/ppo-copy``);
- a step folder URL (``checkpoints/ppo-copy/step_00000020``).

:func:`inspect_run` lists a run's step folders with their commit state, size, age and checksum
state (sizes only, or every file's sha256 with ``deep``). :func:`export_checkpoint` verifies a
committed step and writes its model as one ``model.safetensors`` keyed by the model's own
state-dict names, plus a ``config.json``: the Hugging Face config for ``model.kind=hf`` (so
``AutoModelForCausalLM.from_pretrained(out)`` loads it) or the :class:`TinyLMConfig` fields for
the built-in tiny model. The model's shape comes from the run's saved ``config.yaml``; the export
is checked against a model built on the meta device from it, so a mismatch fails here and not
silently at load time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
import yaml

from resilient_rl.checkpoint.lease import Lease, read_lease
from resilient_rl.checkpoint.manager import ABANDONED_DIR, CheckpointManager
from resilient_rl.checkpoint.manifest import LATEST_NAME, MANIFEST_NAME, parse_step_dirname, step_dirname
from resilient_rl.checkpoint.safetensors_io import build_header, iter_file_chunks
from resilient_rl.checkpoint.sharded import gather_full_state
from resilient_rl.checkpoint.storage import Storage
from resilient_rl.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError

__all__ = [
    "DEFAULT_OUTPUT_DIR", "DEFAULT_ROOT", "CheckpointLocation", "CheckpointRow", "ExportResult", "RunReport",
    "describe_status", "export_checkpoint", "inspect_run", "locate", "require_committed", "verify_problem",
]

log = logging.getLogger(__name__)

DEFAULT_ROOT = "checkpoints"   # CheckpointConfig.root's default
DEFAULT_OUTPUT_DIR = "runs"    # TrainerConfig.output_dir's default
MODEL_PREFIX = "model"         # the actor saves {"model": get_model_state_dict(...), "optim": ...}
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


# --------------------------------------------------------------------------------- locations
@dataclass(frozen=True)
class CheckpointLocation:
    """A run (``root`` + ``run``) and, when one was named, a step of it."""

    root: str
    run: str
    step: int | None = None


def locate(target: str, root: str | None = None, step: int | None = None) -> CheckpointLocation:
    """Resolve a run name, run folder URL or step folder URL (see the module docstring).

    ``root`` only goes with a bare run name; ``step`` must agree with a step folder URL."""
    if not target or not target.strip():
        raise ConfigError("a run name or checkpoint folder URL is required")
    target = target.strip()
    if step is not None and step < 0:
        raise ConfigError(f"--step must be >= 0, got {step}")
    if "/" not in target:
        return CheckpointLocation(root or DEFAULT_ROOT, target, step)
    if root is not None:
        raise ConfigError(f"--root {root!r} goes with a run name; {target!r} is already a folder URL")
    parent, _, name = target.rstrip("/").rpartition("/")
    named = parse_step_dirname(name)
    if named is not None:
        if step is not None and step != named:
            raise ConfigError(f"--step {step} contradicts the step folder {target!r}")
        parent, _, name = parent.rpartition("/")
        step = named
    if not name or not parent or parent.endswith(":/"):
        raise ConfigError(f"{target!r}: expected a run folder such as checkpoints/my-run "
                          "or a step folder such as checkpoints/my-run/step_00000020")
    return CheckpointLocation(parent, name, step)


def _manager(loc: CheckpointLocation, storage_options: dict[str, Any] | None) -> CheckpointManager:
    return CheckpointManager(loc.root, loc.run, storage_options=storage_options)


def _pointer(manager: CheckpointManager) -> int | None:
    data = manager.storage.try_read_bytes(Storage.join(manager.run_name, LATEST_NAME))
    return None if data is None else parse_step_dirname(data.decode(errors="replace").strip())


def describe_status(manager: CheckpointManager, step: int, status: str) -> str:
    """A status from :meth:`CheckpointManager.verify` with the corrupt file's full URL."""
    if not status.startswith("corrupt:"):
        return f"{manager.step_dir(step)}: {status}"
    _, path, why = (status.split(": ", 2) + ["", ""])[:3]
    return f"{manager.step_dir(step)}/{path}: {why}"


def require_committed(root: str, run: str, storage_options: dict[str, Any] | None = None) -> int:
    """The newest committed step of ``run`` whose files have the manifest's sizes; raises
    CheckpointNotFoundError naming the run and root when there is none (a run to resume)."""
    manager = CheckpointManager(root, run, storage_options=storage_options)
    committed = manager.timeline_steps()
    if not committed:
        raise CheckpointNotFoundError(
            f"cannot resume run {run!r}: it has no committed checkpoint under checkpoint.root={root!r} "
            f"({manager.run_url}); start it with `resilient-rl train`")
    for step in reversed(committed):
        if manager.verify(step, deep=False) == "ok":
            return step
    raise CheckpointCorruptError(
        f"cannot resume run {run!r}: every committed checkpoint under checkpoint.root={root!r} is damaged "
        f"(newest: {describe_status(manager, committed[-1], manager.verify(committed[-1], deep=False))})")


# --------------------------------------------------------------------------------- list / verify
@dataclass(frozen=True)
class CheckpointRow:
    """One step folder as shown by ``checkpoints list|verify``."""

    step: int
    committed: bool
    size_bytes: int
    age_s: float | None
    status: str
    latest: bool


@dataclass
class RunReport:
    """A run's step folders and the checksum depth they were checked with."""

    manager: CheckpointManager
    rows: list[CheckpointRow]
    deep: bool
    pointer: int | None
    step: int | None = None  # the one step asked for, if any
    lease: Lease | None = None  # who writes (or last wrote) the run
    resumed: int | None = None  # the step a resume would start from (the timeline's newest)
    set_aside: int = 0  # timelines moved to {run}/abandoned/

    @property
    def run_url(self) -> str:
        return self.manager.run_url

    def newest_committed(self) -> CheckpointRow | None:
        committed = [r for r in self.rows if r.committed]
        return committed[-1] if committed else None

    def format_table(self) -> str:
        """A fixed-width table, one line per step folder, oldest first."""
        header = ("STEP", "COMMITTED", "SIZE", "AGE", "CHECK", "LATEST")
        lines = [tuple(str(x) for x in (r.step, "yes" if r.committed else "no", _size(r.size_bytes),
                                        _age(r.age_s), self._check(r), "latest" if r.latest else ""))
                 for r in self.rows]
        widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
        out = [f"run: {self.run_url}"]
        for row in [header, *lines]:
            out.append("  ".join(c.rjust(w) if i == 0 else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if not self.rows:
            out.append("(no step folders)")
        newest = self.newest_committed()
        if self.step is None and newest is not None and self.pointer != newest.step:
            why = ("it is the one resumed from" if self.resumed in (None, newest.step) else
                   f"committed before step {self.pointer}: not on the run's timeline; a resume loads step {self.resumed}")
            out.append(f"note: `{LATEST_NAME}` names {self.pointer if self.pointer is not None else 'nothing'}; "
                       f"the newest committed step is {newest.step} ({why})")
        if self.lease is not None:
            state = "released by" if self.lease.released else "held by"
            out.append(f"lease: {state} {self.lease.describe()}")
        if self.set_aside:
            out.append(f"set aside: {self.set_aside} abandoned timeline(s) under {self.run_url}/{ABANDONED_DIR}/")
        return "\n".join(out)

    def _check(self, row: CheckpointRow) -> str:
        if row.status == "ok":
            return "sha256 ok" if self.deep else "sizes ok"
        return row.status.replace("corrupt:", "CORRUPT:", 1)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if s >= size:
            return f"{s // size}{unit} {(s % size) // sub_size:02d}{sub}"
    return f"{s}s"


def inspect_run(loc: CheckpointLocation, deep: bool, storage_options: dict[str, Any] | None = None) -> RunReport:
    """Every step folder of the run (only ``loc.step`` when given), checked by size, or by
    size and sha256 of every file with ``deep``. Raises CheckpointNotFoundError when the run
    folder or the asked step does not exist."""
    manager = _manager(loc, storage_options)
    if not manager.storage.exists(loc.run):
        raise CheckpointNotFoundError(f"no checkpoints of run {loc.run!r} under root {loc.root!r} "
                                      f"({manager.run_url} does not exist)")
    pointer = _pointer(manager)
    rows = []
    for info in manager.list_checkpoints():
        if loc.step is not None and info.step != loc.step:
            continue
        status = info.status
        if deep and info.committed and status == "ok":
            status = manager.verify(info.step, deep=True)
        rows.append(CheckpointRow(info.step, info.committed, info.size_bytes, info.age_s, status,
                                  info.step == pointer))
    if loc.step is not None and not rows:
        raise CheckpointNotFoundError(f"run {loc.run!r} has no step {loc.step} ({manager.step_dir(loc.step)} "
                                      "does not exist)")
    lease = read_lease(manager.storage, loc.run)
    set_aside = len(manager.storage.ls(Storage.join(loc.run, ABANDONED_DIR)))
    return RunReport(manager, rows, deep, pointer, loc.step, lease, manager.latest_step(), set_aside)


def verify_problem(report: RunReport) -> str | None:
    """Why ``checkpoints verify`` fails: the asked step (or else the newest committed one) is
    uncommitted or corrupt, or nothing is committed. None when it passes."""
    manager = report.manager
    if report.step is not None:
        row = report.rows[0]
        if not row.committed:
            return f"{manager.step_dir(row.step)} is not committed (no {MANIFEST_NAME})"
        return None if row.status == "ok" else f"corrupt checkpoint: {describe_status(manager, row.step, row.status)}"
    newest = report.newest_committed()
    if newest is None:
        return f"run {manager.run_name!r} has no committed checkpoint under {report.run_url}"
    if newest.status == "ok":
        return None
    valid = [r.step for r in report.rows if r.committed and r.status == "ok"]
    fallback = f"; resuming falls back to step {valid[-1]}" if valid else "; no valid checkpoint is left"
    return f"latest checkpoint is corrupt: {describe_status(manager, newest.step, newest.status)}{fallback}"


# --------------------------------------------------------------------------------- export
@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote."""

    out_dir: str
    source: str
    step: int
    role: str
    model_kind: str | None
    files: tuple[str, ...]
    num_tensors: int


def _run_model_config(run: str, config_path: str | None, output_dir: str) -> tuple[Any, str | None, str]:
    """(model section, config digest or None, path) of the run's saved ``config.yaml``."""
    from resilient_rl.config.schema import config_digest, config_from_dict

    path = config_path or f"{output_dir.rstrip('/')}/{run}/config.yaml"
    try:
        with fsspec.open(path, "r") as f:
            raw = yaml.safe_load(f.read())
    except FileNotFoundError:
        raise ConfigError(f"cannot find the config of run {run!r}: {path} does not exist; pass --config with "
                          "the run's config.yaml (saved as {trainer.output_dir}/{run_name}/config.yaml) or "
                          "--output-dir with the run's trainer.output_dir") from None
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read the run config {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"run config {path} must hold a mapping of sections")
    try:
        cfg = config_from_dict(raw)
        return cfg.model, config_digest(cfg), path
    except ConfigError:
        # Sections other than the model may not validate here (e.g. trainer.device=cuda on a
        # CPU machine); only the model's shape matters for an export.
        model = raw.get("model") or {}
        return config_from_dict({"model": model}).model, None, path


def _check_weights(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """The exported tensors must be exactly ``model``'s state dict (names and shapes); a tied
    weight may be present once."""
    expected = model.state_dict()
    tied = ({n for n, _ in model.named_parameters(remove_duplicate=False)}
            - {n for n, _ in model.named_parameters()})
    missing = sorted(set(expected) - tied - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = [f"{k}: saved {list(tensors[k].shape)}, model {list(expected[k].shape)}"
              for k in sorted(set(tensors) & set(expected)) if tensors[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"the saved weights do not fit {what}: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"shape mismatches {shapes[:5]}")


def _embedding_rows(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> int:
    """Rows of the saved input embedding (the tokenizer's vocabulary the run was trained with)."""
    weight = model.get_input_embeddings().weight
    name = next(n for n, p in model.named_parameters() if p is weight)
    if name not in tensors:
        raise CheckpointError(f"the saved weights have no input embedding {name!r}")
    return int(tensors[name].shape[0])


def _tiny_config_json(model_cfg: Any, tensors: Mapping[str, torch.Tensor], where: str) -> bytes:
    from resilient_rl.models.factory import tiny_config
    from resilient_rl.models.tiny import TinyCausalLM

    if "embed_tokens.weight" not in tensors:
        raise CheckpointError(f"the saved weights have no 'embed_tokens.weight' (not a tiny model?); see {where}")
    config = tiny_config(model_cfg, int(tensors["embed_tokens.weight"].shape[0]))
    with torch.device("meta"):
        _check_weights(TinyCausalLM(config), tensors, f"TinyCausalLM({config}) built from {where}")
    return json.dumps(dataclasses.asdict(config), indent=2).encode()


def _hf_config_files(model_cfg: Any, tensors: Mapping[str, torch.Tensor], where: str) -> dict[str, bytes]:
    """``config.json`` for the saved weights (built from ``model.hf_config`` or copied from
    ``model.path``), plus ``generation_config.json`` when the model folder has one."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - an optional dependency
        raise ConfigError("exporting a model.kind='hf' run needs transformers: pip install 'resilient-rl[hf]'") from exc
    source = Path(os.path.expanduser(str(model_cfg.path))) if model_cfg.path is not None else None
    kwargs = dict(model_cfg.hf_config or {})
    model_type = kwargs.pop("model_type", None)
    if source is None and not model_type:
        raise ConfigError(f"model.hf_config.model_type is missing in {where}")
    try:
        if source is not None:
            config = transformers.AutoConfig.from_pretrained(str(source), local_files_only=True)
        else:
            config = transformers.AutoConfig.for_model(model_type, **kwargs)
            if "vocab_size" not in kwargs:
                # The trainer filled in the tokenizer's vocabulary: read it off the saved embedding.
                with torch.device("meta"):
                    probe = transformers.AutoModelForCausalLM.from_config(config)
                config.vocab_size = _embedding_rows(probe, tensors)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot build the Hugging Face config of the model in {where} "
                          f"(model.path={model_cfg.path!r}): {exc}") from exc
    _check_weights(model, tensors, f"{type(model).__name__} built from {where}")
    config.architectures = [type(model).__name__]
    config.dtype = next(iter(tensors.values())).dtype  # from_pretrained then loads them as saved
    files = {CONFIG_NAME: config.to_json_string(use_diff=True).encode()}
    generation = source / "generation_config.json" if source is not None else None
    if generation is not None and generation.is_file():
        files[generation.name] = generation.read_bytes()
    return files


def export_checkpoint(target: str, out_dir: str, *, role: str = "actor", root: str | None = None,
                      step: int | None = None, config_path: str | None = None,
                      output_dir: str = DEFAULT_OUTPUT_DIR,
                      storage_options: dict[str, Any] | None = None) -> ExportResult:
    """Verify a committed step (every file's sha256) and write ``role``'s model to ``out_dir``.

    ``target``/``root``/``step`` are resolved by :func:`locate`; a run without a step exports
    its newest committed one. For the actor a ``config.json`` is written from the run's
    ``config.yaml`` (``config_path``, else ``{output_dir}/{run}/config.yaml``); other roles get
    the weights only. Raises CheckpointCorruptError naming the damaged file."""
    if "://" in out_dir or (Path(out_dir).exists() and not Path(out_dir).is_dir()):
        raise ConfigError(f"--out {out_dir!r} must be a local folder (from_pretrained reads local files)")
    loc = locate(target, root, step)
    manager = _manager(loc, storage_options)
    step = loc.step if loc.step is not None else manager.latest_step()
    if step is None:
        raise CheckpointNotFoundError(f"run {loc.run!r} has no committed checkpoint under {manager.run_url}")
    source = manager.step_dir(step)
    status = manager.verify(step, deep=True)
    if status == "uncommitted":
        raise CheckpointNotFoundError(f"{source} is not a committed checkpoint (no {MANIFEST_NAME})")
    if status != "ok":
        raise CheckpointCorruptError(
            f"refusing to export a corrupt checkpoint: {describe_status(manager, step, status)}")
    manifest = manager.load_manifest(step)
    if role not in manifest.world_sizes:
        raise CheckpointError(f"{source} has no {role!r} state (roles: {', '.join(sorted(manifest.world_sizes))})")
    model_cfg, where = None, ""
    if role == "actor":
        model_cfg, digest, where = _run_model_config(loc.run, config_path, output_dir)
        if digest is not None and manifest.config_digest and digest != manifest.config_digest:
            log.warning("config %s (digest %s) differs from the one step %d was saved with (digest %s); "
                        "its model section is checked against the saved weights", where, digest, step,
                        manifest.config_digest)
    tensors = gather_full_state(manager.storage, Storage.join(loc.run, step_dirname(step), role),
                                manager.role_files(step, role), verify=False, prefix=MODEL_PREFIX)
    if not tensors:
        raise CheckpointCorruptError(f"{source}/{role}: no '{MODEL_PREFIX}/...' tensors saved")
    config_files: dict[str, bytes] = {}
    if model_cfg is not None and model_cfg.kind == "tiny":
        config_files = {CONFIG_NAME: _tiny_config_json(model_cfg, tensors, where)}
    elif model_cfg is not None:
        config_files = _hf_config_files(model_cfg, tensors, where)
    # Written through Storage: atomic files (tmp + fsync + rename), streamed from the tensors.
    dest = Storage(out_dir)
    ordered = dict(sorted(tensors.items()))
    header = build_header(ordered, {"format": "pt", "rrl_source": source, "rrl_step": str(step),
                                    "rrl_role": role, "rrl_run": loc.run})
    dest.write_stream(WEIGHTS_NAME, lambda: iter_file_chunks(header, ordered))
    for name, data in config_files.items():
        dest.write_bytes_atomic(name, data)
    log.info("exported %s (%s, %d tensors) to %s", source, role, len(tensors), dest.url)
    return ExportResult(dest.url, source, step, role, model_cfg.kind if model_cfg is not None else None,
                        (WEIGHTS_NAME, *config_files), len(tensors))
