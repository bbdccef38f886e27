"""verl's reward functions: ``compute_score(data_source, solution_str, ground_truth, extra_info)``.

``custom_reward_function.path`` names a Python file and ``custom_reward_function.name`` a function
in it (verl's keys and defaults). The file is loaded once, when the trainer reads its data, so a
missing file, a failing import or a missing function is a ConfigError before any worker starts.
Each response is scored by calling the function with keyword arguments, as verl's reward manager
does; it returns a number, or a mapping whose ``score`` is the reward (verl's form for rewards
that report more than the score).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from numbers import Real
from typing import Any, Optional

from resilient_rl.config.paths import resolve_path
from resilient_rl.data.rewards import user_traceback
from resilient_rl.errors import ConfigError, UserCodeError

KEY = "custom_reward_function"


class VerlScore:
    """The function ``name`` of the file ``path``, called as verl calls it; errors name both keys."""

    def __init__(self, path: str, name: str = "compute_score"):
        self.path, self.name = path, name
        where = f"{KEY}.path={path!r}"
        local = resolve_path(path, f"{KEY}.path")
        if not os.path.isfile(local):
            raise ConfigError(f"{where}: no such file (a Python file holding {name}(data_source, solution_str, "
                              "ground_truth, extra_info))")
        # A name of its own in sys.modules: the file's dataclasses and pickled objects resolve it.
        module_name = f"rrl_custom_reward_{abs(hash(os.path.abspath(local))):x}"
        spec = importlib.util.spec_from_file_location(module_name, local)
        if spec is None or spec.loader is None:
            raise ConfigError(f"{where}: not a Python file that can be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # the user's file fails as it is imported
            sys.modules.pop(module_name, None)
            raise ConfigError(f"{where}: importing it raised {type(e).__name__}: {e}\n{user_traceback(e)}") from e
        fn = getattr(module, name, None)
        if fn is None:
            found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                           and getattr(v, "__module__", None) == module_name)
            raise ConfigError(f"{KEY}.name={name!r}: {local} has no function {name!r} "
                              f"(its functions: {', '.join(found) or 'none'})")
        if not callable(fn):
            raise ConfigError(f"{KEY}.name={name!r} in {local} is not callable (got {type(fn).__name__})")
        self._fn = fn

    def __call__(self, solution_str: str, ground_truth: Any, data_source: Optional[str],
                 extra_info: Optional[dict]) -> float:
        """The score of ``solution_str``; an exception the function raises is the user's
        (UserCodeError with its traceback and the response it was scoring)."""
        try:
            value = self._fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                             extra_info=extra_info)
        except Exception as e:
            raise UserCodeError(f"{KEY}.name={self.name!r} in {self.path} raised {type(e).__name__}: {e} "
                                f"while scoring response {solution_str[:200]!r} against ground truth "
                                f"{str(ground_truth)[:200]!r} (data_source={data_source!r})\n"
                                f"{user_traceback(e)}") from e
        if isinstance(value, dict) and "score" in value:
            value = value["score"]
        if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
            value = value.item()  # a numpy scalar (np.bool_ too) or a 0-d tensor, as verl takes them
        if not isinstance(value, Real):  # bool and numpy numbers are Real
            raise ConfigError(f"{KEY}.name={self.name!r} in {self.path} returned {value!r:.200}, not a number "
                              "(or a mapping with a 'score')")
        return float(value)
