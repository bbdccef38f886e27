"""Package exports loaded on first use (PEP 562), so importing a package costs only what is used.

``import resilient_rl`` used to import the whole runtime (torch and Ray, seconds) for every
command, also ``resilient-rl status`` which reads a few JSON files. A package that re-exports
names from heavy submodules declares them in a table instead::

    __getattr__, __dir__ = lazy_exports(__name__, {
        "resilient_rl.runtime.dispatch": ("Dispatch", "register"),
    })

``from resilient_rl import Dispatch`` still works: the first access imports the submodule and
caches the name in the package, later ones are plain attribute reads.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def lazy_exports(package: str, table: Mapping[str, tuple[str, ...]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` for ``package`` exporting ``table``
    (submodule name -> the names it provides)."""
    where = {name: module for module, names in table.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:  # also how ``from package import submodule`` falls back to the import system
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
