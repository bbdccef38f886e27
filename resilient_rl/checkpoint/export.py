"""Exporting a run's checkpoint as a model folder (``resilient-rl export``).

The checkpoint is named as for ``checkpoints list`` (:func:`resilient_rl.checkpoint.inspect.locate`).
:func:`export_checkpoint` verifies a
committed step and writes its model as one ``model.safetensors`` keyed by the model's own
state-dict names, plus a ``config.json``: the Hugging Face config for ``model.kind=hf`` (so
``AutoModelForCausalLM.from_pretrained(out)`` loads it, with the run's tokenizer files beside it for
``AutoTokenizer``) or the :class:`TinyLMConfig` fields for
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

from resilient_rl.checkpoint.manifest import MANIFEST_NAME, step_dirname
from resilient_rl.checkpoint.safetensors_io import build_header, iter_file_chunks
from resilient_rl.checkpoint.sharded import gather_full_state
from resilient_rl.checkpoint.storage import Storage
from resilient_rl.checkpoint.inspect import describe_status, locate, open_manager
from resilient_rl.config.file_digests import split_recorded
from resilient_rl.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError

__all__ = ["DEFAULT_OUTPUT_DIR", "ExportResult", "export_checkpoint"]

log = logging.getLogger(__name__)

DEFAULT_OUTPUT_DIR = "runs"    # TrainerConfig.output_dir's default
MODEL_PREFIX = "model"         # the actor saves {"model": get_model_state_dict(...), "optim": ...}
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


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


def _run_model_config(run: str, config_path: str | None, output_dir: str) -> tuple[Any, str | None, str, Any]:
    """(model section, config digest or None, path, ``data.tokenizer``) of the run's saved ``config.yaml``."""
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
    model, digest, tokenizer = _model_config_of(raw)
    return model, digest, path, tokenizer


def _model_config_of(raw: dict) -> tuple[Any, str | None, Any]:
    """(model section, config digest or None, ``data.tokenizer``) of a run's config as a mapping."""
    from resilient_rl.config.schema import config_digest, config_from_dict

    tokenizer = (raw.get("data") or {}).get("tokenizer")
    try:
        cfg = config_from_dict(raw)
        return cfg.model, config_digest(cfg), tokenizer
    except ConfigError:
        # Sections other than the model may not validate here (e.g. trainer.device=cuda on a
        # CPU machine); only the model's shape matters for an export.
        model = raw.get("model") or {}
        return config_from_dict({"model": model}).model, None, tokenizer


#: The files of a Hugging Face tokenizer folder, copied beside the exported weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")


def _tokenizer_files(tokenizer: Any, where: str) -> dict[str, bytes]:
    """The run's tokenizer folder (``data.tokenizer``) as files, so that the export loads with
    ``from_pretrained`` (or vLLM) as it is; nothing for the character tokenizer, which has no
    Hugging Face form."""
    if not tokenizer:
        log.info("%s uses the character tokenizer: the export has no tokenizer files", where)
        return {}
    from resilient_rl.config.paths import resolve_path

    folder = Path(resolve_path(str(tokenizer), "data.tokenizer"))
    if not folder.is_dir():
        raise ConfigError(f"data.tokenizer={tokenizer!r} of {where}: {folder} is not a folder here; export on a "
                          "machine that has the run's tokenizer folder")
    return {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}


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
    its newest committed one. For the actor a ``config.json`` is written from the config the step
    recorded in its ``trainer_state.json`` (unless ``config_path`` is given), else from the run's
    ``config.yaml`` (``config_path``, else ``{output_dir}/{run}/config.yaml``), and the run's
    Hugging Face tokenizer is copied beside it; other roles get the weights only. Raises CheckpointCorruptError naming the damaged file."""
    if "://" in out_dir or (Path(out_dir).exists() and not Path(out_dir).is_dir()):
        raise ConfigError(f"--out {out_dir!r} must be a local folder (from_pretrained reads local files)")
    loc = locate(target, root, step)
    manager = open_manager(loc, storage_options)
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
    model_cfg, where, tokenizer = None, "", None
    saved = manager.load_trainer_state(step).get("config") if role == "actor" and config_path is None else None
    if isinstance(saved, dict):  # the config the step was written with, recorded in it
        (model_cfg, _, tokenizer), digest = _model_config_of(split_recorded(saved)[0]), None
        where = f"{source}/trainer_state.json"
    elif role == "actor":
        model_cfg, digest, where, tokenizer = _run_model_config(loc.run, config_path, output_dir)
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
    if model_cfg is not None:
        config_files.update(_tokenizer_files(tokenizer, where))
    try:  # the user's folder: one that cannot be created is bad input (exit 2), named with the reason
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out_dir!r}: cannot create the folder: {exc}") from exc
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
