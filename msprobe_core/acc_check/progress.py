"""Progress of a run: a tqdm bar with an ETA on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time

from msprobe_core.log import setup_logging


class Progress:
    """Counts checked API calls out of ``total``; ``close()`` ends the bar."""

    def __init__(self, total: int, desc: str = "acc_check", initial: int = 0, interval_s: float = 10.0):
        self.total = total
        self.done = initial
        self.desc = desc
        self._start = time.monotonic()
        self._start_done = initial
        self._interval = interval_s
        self._next_line = self._start + interval_s
        self._bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, initial=initial, desc=desc, unit="API", file=sys.stderr,
                                 dynamic_ncols=True, smoothing=0.05)
        self._log = setup_logging()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now >= self._next_line or self.done >= self.total:
            self._next_line = now + self._interval
            self._log.info("%s", self.line(now))

    def line(self, now: float) -> str:
        """``acc_check: 120/600 APIs (20%), 12 s elapsed, about 48 s left``."""
        elapsed = now - self._start
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = f"{self.desc}: {self.done}/{self.total} APIs ({pct:.0f}%), {elapsed:.0f} s elapsed"
        rate = (self.done - self._start_done) / elapsed if elapsed > 0 else 0.0
        if rate > 0 and self.done < self.total:
            text += f", about {(self.total - self.done) / rate:.0f} s left"
        return text

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
