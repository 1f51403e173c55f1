"""Oracle comparisons shared by the tests, the smoke test and the benchmarks.

- :mod:`cases`: :class:`Case`, the one description of a seeded problem, and the edge cases.
- :mod:`errors`: :func:`rel_err`, the one relative-error measure.
- :mod:`layer`: the EP layer on a live group vs the single-process oracle.
- :mod:`transport`: dispatch/combine (and their backward) on a live group vs a torch reference.
"""

from ray_moe.validation.cases import EDGE_CASES, ROUTINGS, Case
from ray_moe.validation.errors import rel_err

__all__ = ["Case", "EDGE_CASES", "ROUTINGS", "rel_err"]
