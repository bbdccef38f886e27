"""The controller's checkpointed state: named stateful parts, registered once.

Each part has ``state_dict()`` / ``load_state_dict(state)``; the controller's part of a checkpoint
(``trainer_state.json``) is ``{name: part.state_dict()}``. Adding a part is one :meth:`register`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> None: ...


class Attribute:
    """A plain attribute of an object as a stateful part (e.g. the trainer's step counter)."""

    def __init__(self, owner: object, name: str, convert: Callable[[Any], Any] = lambda v: v):
        self.owner, self.name, self.convert = owner, name, convert

    def state_dict(self) -> Any:
        return getattr(self.owner, self.name)

    def load_state_dict(self, state: Any) -> None:
        setattr(self.owner, self.name, self.convert(state))


class ControllerState:
    """The registered parts; parts registered ``optional`` may be missing from older checkpoints."""

    def __init__(self) -> None:
        self._parts: dict[str, Stateful] = {}
        self._optional: set[str] = set()

    def register(self, name: str, part: Stateful, optional: bool = False) -> None:
        if name in self._parts:
            raise ValueError(f"controller state: part {name!r} is registered twice")
        self._parts[name] = part
        if optional:
            self._optional.add(name)

    def part(self, name: str) -> Stateful:
        """The part registered as ``name``."""
        return self._parts[name]

    def value(self, name: str) -> Any:
        """What part ``name`` holds now (its ``state_dict()``)."""
        return self._parts[name].state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self._parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load every part ``state`` has; a missing required part raises ``KeyError`` naming it."""
        missing = [n for n in self._parts if n not in state and n not in self._optional]
        if missing:
            raise KeyError(f"controller state has no {', '.join(missing)}")
        for name, part in self._parts.items():
            if name in state:
                part.load_state_dict(state[name])
