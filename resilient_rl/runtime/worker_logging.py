"""A rank process's own log records, forwarded to the driver.

Ray configures no root handler in its worker processes, and Python's fallback prints warnings only,
as bare messages: a rank's INFO records (the generation it joined, the packed-attention kernel it
chose, compiled code it loaded from the run's cache) were lost. :func:`forward_package_logs` gives
the package's logger two handlers in each rank process: records below WARNING to stdout, the
others to stderr, each with its level and logger name and at ``RRL_LOG_LEVEL`` (INFO by default).
Ray forwards both streams to the driver, which writes them to the run's ``train.log``
(:mod:`resilient_rl.runtime.worker_output`) and keeps them off the console.
"""

from __future__ import annotations

import logging
import sys

from resilient_rl import env

#: The logger every module of the package logs under.
PACKAGE = "resilient_rl"
#: The driver stamps each forwarded line with its time: the process writes level, logger and message.
FORMAT = "%(levelname)s %(name)s: %(message)s"


class _Forward(logging.StreamHandler):
    """One of the two handlers :func:`forward_package_logs` adds."""


def _below_warning(record: logging.LogRecord) -> bool:
    return record.levelno < logging.WARNING


def forward_package_logs() -> bool:
    """Write the package's log records to this process's stdout (below WARNING) and stderr, once
    per process; whether it did. A process whose logging is configured already (the driver, a test
    run: the root logger has handlers) is left as it is."""
    package = logging.getLogger(PACKAGE)
    if logging.getLogger().handlers or any(isinstance(h, _Forward) for h in package.handlers):
        return False
    formatter = logging.Formatter(FORMAT)
    info, warnings = _Forward(sys.stdout), _Forward(sys.stderr)
    info.addFilter(_below_warning)
    warnings.setLevel(logging.WARNING)
    for handler in (info, warnings):
        handler.setFormatter(formatter)
        package.addHandler(handler)
    package.setLevel(getattr(logging, env.log_level(), logging.INFO))
    return True
