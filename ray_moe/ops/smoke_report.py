"""Results of the cluster smoke test: one row per (check, node, GPU / rank), tables, JSON, summary.

Pure data and formatting (no Ray, no torch) so it can be unit-tested. A row's ``status`` is
``pass``, ``fail`` or ``skip``; ``skip`` rows say why in ``detail`` (a check that could not run
because an earlier one failed, or an optional part that is absent). The summary line names
every failing (check, node, GPU) — the one line an operator reads first.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

PASS, FAIL, SKIP = "pass", "fail", "skip"
TABLE_DETAIL_CHARS = 140
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")

# Checks in the order they run (and are printed).
CHECK_ORDER = ("connect", "import", "device", "peer_access", "bootstrap", "layer_parity", "transport",
               "bandwidth", "training")


@dataclass
class CheckResult:
    """One outcome of one check on one node / GPU / rank (``node_id`` '' = the whole cluster)."""

    check: str
    status: str
    node_id: str = ""
    ip: str = ""
    gpu: int | None = None  # GPU index on its node (None: CPU or not GPU-specific)
    rank: int | None = None
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        """'node 1a2b3c4d (10.0.0.5) GPU 3 rank 7' — as much as is known."""
        parts = []
        if self.node_id:
            parts.append(f"node {short_id(self.node_id)}" + (f" ({self.ip})" if self.ip else ""))
        if self.gpu is not None and self.gpu >= 0:
            parts.append(f"GPU {self.gpu}")
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        return " ".join(parts) or "cluster"


def short_id(node_id: str) -> str:
    return node_id[:8]


@dataclass
class SmokeReport:
    """Every result of a smoke run, plus facts about the run (address, world size, ...)."""

    results: list[CheckResult] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    bandwidth: dict[str, Any] | None = None  # {"labels": [...], "gbps": [[...]], "bytes": n}

    def add(self, check: str, status: str, **kwargs: Any) -> CheckResult:
        result = CheckResult(check, status, **kwargs)
        self.results.append(result)
        return result

    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == FAIL]

    @property
    def ok(self) -> bool:
        return not self.failures() and any(r.status == PASS for r in self.results)

    def checks(self) -> list[str]:
        seen = [c for c in CHECK_ORDER if any(r.check == c for r in self.results)]
        return seen + sorted({r.check for r in self.results} - set(seen))

    # ------------------------------------------------------------------ output
    def table(self, check: str) -> str:
        rows = [
            (short_id(r.node_id) or "-", r.ip or "-", "-" if r.gpu is None or r.gpu < 0 else r.gpu,
             "-" if r.rank is None else r.rank, r.status.upper(), first_line(r.detail, TABLE_DETAIL_CHARS))
            for r in self.results if r.check == check
        ]
        return tabulate(rows, headers=["node", "ip", "gpu", "rank", "status", "detail"], tablefmt="github")

    def bandwidth_table(self) -> str:
        """The rank i → rank j matrix in GB/s (rows: sender, columns: receiver)."""
        if not self.bandwidth:
            return ""
        labels, gbps = self.bandwidth["labels"], self.bandwidth["gbps"]
        rows = [[labels[i]] + ["-" if i == j or v is None else f"{v:.2f}" for j, v in enumerate(row)]
                for i, row in enumerate(gbps)]
        return tabulate(rows, headers=["src \\ dst GB/s"] + labels, tablefmt="github")

    def render(self) -> str:
        parts = []
        for check in self.checks():
            parts.append(f"## {check}\n{self.table(check)}")
            if check == "bandwidth" and self.bandwidth:
                mib = self.bandwidth["bytes"] / 2**20
                parts.append(f"bandwidth matrix ({mib:g} MiB messages, rank: node/GPU)\n{self.bandwidth_table()}")
        return "\n\n".join(parts)

    def summary_line(self) -> str:
        """One line: PASSED with counts, or FAILED naming every failing check and where."""
        n = {s: sum(r.status == s for r in self.results) for s in (PASS, FAIL, SKIP)}
        counts = f"{n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped"
        failures = self.failures()
        if not failures:
            if not n[PASS]:
                return f"smoke: FAILED: no check ran ({counts})"
            return f"smoke: PASSED ({counts})"
        named = "; ".join(f"{r.check} on {r.where}: {first_line(r.detail)}" for r in failures[:6])
        more = f"; and {len(failures) - 6} more" if len(failures) > 6 else ""
        return f"smoke: FAILED ({counts}): {named}{more}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "summary": self.summary_line(),
            "info": self.info,
            "results": [asdict(r) for r in self.results],
            "bandwidth": self.bandwidth,
        }

    def write_json(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str))


def first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def condense_error(text: str) -> str:
    """A multi-line error (Ray's remote tracebacks, colour codes and all) as one line:
    the last ``SomeError: message`` line (the root cause) first, then the first line (the context)."""
    lines = [ln.strip() for ln in _ANSI.sub("", text).splitlines() if ln.strip()]
    if not lines:
        return ""
    causes = [ln for ln in lines if _EXCEPTION_LINE.match(ln)]
    if causes and causes[-1] != lines[0]:
        return f"{causes[-1]} (from: {lines[0]})"
    return lines[0]
