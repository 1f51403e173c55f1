"""The one error type of the data layer, and its one way of reading a JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """Data cannot be read, prepared or trained on; the message names the file or setting at
    fault and what is expected."""


def load_json(path: Path, missing: str) -> Any:
    """The parsed contents of the JSON file ``path``. A missing file raises :class:`DataError`
    "``path`` ``missing``" (``missing`` says what the file is, e.g. "is missing; the index of a
    prepared dataset"); an unparsable one names the parser's complaint."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise DataError(f"{path} {missing}") from None
    except ValueError as exc:
        raise DataError(f"{path} is not valid JSON ({exc}); the file is truncated or damaged") from None
