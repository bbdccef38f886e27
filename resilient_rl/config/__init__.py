"""The run's configuration: typed sections, loading with overrides, validation, path resolution.

A foundation package: workers, checkpoints and the trainer import it; it imports none of them.
:func:`load_config` reads a YAML file plus ``key=value`` overrides into a validated :class:`Config`.
"""

from resilient_rl.config.schema import Config, config_digest, config_from_dict, load_config

__all__ = ["Config", "config_digest", "config_from_dict", "load_config"]
