"""The run's configuration: typed sections, loading with overrides, validation, path resolution.

A foundation package: workers, checkpoints and the trainer import it; it imports none of them.
:func:`load_config` reads a YAML file plus ``key=value`` overrides into a validated :class:`Config`.
The exports load on first use (:mod:`resilient_rl.lazy`): the secret redactor
(:mod:`~resilient_rl.config.secrets`), which every command's console uses, needs neither OmegaConf
nor fsspec.
"""

from resilient_rl.lazy import lazy_exports

_EXPORTS = {"resilient_rl.config.schema": ("Config", "config_digest", "config_from_dict", "load_config")}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["Config", "config_digest", "config_from_dict", "load_config"]
