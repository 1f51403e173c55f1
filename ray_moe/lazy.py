"""Package attributes that load their module on first use (PEP 562), so that importing one leaf
of a package does not import what its siblings need (Ray, the driver)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """``__all__`` and a module ``__getattr__`` for ``package``: ``homes`` maps each public name
    to the module that defines it, imported when the name is first read."""
    table = MappingProxyType(dict(homes))

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return sorted(table), __getattr__
