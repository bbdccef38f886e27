"""Killing whole process trees: the controller of a run, with the local Ray cluster it started."""

from __future__ import annotations

import signal

import psutil


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (those still alive)."""
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_tree(procs: list[psutil.Process], timeout_s: float = 20.0) -> list[int]:
    """SIGKILL every process of ``procs``; returns the pids still alive after ``timeout_s`` (should be none)."""
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p.pid for p in alive]
