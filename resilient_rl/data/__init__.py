"""Prompts, tasks, rewards and tokenizers, plus the data shipped with the package.

A foundation package next to :mod:`resilient_rl.config`: the trainer and the workers import it.
The shipped files (example prompt sets, a GSM8K-format sample, a tiny tokenizer) are referred to
from a config as ``pkg://resilient_rl/data/<name>`` so the config works from any directory.
"""
