"""The compiler's work kept for the run: a process that starts on any node reuses the compiled
decode step instead of compiling it again.

``torch.compile`` keeps what inductor produced (its graphs, AOT autograd's, and on a GPU the
Triton kernels) in a cache on the local disk, so a process restarted on the same node finds it
there. A process on another node does not: a warm spare adopted there, every process after a
node loss, and every process of a run resumed on new nodes compile again (49.6 s for the
decode step of Qwen2.5-0.5B on an H200 host, where a step takes 3.4 ms).

So once a rollout process has compiled, its rank 0 writes the compiler's artifacts
(``torch.compiler.save_cache_artifacts``: everything compiled or found in the cache by this
process) to one file per torch version and device in the run's checkpoint folder,
``<checkpoint.root>/<run_name>/compile_cache/``, and a process about to compile for the first
time loads that file into its local cache first (``torch.compiler.load_cache_artifacts``). The
compiler still traces the step (guards are not kept) but takes the compiled code from the cache:
on a 2-core CPU the first generation of 8 layers took 25.6 s with the artifacts against 42.6 s
without and 8.6 s with the node's own cache warm (``python bench/compile_cache.py --layers 8``;
on a CPU inductor's C++ is compiled again from the kept source, a GPU's kernels are kept
compiled). A file that does not match this torch, device or model is
loaded and then simply not hit: the compiler's own cache keys decide.

Everything here is best effort: an unreadable or unwritable cache folder costs a compile, never a
step (a warning says why).
"""

from __future__ import annotations

import logging
import re

import torch

from resilient_rl.checkpoint.storage import Storage

__all__ = ["CompileCache"]

log = logging.getLogger(__name__)

#: Whether this process has already loaded (or looked for) the artifacts, and published them.
_PROCESS = {"adopted": False, "published": 0}


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

    def __init__(self, root: str, run_name: str, storage_options: dict | None = None):
        self.root, self.run_name, self.storage_options = root, run_name, storage_options
        self._storage: Storage | None = None

    @property
    def storage(self) -> Storage:
        """The checkpoint storage, opened at first use (a process that never compiles never does)."""
        if self._storage is None:
            self._storage = Storage(self.root, self.storage_options)
        return self._storage

    def path(self, device) -> str:
        return Storage.join(self.run_name, self.FOLDER, f"{device_tag(device)}.bin")

    def adopt(self, device) -> int:
        """Load the run's artifacts into this process's compile cache, once per process and before
        its first compile; the bytes loaded (0: none there, or already done)."""
        if _PROCESS["adopted"]:
            return 0
        _PROCESS["adopted"] = True
        path = self.path(device)
        try:
            if not self.storage.exists(path):
                return 0
            data = self.storage.read_bytes(path)
            if torch.compiler.load_cache_artifacts(data) is None:  # torch logged why (a torn file)
                raise ValueError("torch loaded no artifacts from it")
        except Exception as exc:  # noqa: BLE001 -- a cache: without it the step compiles
            log.warning("compile cache: could not load %s (%s: %s); compiling from scratch",
                        self.storage.url_for(path), type(exc).__name__, exc)
            return 0
        log.info("compile cache: loaded %.1f MiB of compiled code from %s", len(data) / 2**20,
                 self.storage.url_for(path))
        return len(data)

    def publish(self, device) -> int:
        """Write what this process compiled (or found cached) for the run's other processes;
        the bytes written (0: nothing new since this process last wrote)."""
        try:
            saved = torch.compiler.save_cache_artifacts()
            if not saved or len(saved[0]) <= _PROCESS["published"]:
                return 0
            data = saved[0]
            self.storage.write_bytes_atomic(self.path(device), data)
        except Exception as exc:  # noqa: BLE001 -- a cache: the run goes on without it
            log.warning("compile cache: could not write %s (%s: %s)", self.storage.url_for(self.path(device)),
                        type(exc).__name__, exc)
            return 0
        _PROCESS["published"] = len(data)
        return len(data)

