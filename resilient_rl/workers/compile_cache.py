"""The compiler's work kept for the run: a process that starts on any node reuses the compiled
decode step instead of compiling it again.

``torch.compile`` keeps what inductor produced (its graphs, AOT autograd's, and on a GPU the
Triton kernels) in a cache on the local disk, so a process restarted on the same node finds it
there. A process on another node does not: a warm spare adopted there, every process after a
node loss, and every process of a run resumed on new nodes compile again (49.6 s for the
decode step of Qwen2.5-0.5B on an H200 host, where a step takes 3.4 ms).

So once a rollout process has compiled, its rank 0 writes two files per torch version and device
to the run's checkpoint folder, ``<checkpoint.root>/<run_name>/compile_cache/``, and a process
loads both before its first generation:

- ``<tag>.decode-<model key>.bin``: the decode step traced and compiled, with its guards
  (:mod:`resilient_rl.models.decode_kept`). A process that loads it neither traces nor compiles
  the step: on a 2-core CPU the first generation of 8 layers, loading included, took 3.5 s on the
  same node and 19.4 s on another (where the CPU compiles inductor's C++ again from the kept
  source; a GPU's Triton kernels are kept compiled) against 38.8 s with nothing kept
  (``python bench/compile_cache.py --layers 8``). The writer keeps a copy in its node's inductor
  cache folder as well, so a new run of the same model on that node loads it from there.
- ``<tag>.bin``: the compiler's artifacts (``torch.compiler.save_cache_artifacts``, loaded with
  ``load_cache_artifacts``), for a step that could not be kept: the compiler then traces it again
  but takes the compiled code from the cache.

A file that does not match this torch, device or model is not read (the name says which) or
is loaded and then simply not hit: the compiler's own keys and guards decide.

Everything here is best effort: an unreadable or unwritable cache folder costs a compile, never a
step (a warning says why).
"""

from __future__ import annotations

import logging
import os
import re

import torch

from resilient_rl.checkpoint.storage import Storage
from resilient_rl.models.decode_kept import load_kept, save_kept, step_key
from resilient_rl.models.decode_step import decode

__all__ = ["CompileCache"]

log = logging.getLogger(__name__)

#: Whether this process has already loaded (or looked for) the artifacts, and published them.
_PROCESS = {"adopted": False, "published": 0, "kept_adopted": set(), "kept_published": {}}


def device_tag(device: torch.device | str) -> str:
    """The torch version and the device kind that compiled code is valid for, as a file name."""
    device = torch.device(device)
    kind = "cpu"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        kind = f"{props.name}-sm{props.major}{props.minor}"
    elif device.type != "cpu":
        kind = device.type
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", f"torch-{torch.__version__}-{kind}")


class CompileCache:
    """The run's folder of compiler artifacts on the checkpoint storage (see the module docstring)."""

    FOLDER = "compile_cache"

    def __init__(self, root: str, run_name: str, storage_options: dict | None = None, node_root: str | None = None):
        """``node_root``: this node's folder for a copy of the kept decode steps (None: a folder in
        inductor's local cache, ``TORCHINDUCTOR_CACHE_DIR``)."""
        self.root, self.run_name, self.storage_options = root, run_name, storage_options
        self.node_root = node_root
        self._storage: Storage | None = None
        self._node: Storage | None = None

    @property
    def storage(self) -> Storage:
        """The checkpoint storage, opened at first use (a process that never compiles never does)."""
        if self._storage is None:
            self._storage = Storage(self.root, self.storage_options)
        return self._storage

    @property
    def node(self) -> Storage:
        """This node's copy of the kept decode steps: a new run of the same model on this node
        loads them even before its run folder has any."""
        if self._node is None:
            if self.node_root is None:
                from torch._inductor.runtime.cache_dir_utils import cache_dir

                self.node_root = os.path.join(cache_dir(), "resilient_rl")
            self._node = Storage(self.node_root)
        return self._node

    def path(self, device) -> str:
        return Storage.join(self.run_name, self.FOLDER, f"{device_tag(device)}.bin")

    def steps_path(self, device, key: str) -> str:
        """The file of the traced decode steps kept for the model ``key`` (:mod:`~resilient_rl.models.decode_kept`)."""
        return Storage.join(self.run_name, self.FOLDER, _steps_name(device, key))

    def adopt(self, device, model: torch.nn.Module | None = None) -> int:
        """Load the run's artifacts into this process's compile cache, once per process and before
        its first compile, and the decode steps traced for ``model`` (None: none); the bytes
        loaded (0: none there, or already done)."""
        loaded = 0
        if not _PROCESS["adopted"]:
            _PROCESS["adopted"] = True
            loaded += self._read(self.storage, self.path(device), "compiled code", _load_artifacts)
        key = None if model is None else step_key(model)
        if key is not None and key not in _PROCESS["kept_adopted"]:
            _PROCESS["kept_adopted"].add(key)
            for storage, path in self._steps_files(device, key):  # the first that loads
                kept = self._read(storage, path, "traced decode steps", lambda data: load_kept(data, key, decode))
                if kept:
                    loaded += kept
                    break
        return loaded

    def _steps_files(self, device, key: str) -> list[tuple[Storage, str]]:
        """Where the decode steps kept for ``key`` are: the run's folder, then this node's copy."""
        return [(self.storage, self.steps_path(device, key)), (self.node, _steps_name(device, key))]

    @staticmethod
    def _read(storage: Storage, path: str, what: str, load) -> int:
        """Read ``path`` and hand it to ``load``; its size (0: absent, or it could not be loaded)."""
        try:
            if not storage.exists(path):
                return 0
            data = storage.read_bytes(path)
            load(data)
        except Exception as exc:  # noqa: BLE001 -- a cache: without it the step compiles
            log.warning("compile cache: could not load %s (%s: %s); compiling from scratch",
                        storage.url_for(path), type(exc).__name__, exc)
            return 0
        log.info("compile cache: loaded %.1f MiB of %s from %s", len(data) / 2**20, what, storage.url_for(path))
        return len(data)

    def publish(self, device, model: torch.nn.Module | None = None) -> int:
        """Write what this process compiled (or found cached) for the run's other processes, and
        the decode steps it holds for ``model`` (None: none), also to this node's copy; the bytes
        written to the run's folder (0: nothing new since this process last wrote)."""
        written = 0
        data, amount = _saved("the compiler's artifacts", _save_artifacts)
        if amount > _PROCESS["published"] and self._write(self.storage, self.path(device), data):
            _PROCESS["published"] = amount
            written += len(data)
        key = None if model is None else step_key(model)
        data, amount = _saved("the traced decode steps", lambda: save_kept(key)) if key else (b"", 0)
        if amount > _PROCESS["kept_published"].get(key, 0):
            for storage, path in self._steps_files(device, key):
                if self._write(storage, path, data) and storage is self.storage:
                    _PROCESS["kept_published"][key] = amount
                    written += len(data)
        return written

    @staticmethod
    def _write(storage: Storage, path: str, data: bytes) -> bool:
        """Write ``data`` to ``path`` whole or not at all; whether it was written."""
        try:
            storage.write_bytes_atomic(path, data)
        except Exception as exc:  # noqa: BLE001 -- a cache: the run goes on without it
            log.warning("compile cache: could not write %s (%s: %s)", storage.url_for(path), type(exc).__name__, exc)
            return False
        return True


def _saved(what: str, save) -> tuple[bytes, int]:
    """What ``save`` returns (bytes, and how much they hold); nothing where it raises."""
    try:
        return save()
    except Exception as exc:  # noqa: BLE001 -- a cache: the run goes on without it
        log.warning("compile cache: could not save %s (%s: %s)", what, type(exc).__name__, exc)
        return b"", 0


def _steps_name(device, key: str) -> str:
    """The name of the file of the decode steps kept for the model ``key``, in the run's folder and the node's."""
    return f"{device_tag(device)}.decode-{key[:16]}.bin"


def _load_artifacts(data: bytes) -> None:
    if torch.compiler.load_cache_artifacts(data) is None:  # torch logged why (a torn file)
        raise ValueError("torch loaded no artifacts from it")


def _save_artifacts() -> tuple[bytes, int]:
    saved = torch.compiler.save_cache_artifacts()
    return (saved[0], len(saved[0])) if saved else (b"", 0)
