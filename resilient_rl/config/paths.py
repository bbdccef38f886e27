"""Paths to files shipped inside Python packages: ``pkg://<package>/<path inside it>``.

A config that names a shipped data file or tokenizer folder must work after ``pip install`` from
any working directory, so it cannot use a path relative to the repository. ``pkg://`` names a
file or folder inside an importable package (``pkg://resilient_rl/data/tiny_tokenizer``); every
other string (a plain path, an fsspec URL such as ``s3://...``) is returned unchanged.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os

from resilient_rl.errors import ConfigError

PKG_SCHEME = "pkg://"


def resolve_path(path: str, key: str = "path") -> str:
    """``path`` with a ``pkg://package/sub/path`` prefix turned into a filesystem path.

    ``package`` may be dotted (``pkg://my_pkg.assets/file.jsonl``). ``key`` is the config key the
    path came from; errors name it. A plain path has ``~`` expanded; the file need not exist yet.
    """
    if not path.startswith(PKG_SCHEME):
        return os.path.expanduser(path) if "://" not in path else path
    package, _, sub = path[len(PKG_SCHEME):].partition("/")
    if not package or not sub:
        raise ConfigError(f"{key}={path!r}: a package path has the form 'pkg://<package>/<path inside it>'")
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"{key}={path!r}: package {package!r} is not importable")
    return str(importlib.resources.files(package).joinpath(*sub.split("/")))
