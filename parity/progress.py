"""The progress line of a long command (sweep, check, bisect, train, bench) on stderr."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """Progress on stderr. On a terminal, one line redrawn in place. Otherwise (a log, CI) a line
    at every tenth of the planned work, and a heartbeat every HEARTBEAT_S seconds with the last
    status, so a long case never leaves the log silent. A context manager: the heartbeat stops
    with the command. Calls: progress(done, total[, elapsed][, work=(work_done, work_planned)]);
    `bar` draws a bar and an ETA.

    The ETA weighs the items by their work where the caller gives it (a sweep: multiply-adds of
    each case, parity.sweep.case_work): a case's time is a fixed cost (a worker's call, the
    float64 references' set-up, the metrics) plus a cost per unit of work, both fitted by least
    squares on the items done so far, so ten small cases left after a large one are not ten
    large ones, nor free. Without work, every item counts the same."""

    HEARTBEAT_S = 30.0

    def __init__(self, enabled: bool, what: str, *, bar: bool = True):
        self.enabled, self.what, self.bar = enabled, what, bar
        self.tty = sys.stderr.isatty()
        self.start = self.last_write = time.monotonic()
        self.status, self.decile = f"  {what}: started", -1
        self._stop = threading.Event()
        self._last = (0.0, 0.0)  # (elapsed, work done) at the previous call
        self._sums = dict.fromkeys(("n", "w", "ww", "t", "wt"), 0.0)  # of the least-squares fit

    def __enter__(self) -> "Progress | None":
        if not self.enabled:
            return None
        if not self.tty:
            threading.Thread(target=self._beat, name="fp8-parity heartbeat", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.enabled and self.tty and self.last_write > self.start:
            sys.stderr.write("\n")

    def _write(self, text: str) -> None:
        self.last_write = time.monotonic()
        sys.stderr.write(text)
        sys.stderr.flush()

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.HEARTBEAT_S / 2)):
            if time.monotonic() - self.last_write >= self.HEARTBEAT_S:
                self._write(f"{self.status} (running, {time.monotonic() - self.start:.0f} s)\n")

    def seconds_left(self, done: int, total: int, elapsed: float, work: tuple[float, float] | None = None) -> float:
        """The time left. Without `work`: elapsed per item. With it (one call per item done, as a
        sweep calls; work done and planned of this run): the seconds of each item between calls fit
        as a + b * its work by least squares (a, b at least 0), applied to the items and work left."""
        if work is None:
            return elapsed / done * (total - done) if done else 0.0
        (last_elapsed, last_work), (work_done, work_planned) = self._last, work
        seconds, units = elapsed - last_elapsed, work_done - last_work
        self._last = (elapsed, work_done)
        for key, value in (("n", 1), ("w", units), ("ww", units * units), ("t", seconds), ("wt", units * seconds)):
            self._sums[key] += value
        n, w, ww, t, wt = self._sums.values()
        spread = n * ww - w * w  # n^2 times the variance of the items' work
        # under 1e-9 of n * sum(w^2): the items' work differs by rounding only; the work alone is the weight
        per_unit = (n * wt - w * t) / spread if spread > 1e-9 * n * ww else (t / w if w else 0.0)
        per_item = (t - per_unit * w) / n
        if per_unit < 0:  # time does not grow with work here: a cost per item alone
            per_item, per_unit = t / n, 0.0
        elif per_item < 0:  # no fixed cost: work alone
            per_item, per_unit = 0.0, wt / ww
        return per_item * (total - done) + per_unit * (work_planned - work_done)

    def __call__(self, done: int, total: int, elapsed: float | None = None, *,
                 work: tuple[float, float] | None = None) -> None:
        elapsed = time.monotonic() - self.start if elapsed is None else elapsed
        if self.bar:
            left = self.seconds_left(done, total, elapsed, work)
            self.status = (f"  [{'#' * int(30 * done / total):<30}] {done}/{total} {self.what}, {elapsed:.0f} s "
                           f"elapsed, ~{left:.0f} s left")
        else:
            self.status = f"  {done} {self.what} run (search budget {total}), {elapsed:.0f} s elapsed"
        if self.tty:
            self._write("\r" + self.status)
        elif self.bar and done * 10 // total != self.decile:
            self.decile = done * 10 // total
            self._write(self.status + "\n")

