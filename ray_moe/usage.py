"""Command lines whose bad arguments end in one line (the project's rule for bad input).

argparse prints the whole usage block before its error; a command with thirty options then
buries the one line that matters. :class:`ArgumentParser` prints only
``PROG: error: MESSAGE (see PROG --help)`` and exits with code 2, as argparse does.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with a one-line error (sub-parsers made from it are the same kind)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise SystemExit(status)
