"""The config reference (docs/CONFIG.md), generated from the dataclasses of :mod:`ray_moe.config`.

Each key's name, type and default come from ``dataclasses.fields``; its one-line meaning from the
comment beside the field in config.py's source (a trailing ``# ...``), else from the comment lines
right above it, joined into one line. ``python -m ray_moe.config_reference > docs/CONFIG.md``
rewrites the page; ``tests/unit/test_config_reference.py`` fails when the page is out of date or a
field has no comment.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
from typing import Any

from ray_moe import config as config_module

HEADER = """\
# Config reference

Every key of a run's config: YAML sections, or `section.key=value` on the command line (e.g.
`ray-moe train --config jobs/tiny.yaml train.steps=50 model.hf.num_hidden_layers=4`). Generated
from the dataclasses in `ray_moe/config.py` by `python -m ray_moe.config_reference > docs/CONFIG.md`
(`tests/unit/test_config_reference.py` keeps it current); why the defaults are what they are is in
[ARCHITECTURE.md](ARCHITECTURE.md#why-the-defaults-are-what-they-are).
"""


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text without ``#``, whether the line holds only the comment)."""
    out: dict[int, tuple[str, bool]] = {}
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            alone = not lines[row - 1][:col].strip()
            out[row] = (tok.string.lstrip("#").strip(), alone)
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` -> its one-line doc from config.py's comments ("" if none)."""
    source = inspect.getsource(config_module)
    comments = _comments(source)
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        trailing = [comments[r][0] for r in range(stmt.lineno, stmt.end_lineno + 1)
                    if r in comments and not comments[r][1]]
        above: list[str] = []
        row = stmt.lineno - 1
        while row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        docs[stmt.target.id] = " ".join(trailing or above)
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def sections() -> list[tuple[str, type]]:
    """(section name, its dataclass) in the order of :class:`ray_moe.config.Config`'s fields."""
    return [(f.name, type(_default(f))) for f in dataclasses.fields(config_module.Config)]


def render() -> str:
    """The whole of docs/CONFIG.md: one table per section, one line per key."""
    parts = [HEADER]
    for name, cls in sections():
        docs = field_docs(cls)
        parts.append(f"\n## {name}\n\n| key | type | default | meaning |\n| --- | --- | --- | --- |\n")
        for f in dataclasses.fields(cls):
            default = repr(_default(f)) if isinstance(_default(f), str) else str(_default(f))
            parts.append(f"| `{name}.{f.name}` | `{_cell(str(f.type))}` | `{_cell(default)}` | "
                         f"{_cell(docs.get(f.name, ''))} |\n")
    return "".join(parts)


if __name__ == "__main__":
    print(render(), end="")
