"""The package's layers: imports run one way (driver → worker → model → placement/comm/kernels),
and no module keeps mutable state at module level.

Each package may import only the packages listed for it (its own modules always); the check
reads every module's imports (module level and inside functions) from its source.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ray_moe"

# What each part of the package may import (besides itself). Shared base modules first.
BASE = {"arch", "config", "connect", "mesh", "topology", "device", "dirlock", "lazy", "usage"}
ALLOWED = {
    "usage": set(),  # the command lines' one-line argument errors
    "lazy": set(),  # package attributes loaded on first use
    "arch": {"usage"},
    "config": {"arch", "mesh"},
    "config_reference": {"config"},  # docs/CONFIG.md from the config dataclasses
    "mesh": set(),  # the rank mesh (plain arithmetic)
    "topology": set(),
    "device": set(),
    "dirlock": set(),
    "connect": set(),  # every Ray connection of the command line, checked first
    "kernels": {"device"},
    "comm": {"topology"},
    "placement": set(),
    "model": {"arch", "config", "comm", "device", "kernels", "placement"},
    "checkpoint": {"arch", "config", "placement"},
    "data": {"config", "connect", "dirlock"},
    "validation": BASE | {"comm", "kernels", "model", "placement"},
    "worker": BASE | {"checkpoint", "comm", "data", "model", "placement"},
    "driver": BASE | {"checkpoint", "comm", "placement", "worker"},
    "ops": BASE | {"driver", "validation"},
    "bench": BASE | {"comm", "data", "driver", "kernels", "model", "placement", "validation", "worker"},
    "cli": BASE | {"bench", "checkpoint", "data", "driver", "model", "ops", "worker"},
    "__init__": {"lazy"},  # lazy re-exports by name only
}


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "ray_moe":
            names = [f"ray_moe.{a.name}" for a in node.names]  # from ray_moe import checkpoint
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "ray_moe" or name.startswith("ray_moe."):
                parts = name.split(".")
                found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_imports_run_down_the_layers():
    upward = []
    for path in MODULES:
        part = _part(path)
        assert part in ALLOWED, f"{part} is not in the layer table of this test: add it"
        bad = _imports(path) - ALLOWED[part] - {part}
        if bad:
            upward.append(f"ray_moe/{path.relative_to(PACKAGE)} ({part}) imports {sorted(bad)}")
    assert not upward, "\n".join(upward)


def test_no_mutable_module_state():
    """Module-level assignments hold constants: no lists, dicts or sets (tables are tuples or
    MappingProxyType), and no ``global`` statements anywhere."""
    mutable = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
    found = []
    for path in MODULES:
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, mutable):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                name = getattr(target, "id", "?")
                if name != "__all__":
                    found.append(f"ray_moe/{path.relative_to(PACKAGE)}:{node.lineno} {name}")
        if [n for n in ast.walk(tree) if isinstance(n, ast.Global)]:
            found.append(f"ray_moe/{path.relative_to(PACKAGE)} uses global")
    assert not found, "module-level mutable state: " + "; ".join(found)
