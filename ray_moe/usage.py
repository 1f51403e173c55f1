"""Command lines whose bad arguments end in one line (the project's rule for bad input).

argparse prints the whole usage block before its error; a command with thirty options then
buries the one line that matters. :class:`ArgumentParser` prints only
``PROG: error: MESSAGE (see PROG --help)`` and exits with code 2, as argparse does. It also owns
the ``--set KEY=VALUE`` overrides argument the benches share (:meth:`ArgumentParser.add_overrides`).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with a one-line error (sub-parsers made from it are the same kind)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def add_overrides(self, applies_to: str = "every run") -> None:
        """``--set KEY=VALUE ...`` (``args.set``): config overrides a command applies on top of
        its own, e.g. ``model.compile=none`` for eager blocks where ``auto`` compiles them."""
        self.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                          help=f"more config overrides for {applies_to} (e.g. model.compile=none: eager blocks on CUDA)")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise SystemExit(status)
