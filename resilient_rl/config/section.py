"""What every config section shares: the :class:`Section` base, which type-checks its fields and
then runs its own ``validate``, and the helpers a ``validate`` raises through (:func:`require`,
:func:`choice`: a :class:`ConfigFieldError` naming the field).

A section does not know where it sits in the tree, so its errors name the field relative to the
section (``OptimConfig.lr``); :func:`resilient_rl.config.schema.load_config` turns that into the
full dotted key (``actor.optim.lr``).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import typing
from typing import Any, Dict, List, Optional, Sequence

from resilient_rl.errors import ConfigError


class ConfigFieldError(ConfigError):
    """A config value is out of range or not allowed; ``key`` is dotted, relative to ``owner``."""

    def __init__(self, key: str, value: Any, allowed: str, owner: Optional[type] = None):
        self.key, self.value, self.allowed, self.owner = key, value, allowed, owner
        where = f"{owner.__name__}.{key}" if owner is not None else key
        super().__init__(f"invalid config value {where}={value!r}: {allowed}")


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigFieldError(key, value, allowed)


def choice(key: str, value: Any, options: Sequence[str]) -> None:
    require(value in options, key, value, "allowed values are " + ", ".join(repr(o) for o in options))


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in inner) + (" or null" if type(None) in args else "")
    if origin in (list, List):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin in (dict, Dict):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check ``value`` against annotation ``tp``; return (ok, value with ints widened to float)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True, value
    if origin is typing.Union:
        if value is None:
            return type(None) in args, value
        for option in (a for a in args if a is not type(None)):  # the first that takes it
            ok, coerced = _coerce(value, option)
            if ok:
                return True, coerced
        return False, value
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            return False, value
        items = [_coerce(v, args[0] if args else Any) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin in (dict, Dict):
        return isinstance(value, dict), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            return ok, float(value) if ok else value
        except OverflowError:  # an int too large for a float
            return False, value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, tp), value


#: The longest duration (seconds) a ``*_s`` field may hold: what ``threading`` and Ray can wait on.
MAX_SECONDS = float(threading.TIMEOUT_MAX)


def _check_finite(key: str, value: Any) -> None:
    """Reject nan and +-inf in a float field (or a list of floats): every ``> 0`` check lets
    inf through, and it overflows timeouts or turns a loss into NaN at once. Durations
    (``*_s``) must also be waitable."""
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, float):
            require(math.isfinite(v), key, value, "must be a finite number (not nan or inf)")
            require(not key.endswith("_s") or v <= MAX_SECONDS, key, value,
                     f"must be <= {MAX_SECONDS:.0f} seconds")


class Section:
    """Base of every config section: type-checks its fields, then runs :meth:`validate`."""

    _root = False  # True for Config, whose errors already carry full dotted keys

    def __post_init__(self) -> None:
        try:
            hints = typing.get_type_hints(type(self))
            for f in dataclasses.fields(self):  # type: ignore[arg-type]
                ok, value = _coerce(getattr(self, f.name), hints[f.name])
                require(ok, f.name, getattr(self, f.name), f"expected {type_name(hints[f.name])}")
                _check_finite(f.name, value)
                setattr(self, f.name, value)
            self.validate()
        except ConfigFieldError as e:
            if e.owner is not None or self._root:
                raise
            # Sections are built bottom-up and do not know where they sit; load_config adds the path.
            raise ConfigFieldError(e.key, e.value, e.allowed, type(self)) from None

    def validate(self) -> None:
        """Check ranges and allowed values; raise ConfigFieldError naming the field."""
