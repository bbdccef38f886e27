"""Verifying a committed step against its manifest: sizes always, every file's sha256 when deep.

A deep verification reads every byte of a checkpoint, so its result is remembered by step folder
and manifest hash: a recovery that looks at the same checkpoint again does not re-hash it (a
changed manifest is a different key, and is verified again). The files are hashed a few at a time
(:mod:`~resilient_rl.checkpoint.fanout`): on an object store each read is a round trip, and a step
of hundreds of shards read one after the other took minutes; the verdict is the sequential one
(the first file in manifest order that differs or cannot be read).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Mapping

from resilient_rl.checkpoint.fanout import iter_ordered
from resilient_rl.checkpoint.hashing import Sha256Pipe
from resilient_rl.checkpoint.manifest import FileRecord, Manifest
from resilient_rl.checkpoint.storage import Storage

_HASH_CHUNK = 8 * 1024 * 1024
#: Files hashed at once; each holds at most three chunks (read, hashing, waiting): 192 MiB in all.
HASH_WORKERS = 8


class Verifier:
    """Checks step folders of one storage against their manifests; remembers deep successes."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._verified: set[tuple[str, str]] = set()  # (step folder, manifest sha256) that hashed clean

    def sha256(self, path: str, size: int) -> str:
        """The sha256 of the first ``size`` bytes of ``path``, read in chunks."""
        with Sha256Pipe(max_pending=1) as digest:  # hashing a chunk overlaps reading the next
            for start in range(0, size, _HASH_CHUNK):
                digest.update(memoryview(self.storage.read_bytes(path, start, min(size, start + _HASH_CHUNK))))
            return digest.hexdigest()

    def check(self, rel: str, manifest: Manifest, present: Mapping[str, int], deep: bool) -> str:
        """``"ok"`` or ``"corrupt: <file>: <why>"`` for the step folder ``rel`` holding ``present``
        (path -> size) against ``manifest``."""
        for rec in manifest.files:
            if rec.path not in present:
                return f"corrupt: {rec.path}: missing"
            if present[rec.path] != rec.size:
                return f"corrupt: {rec.path}: size {present[rec.path]} != {rec.size} in the manifest"
        key = (rel, hashlib.sha256(manifest.to_bytes()).hexdigest())
        if deep and key not in self._verified:
            def matches(rec: FileRecord) -> bool:
                return self.sha256(Storage.join(rel, rec.path), rec.size) == rec.sha256
            with contextlib.closing(iter_ordered(matches, manifest.files, HASH_WORKERS)) as verdicts:
                for rec, ok in zip(manifest.files, verdicts):
                    if not ok:
                        return f"corrupt: {rec.path}: sha256 mismatch"
            self._verified.add(key)
        return "ok"
