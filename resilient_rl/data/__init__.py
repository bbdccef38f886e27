"""Data shipped with the package: example prompt sets, a GSM8K-format sample and a tiny tokenizer.

Refer to these files from a config as ``pkg://resilient_rl/data/<name>`` so the config works
from any working directory once the package is installed.
"""
