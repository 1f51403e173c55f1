"""The one error type of the data layer."""

from __future__ import annotations


class DataError(ValueError):
    """Data cannot be read, prepared or trained on; the message names the file or setting at
    fault and what is expected."""
