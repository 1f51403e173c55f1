"""Progress output made for both terminals and logs.

On a terminal: a tqdm bar positioned at the step (a replayed step after a recovery moves it back,
it never overshoots). Elsewhere (``ray job logs``, files, CI): one plain line every
``train.log_interval`` steps or ``train.log_every_s`` seconds, whichever comes first; no carriage
returns. Messages (evaluations, checkpoints, recoveries) are printed as whole lines in both modes.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(self, mode: str, start: int, target: int, log_interval: int, log_every_s: float,
                 stream: TextIO | None = None) -> None:
        """mode: auto | bar | lines | off (auto: a bar when ``stream`` is a terminal)."""
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode, self.target = mode, target
        self.log_interval, self.log_every_s = log_interval, log_every_s
        self._last_line_step, self._last_line_time = start, time.monotonic()
        self.bar = None
        if mode == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=target, initial=start, unit="step", dynamic_ncols=True, file=self.stream)

    def update(self, m: dict[str, Any]) -> None:
        """After a step: m is the step's record (step, loss, tokens_per_s, step_time)."""
        step = m["step"]
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}",
                                 step_s=f"{m['step_time']:.2f}", refresh=False)
            self.bar.refresh()
        elif self.mode == "lines":
            now = time.monotonic()
            if (step - self._last_line_step >= self.log_interval or now - self._last_line_time >= self.log_every_s
                    or step >= self.target):
                self._last_line_step, self._last_line_time = step, now
                self._line(f"step {step}/{self.target}  loss {m['loss']:.4f}  tokens/s {m['tokens_per_s']:.0f}  "
                           f"step {m['step_time']:.3f}s  lr {m['lr']:.3g}")

    def message(self, text: str) -> None:
        if self.mode == "off":
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self._line(text)

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
