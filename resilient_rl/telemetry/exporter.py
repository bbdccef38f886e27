"""The Prometheus exporter: an HTTP endpoint serving one registry, plus a scrape helper.

:class:`MetricsServer` wraps ``prometheus_client.start_http_server`` so that it serves a
private registry, can be stopped (tests and restarts start several in one process), resolves
port 0 to the port the OS picked, and reports a port in use as a :class:`TelemetryError` that
names the address. With ``enabled=False`` every method is a no-op, so callers need no branches.
"""

from __future__ import annotations

import errno
import logging
import threading
import urllib.request
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from resilient_rl.errors import TelemetryError

logger = logging.getLogger(__name__)


def _host_for_url(address: str) -> str:
    # Listening on every interface: a client reaches it through loopback.
    if address in ("", "0.0.0.0"):
        return "127.0.0.1"
    if address == "::":
        return "[::1]"
    return f"[{address}]" if ":" in address else address


class MetricsServer:
    """Serves ``registry`` at ``http://{bind_address}:{port}/metrics`` from a daemon thread.

    Args:
        registry: the registry to expose.
        bind_address: interface to listen on; ``0.0.0.0`` for scrapes from other hosts.
        port: TCP port; 0 lets the OS pick a free one (read it back from ``.port``).
        enabled: False makes the server a no-op (``port`` and ``url`` stay None).
    """

    def __init__(self, registry: CollectorRegistry, bind_address: str = "127.0.0.1",
                 port: int = 0, enabled: bool = True) -> None:
        if not 0 <= port <= 65535:
            raise TelemetryError(f"metrics port must be in [0, 65535], got {port}")
        self.registry = registry
        self.bind_address = bind_address
        self.requested_port = port
        self.enabled = enabled
        self.port: int | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str | None:
        """The metrics URL once started, else None."""
        if self.port is None:
            return None
        return f"http://{_host_for_url(self.bind_address)}:{self.port}/metrics"

    @property
    def target(self) -> str | None:
        """``host:port`` as Prometheus scrapes it (for a file_sd targets file), else None."""
        if self.port is None:
            return None
        return f"{_host_for_url(self.bind_address)}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> "MetricsServer":
        """Start serving; idempotent.

        Raises:
            TelemetryError: the address cannot be bound (port in use, unknown address).
        """
        if not self.enabled or self._server is not None:
            return self
        try:
            server, thread = start_http_server(self.requested_port, addr=self.bind_address,
                                               registry=self.registry)
        except OSError as exc:
            where = f"{self.bind_address}:{self.requested_port}"
            if exc.errno == errno.EADDRINUSE:
                raise TelemetryError(f"cannot start the metrics exporter on {where}: port "
                                     f"{self.requested_port} is already in use") from exc
            raise TelemetryError(f"cannot start the metrics exporter on {where}: "
                                 f"{exc.strerror or exc}") from exc
        self._server, self._thread = server, thread
        self.port = int(server.server_port)
        logger.info("metrics exporter listening on %s", self.url)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and release the port; idempotent."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = self._thread = None
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout)
        self.port = None

    def __enter__(self) -> "MetricsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def scrape(url: str, timeout: float = 5.0) -> str:
    """GET a metrics endpoint and return the exposition text.

    Raises:
        TelemetryError: the endpoint cannot be reached or answers with an error.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode("utf-8")
    except OSError as exc:  # URLError and HTTPError are OSErrors
        raise TelemetryError(f"cannot scrape {url}: {exc}") from exc


def sample_values(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Parse exposition text into {(sample name, labels): value}, e.g. for assertions."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of sample ``name`` with exactly ``labels`` in exposition ``text``, or None."""
    return sample_values(text).get((name, frozenset((labels or {}).items())))
