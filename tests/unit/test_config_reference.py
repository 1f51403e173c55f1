"""docs/CONFIG.md is generated from ray_moe/config.py's dataclasses and stays equal to them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ray_moe import config as config_module
from ray_moe.config_reference import field_docs, render, sections

PAGE = Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md"


def test_config_page_is_current():
    assert PAGE.read_text() == render(), \
        "docs/CONFIG.md is out of date: python -m ray_moe.config_reference > docs/CONFIG.md"


def test_every_key_has_a_one_line_doc():
    missing = [f"{name}.{key}" for name, cls in sections() for key, doc in field_docs(cls).items() if not doc]
    assert missing == [], "give these fields a comment in ray_moe/config.py"


def test_every_field_of_every_section_is_on_the_page():
    text = render()
    names = [name for name, _ in sections()]
    assert names == [f.name for f in dataclasses.fields(config_module.Config)]
    for name, cls in sections():
        for f in dataclasses.fields(cls):
            assert f"| `{name}.{f.name}` |" in text
    assert text.count("\n| `") == sum(len(dataclasses.fields(cls)) for _, cls in sections())


def test_trailing_comment_wins_over_the_lines_above():
    docs = field_docs(config_module.ModelConfig)
    assert docs["dtype"] == "float32 | bfloat16"
    assert docs["compile"].startswith("auto | none | blocks")  # a block of comment lines, joined
