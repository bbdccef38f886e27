"""Content digests of the files a config names, so that a resume tells a moved file from a changed one.

A run reads its prompts (``data.path``), its tokenizer folder (``data.tokenizer``) and verl's
reward file (``custom_reward_function.path``) by path. A path is where a file is, not what it
holds: a run moved to another cluster (another mount point) or a renamed data folder names the
same content by another path. So the config a checkpoint records
(:func:`resilient_rl.trainer.resume_check.checkpoint_config`) carries, under :data:`RECORD_KEY`,
the sha256 of what each of these keys named when the run started, and a resume whose path
differs is accepted when the content is the same (:mod:`resilient_rl.config.resume`).

A file is hashed as a stream (any size, any fsspec URL or ``pkg://`` path); a folder over its
files' relative names, sizes and contents in sorted order, leaving out what a tokenizer never
reads: hidden entries and model weights (a tokenizer folder is often the model's own folder,
whose weights would cost seconds per start to hash). A value that is no local path (a tokenizer
named by its hub name) or cannot be read gets no digest, and is compared by its name. Each
content is hashed once per process while its files are unchanged (size and modification time).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any, Mapping

from resilient_rl.config.paths import resolve_path

logger = logging.getLogger(__name__)

#: The config keys whose value names a file or folder the run reads, compared by content on resume
#: (``data.val_path`` may change on resume whatever it holds; ``data.reward_fn`` is an import path).
FILE_KEYS: tuple[str, ...] = ("data.path", "data.tokenizer", "custom_reward_function.path")

#: The entry of a recorded config (not a config section) holding ``{key: sha256 hex}`` of :data:`FILE_KEYS`.
RECORD_KEY = "file_sha256"

#: Files a tokenizer folder may hold that no tokenizer reads: the model's weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")

_CHUNK = 1 << 20
#: (resolved path, signature of its files) -> sha256 hex: a second start-up call (the resume check
#: after the trainer recorded its config) costs a stat, not a read.
_cache: dict[tuple[str, tuple], str] = {}


def _value(config: Mapping[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def _included(name: str) -> bool:
    return not name.startswith(".") and not name.lower().endswith(WEIGHT_SUFFIXES)


def _folder_files(root: str) -> list[tuple[str, os.stat_result]]:
    """(relative name with ``/``, stat) of the files under ``root`` a digest covers, sorted by name."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if _included(name):
                full = os.path.join(folder, name)
                found.append((os.path.relpath(full, root).replace(os.sep, "/"), os.stat(full)))
    return sorted(found, key=lambda item: item[0])


def _signature(st: os.stat_result) -> tuple:
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


def _hash_file(path: str, h) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)


def _local_digest(local: str) -> tuple[str, int]:
    """(sha256 hex, bytes read) of the local file or folder ``local``."""
    if not os.path.isdir(local):
        key = (local, _signature(os.stat(local)))
        if key not in _cache:
            h = hashlib.sha256()
            _hash_file(local, h)
            _cache[key] = h.hexdigest()
            return _cache[key], key[1][0]
        return _cache[key], 0
    files = _folder_files(local)
    key = (local, tuple((rel, _signature(st)) for rel, st in files))
    if key in _cache:
        return _cache[key], 0
    h = hashlib.sha256()
    h.update(b"rrl-folder-v1\0")
    for rel, st in files:
        # The name and the size frame each file's bytes: no two different folders hash alike.
        h.update(rel.encode("utf-8") + b"\0" + st.st_size.to_bytes(8, "little"))
        _hash_file(os.path.join(local, rel), h)
    _cache[key] = h.hexdigest()
    return _cache[key], sum(st.st_size for _, st in files)


def _remote_digest(url: str) -> tuple[str, int]:
    """(sha256 hex, bytes read) of the file at the fsspec URL ``url``."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    info = fs.info(path)
    key = (url, tuple(sorted((k, repr(v)) for k, v in info.items())))
    if key in _cache:
        return _cache[key], 0
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    _cache[key] = h.hexdigest()
    return _cache[key], int(info.get("size") or 0)


def content_digest(value: str, key: str) -> str | None:
    """The sha256 hex of what config ``key``'s ``value`` names (a file, a folder, a ``pkg://``
    path or an fsspec URL); None when it names nothing that can be read (a hub name)."""
    try:
        where = resolve_path(value, key)
        remote = "://" in where
        if not remote and not os.path.exists(where):
            return None
        t0 = time.perf_counter()
        digest, size = _remote_digest(where) if remote else _local_digest(where)
    except Exception as exc:  # unreadable: the key is compared by its value, as without a digest
        logger.debug("no content digest of %s=%r: %s", key, value, exc)
        return None
    elapsed = time.perf_counter() - t0
    if size:
        (logger.info if elapsed > 1.0 else logger.debug)(
            "content digest of %s=%r: %.1f MB in %.2f s", key, value, size / 1e6, elapsed)
    return digest


def file_digests(config: Mapping[str, Any]) -> dict[str, str]:
    """``{key: sha256 hex}`` of the :data:`FILE_KEYS` that ``config`` (as plain data) sets and that
    name something readable."""
    out = {}
    for key in FILE_KEYS:
        value = _value(config, key)
        if isinstance(value, str) and value:
            digest = content_digest(value, key)
            if digest is not None:
                out[key] = digest
    return out


def with_file_digests(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as a checkpoint records it: with :data:`RECORD_KEY` holding :func:`file_digests`."""
    return {**config, RECORD_KEY: file_digests(config)}


def split_recorded(recorded: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str] | None]:
    """(the config, its file digests) of a recorded config; the digests are None where it was
    recorded before they were (and for a run folder's ``config.yaml``)."""
    config = dict(recorded)
    digests = config.pop(RECORD_KEY, None)
    return config, (dict(digests) if isinstance(digests, Mapping) else None)
