"""The project speaks of itself: outside the dated log (docs/log/), its text names no numbered
working period or ticket and no borrowed machine time. Cite a date, a commit or a docs/RESULTS.md
row instead."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ["README.md", "docs", "ray_moe", "tests", "scripts", "jobs", "cluster"]
EXCLUDED = [REPO / "docs" / "log"]
# Built from parts, so that this file's own source does not match it.
WORDS = ["sess" + r"ions? [0-9]+", "iss" + r"ue [0-9]+", "le" + "nt", "dev" + "ice time"]
PATTERN = re.compile(r"\b(?:" + "|".join(WORDS) + r")\b", re.IGNORECASE)


def _text_files() -> list[Path]:
    files = []
    for root in ROOTS:
        path = REPO / root
        for f in [path] if path.is_file() else sorted(path.rglob("*")):
            if not f.is_file() or "__pycache__" in f.parts or any(f.is_relative_to(x) for x in EXCLUDED):
                continue
            try:
                files.append((f, f.read_text()))
            except (UnicodeDecodeError, OSError):
                continue  # not text
    return files


def test_pattern_matches_what_it_must():
    for bad in ["Sess" + "ion 19 found", "sess" + "ions 12 and 13", "see iss" + "ue 27", "a le" + "nt GPU",
                "no dev" + "ice time left"]:
        assert PATTERN.search(bad), bad
    for fine in ["a process session", "silent", "the issues list", "device timeline", "session_processes(3)"]:
        assert not PATTERN.search(fine), fine


def test_no_development_history_in_the_project_text():
    hits = [f"{f.relative_to(REPO)}:{n}: {line.strip()[:100]}"
            for f, text in _text_files() for n, line in enumerate(text.splitlines(), 1) if PATTERN.search(line)]
    assert not hits, f"{len(hits)} lines speak of how the project was developed:\n" + "\n".join(hits[:40])
