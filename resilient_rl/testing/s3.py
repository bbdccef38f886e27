"""A local S3 endpoint for tests: a ``moto_server`` subprocess on loopback.

::

    with MotoServer.start() as server:
        server.create_bucket("ckpt")
        storage = Storage("s3://ckpt/run", server.storage_options)

The server listens on 127.0.0.1 and a free port, and is stopped by its own pid (never by
name). :class:`MotoUnavailable` is raised when it cannot start (moto not installed, the port
never opens), so a test can skip with that reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from resilient_rl.runtime.master_env import free_port


class MotoUnavailable(RuntimeError):
    """The moto S3 server could not be started here."""


@dataclass
class MotoServer:
    """A running ``moto_server`` process and how to reach it."""

    process: subprocess.Popen
    endpoint_url: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, timeout_s: float = 30.0, host: str = "127.0.0.1") -> "MotoServer":
        """Start a server on ``host`` and a free port; wait until it answers HTTP."""
        exe = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
        if not os.path.exists(exe):
            raise MotoUnavailable("moto_server is not installed (pip install 'moto[server]')")
        port = free_port(host)
        endpoint = f"http://{host}:{port}"
        # Its log (a line per request) goes to a file: a pipe nobody reads fills after some
        # thousand requests, and the server then blocks on its next line, answering no request.
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen([exe, "-H", host, "-p", str(port)], stdout=subprocess.DEVNULL,
                                    stderr=log, start_new_session=True)
            deadline = time.monotonic() + timeout_s
            up = _wait_up(proc, endpoint, deadline, log)
        if not up:
            _stop(proc)
            raise MotoUnavailable(f"moto_server did not answer on {endpoint} within {timeout_s}s")
        options = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                   "client_kwargs": {"endpoint_url": endpoint}}
        return cls(proc, endpoint, options)

    @property
    def pid(self) -> int:
        return self.process.pid

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (idempotent)."""
        import s3fs

        fs = s3fs.S3FileSystem(**self.storage_options)
        with contextlib.suppress(FileExistsError):
            fs.mkdir(name)

    def stop(self) -> None:
        """Stop the server (by its pid) and reap it."""
        _stop(self.process)

    def __enter__(self) -> "MotoServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_up(proc: subprocess.Popen, endpoint: str, deadline: float, log) -> bool:
    """Whether the server answers HTTP before ``deadline``; MotoUnavailable with the end of its
    ``log`` when it exits first."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            err = log.read().decode(errors="replace")[-500:]
            raise MotoUnavailable(f"moto_server exited with code {proc.returncode}: {err}")
        try:
            with urllib.request.urlopen(endpoint, timeout=1.0):
                return True
        except urllib.error.HTTPError:
            return True  # any HTTP answer means it is up
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    if proc.stderr:
        proc.stderr.close()
