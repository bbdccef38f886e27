"""The decode step traced once and kept: a new process loads it instead of tracing it again.

``torch.compile`` traces the step in every new process, even when a compile cache holds every
kernel. On a 2-core CPU that tracing was 4.8 s of the 8.2 s a restarted process took for 8 layers,
and a recovered rollout pays it before its retried step. So the step is compiled ahead of time
(``torch.compile(...).aot_compile``): the result is a function with its guards that can be
written to bytes (:func:`save_kept`) and loaded by another process (:func:`load_kept`), which
then runs the step without tracing it. One version serves every batch bucket and span of cache
columns (the batch and the columns are symbols, as in
:class:`~resilient_rl.models.decode_step.DecodeStep`); a call that no kept version accepts (a
single row, greedy decoding, another ``top_p``) compiles one more version.

What the kept guards check: the tensors (shapes, strides, dtypes, devices), the values the step
specialised on (greedy or not, ``top_p``) and the global state (grad mode, autocast). Guards on
object identity (the model object, functions, modules' globals) cannot be written down; what they
would check is folded into :func:`step_key` instead, which names the file: the model's class and
configuration, the source of this package, and the torch and transformers versions. Guards on the
numbers of module hooks are dropped as well: a counter of the process hands them out. The model
itself is an argument of every call (its parameters are inputs of the graph, not constants), so a
kept version runs whatever weights the model holds now.
"""

from __future__ import annotations

import functools
import hashlib
import io
import pickle
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["KEPT_LIMIT", "KeptSteps", "kept_steps", "load_kept", "portable_guards", "save_kept", "step_key",
           "unkeepable"]

#: Versions of the step one process keeps for one model, at most (as the compiler's recompile limit).
KEPT_LIMIT = 16

_SOURCE: list[str] = []
_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_KEPT: dict[tuple[str, str | None], KeptSteps] = {}


def _source_digest() -> str:
    """sha256 of this package's source (the engine, the attention, the sampling), read once."""
    if not _SOURCE:
        h = hashlib.sha256()
        for path in sorted(Path(__file__).parent.glob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
        _SOURCE.append(h.hexdigest())
    return _SOURCE[0]


def step_key(model: torch.nn.Module) -> str:
    """What the guards a kept step cannot hold would check, as a hex digest: the model's class and
    configuration, the source of :mod:`resilient_rl.models`, and the torch and transformers versions."""
    if model not in _KEYS:
        try:
            import transformers

            hf_version = transformers.__version__
        except ImportError:  # pragma: no cover -- a dependency; without it only tiny models run
            hf_version = "none"
        cls = type(model)
        parts = [torch.__version__, hf_version, f"{cls.__module__}.{cls.__qualname__}",
                 repr(getattr(model, "config", None)), _source_digest()]
        _KEYS[model] = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return _KEYS[model]


#: The part of a guard's name that reads module hooks by their number.
_HOOK_NUMBERS = "_hooks_always_called"
#: The part of a guard's name that reads a function's closure.
_CLOSURE = ".__closure__"


def portable_guards(entries) -> list[bool]:
    """The guards a kept step holds (``guard_filter_fn``): all but those on globals and on object
    identity, which cannot be written down (:func:`step_key` stands for them), and those on the
    numbers of module hooks (``_forward_hooks_always_called``), which a counter of the process
    hands out: a process that registered other hooks first numbers the model's own otherwise.
    The count of each module's hooks stays guarded. Nor can a guard on the type of an object whose
    class is defined inside a function (transformers with ``kernels`` installed wraps functions such
    as ``apply_rotary_pos_emb`` in one): such a class has no name another process could find it by.
    Its other guards stay (whether ``kernelize`` replaced the wrapper's forward, for one)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (e.is_global or e.guard_type in unsupported or unsupported.intersection(e.derived_guard_types)
                 or _HOOK_NUMBERS in e.name or _CLOSURE in e.name or _local_type_match(e))
            for e in entries]


def _local_type_match(entry) -> bool:
    """Whether ``entry`` guards the type of an object whose class is not at a module's top level."""
    if not {entry.guard_type, *entry.derived_guard_types} & {"TYPE_MATCH", "BUILTIN_MATCH"}:
        return False
    cls = type(entry.value)
    return cls.__qualname__ != cls.__name__


def _mode_options(mode: str | None) -> dict:
    """Inductor's settings for ``mode`` (on a GPU "reduce-overhead": CUDA graphs)."""
    return dict(torch._inductor.list_mode_options(mode)) if mode else {}


class KeptSteps:
    """The versions of the decode step this process holds for one model key and compile mode,
    compiled here or loaded; a call runs the first whose guards accept its arguments."""

    def __init__(self, key: str, mode: str | None):
        self.key, self.mode = key, mode
        self.steps: list = []
        self._last = None

    def find(self, args: tuple):
        """The kept version that accepts ``args`` (None: none does)."""
        if self._last is not None and self._last.guard_check(*args):
            return self._last
        for fn in self.steps:
            if fn is not self._last and fn.guard_check(*args):
                self._last = fn
                return fn
        return None

    def compile(self, step: Callable, args: tuple, mark: Callable[[tuple], None]):
        """Compile one more version of ``step`` for ``args`` (``mark`` names their dynamic dimensions)."""
        if len(self.steps) >= KEPT_LIMIT:
            raise RuntimeError(f"the decode step has {len(self.steps)} compiled versions already "
                               f"(at most {KEPT_LIMIT}); another one was asked for")
        mark(args)
        options = {**_mode_options(self.mode), "guard_filter_fn": portable_guards}
        with _aot_enabled():
            fn = torch.compile(step, fullgraph=True, dynamic=None, options=options).aot_compile((args, {}))
        fn.disable_guard_check()  # find() checked them
        self.steps.append(fn)
        self._last = fn
        return fn

    def state(self) -> dict:
        """Every version held, for another process's :meth:`rebuild` (its parts are bytes)."""
        return {"mode": self.mode, "steps": [type(fn).serialize(fn).serialized_data for fn in self.steps]}

    def rebuild(self, state: dict, step: Callable) -> list:
        """The versions of ``step`` that ``state`` (from :meth:`state`) holds, rebuilt but not yet
        held (:meth:`add` holds them)."""
        # Inductor applies its settings (CUDA graphs) when it rebuilds the compiled code.
        with torch._inductor.config.patch(_mode_options(self.mode)), _aot_enabled():
            rebuilt = [torch.compiler.load_compiled_function(io.BytesIO(blob), f_globals=step.__globals__)
                       for blob in state["steps"]]
        for fn in rebuilt:
            fn.disable_guard_check()  # find() checks them
        return rebuilt

    def add(self, rebuilt: list) -> int:
        """Hold ``rebuilt`` versions, up to :data:`KEPT_LIMIT` in all; how many were added."""
        added = rebuilt[:max(0, KEPT_LIMIT - len(self.steps))]
        self.steps.extend(added)
        return len(added)


@functools.cache
def unkeepable() -> str | None:
    """Why this torch cannot keep the step (None: it can): it lacks the ahead-of-time compile or
    its loader (``torch.compiler.load_compiled_function``), or the switch that gives compiled
    functions their ``aot_compile`` (``torch._dynamo.config.enable_aot_compile``), as torch
    releases before them do."""
    import importlib.util

    if importlib.util.find_spec("torch._dynamo.aot_compile") is None or \
            not hasattr(torch.compiler, "load_compiled_function") or \
            not hasattr(torch._dynamo.config, "enable_aot_compile"):
        return f"torch {torch.__version__} has no ahead-of-time compile to keep the step with"
    return None


def _aot_enabled():
    """``torch.compile`` gives the function it returns an ``aot_compile`` only while
    ``torch._dynamo.config.enable_aot_compile`` is set: the default from torch 2.13 on; in torch
    2.11 (seen on an H200) the function had none."""
    return torch._dynamo.config.patch(enable_aot_compile=True)


def kept_steps(key: str, mode: str | None) -> KeptSteps:
    """This process's :class:`KeptSteps` for a model key and compile mode."""
    if (key, mode) not in _KEPT:
        _KEPT[(key, mode)] = KeptSteps(key, mode)
    return _KEPT[(key, mode)]


def save_kept(key: str) -> tuple[bytes, int]:
    """Every version of the step this process holds for the model ``key`` (compiled here or
    loaded, in every compile mode) as bytes for :func:`load_kept`, and how many versions."""
    held = [kept for (k, _), kept in _KEPT.items() if k == key and kept.steps]
    data = pickle.dumps({"key": key, "modes": [kept.state() for kept in held]})
    return data, sum(len(kept.steps) for kept in held)


def load_kept(data: bytes, key: str, step: Callable) -> int:
    """Load the versions of ``step`` that :func:`save_kept` wrote for the model ``key``; how many.
    Raises ValueError when ``data`` was kept for another model key."""
    kept = pickle.loads(data)
    if not isinstance(kept, dict) or kept.get("key") != key:
        found = str(kept.get("key"))[:16] if isinstance(kept, dict) else type(kept).__name__
        raise ValueError(f"kept for model key {found}, not {key[:16]}")
    # Every mode is rebuilt before any is held: a file that fails part way adds nothing, so the
    # next copy tried (the node's) does not add versions held already.
    held = [(kept_steps(key, state["mode"]), state) for state in kept["modes"]]
    rebuilt = [(steps, steps.rebuild(state, step)) for steps, state in held]
    return sum(steps.add(versions) for steps, versions in rebuilt)
