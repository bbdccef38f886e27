"""No class of the package has more than 30 methods, counting those it inherits from the
package's own classes: a role worker composes parts (runtime/parts.py) instead of stacking
mixins. ``DataProto`` is the one exception: it mirrors verl's public surface."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import resilient_rl

MOST = 30
MIRRORS_VERL = {"resilient_rl.protocol.DataProto"}


def _methods(cls: type) -> set[str]:
    """Every function, property, class and static method of ``cls`` and its package bases."""
    names = set()
    for base in cls.__mro__:
        if base.__module__.startswith("resilient_rl"):
            names |= {name for name, value in vars(base).items()
                      if isinstance(value, (types.FunctionType, property, classmethod, staticmethod))}
    return names


def test_no_class_has_more_than_30_methods_with_those_it_inherits():
    sizes, unimported = {}, []
    for module in pkgutil.walk_packages(resilient_rl.__path__, "resilient_rl."):
        try:
            loaded = importlib.import_module(module.name)
        except ImportError:  # an optional extra that is not installed
            unimported.append(module.name)
            continue
        for value in vars(loaded).values():
            cls = getattr(value, "__ray_actor_class__", value)  # the class behind a @ray.remote one
            if inspect.isclass(cls) and cls.__module__ == loaded.__name__:
                sizes[f"{cls.__module__}.{cls.__qualname__}"] = len(_methods(cls))
    assert len(sizes) > 200 and len(unimported) < 5, unimported
    assert "resilient_rl.workers.roles.ActorWorker" in sizes
    large = {name: n for name, n in sizes.items() if n > MOST and name not in MIRRORS_VERL}
    assert not large, large
