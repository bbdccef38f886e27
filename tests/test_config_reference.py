"""Every config key is described beside its field, and docs/config.md is the page generated from
those descriptions (resilient_rl/config/reference.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from resilient_rl.config.reference import PAGE, field_descriptions, keys, render
from resilient_rl.config.resume import flatten
from resilient_rl.config.schema import Config, load_config


def test_every_config_key_has_a_description():
    described = keys()
    assert len(described) > 100
    assert [k.key for k in described if not k.description] == []


def test_every_key_of_a_loaded_config_is_in_the_reference():
    cfg = load_config(None, [])

    def walk(section, prefix=""):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if dataclasses.is_dataclass(value):
                yield from walk(value, f"{prefix}{f.name}.")
            elif not f.name.startswith("_"):
                yield prefix + f.name

    assert sorted(walk(cfg)) == sorted(k.key for k in keys())


def test_descriptions_are_read_from_the_comment_lines_above_each_field():
    docs = field_descriptions(Config)
    assert "verl's name for a reward function" in docs["custom_reward_function"]
    assert docs["model"] == ""  # a section is described by its class docstring


def test_the_checked_in_reference_is_up_to_date():
    assert PAGE.read_text() == render(), "run: python -m resilient_rl.config.reference --write"


def test_the_file_the_readme_says_lists_every_key_does():
    """README.md points users at one file for the whole config: every key must be in it."""
    root = Path(__file__).resolve().parents[1]
    claims = re.findall(r"(?:\[[^\]]*\]\(|`)([\w./-]+\.(?:md|yaml))(?:\)|`) lists every key",
                        (root / "README.md").read_text(encoding="utf-8"))
    assert claims, "README.md no longer says where every config key is listed"
    for name in claims:
        text = (root / name).read_text(encoding="utf-8")
        if name.endswith(".yaml"):
            listed = set(flatten(yaml.safe_load(text)))
            missing = [k.key for k in keys() if k.key not in listed]
        else:
            missing = [k.key for k in keys() if f"`{k.key}`" not in text]
        assert not missing, f"README.md says {name} lists every key; it lacks {missing}"
