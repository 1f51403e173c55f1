"""The package and its tests speak of the project, not of how it was developed: no development
sessions, issue numbers or borrowed machines in code, comments, docstrings, messages or tests
(cite a date or a commit instead)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HISTORY = re.compile(r"\b(sessions? [0-9]+|issues? [0-9]+|lent|device time)\b", re.IGNORECASE)


def test_no_development_history_in_the_package_or_its_tests():
    hits = []
    for top in ("ray_moe", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if HISTORY.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)
