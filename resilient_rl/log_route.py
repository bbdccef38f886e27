"""Which log lines reach the console.

Every line goes to the run's ``train.log`` (:mod:`resilient_rl.run.log`). The console carries
what a user acts on: the periodic summary, warnings and errors, and how the run ended. Routine
bookkeeping that repeats through a long run (a lease taken or given back, a checkpoint committed,
an old one deleted by retention) is logged with ``extra=FILE_ONLY``: it stays in ``train.log``
(and in ``events.jsonl``) and off the console. Kept here, below every layer, so that the modules
that log such lines (``checkpoint/``, ``telemetry/``) need nothing from the run layer.
"""

from __future__ import annotations

import logging

#: ``logger.info(..., extra=FILE_ONLY)``: this line goes to ``train.log`` only.
FILE_ONLY = {"rrl_file_only": True}


class ConsoleFilter(logging.Filter):
    """Drops the lines marked :data:`FILE_ONLY` below WARNING (a warning always shows)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not getattr(record, "rrl_file_only", False)
