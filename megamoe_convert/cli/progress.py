"""What `convert` and `verify` show while they work, on stderr.

Why not click.progressbar: it showed only a percentage and an ETA, stayed
blank while torch loaded and the source was checked (seconds on a large
model), never said which layer it was on, ended at 99% (a few scalar bytes
of the plan are never streamed) and printed nothing at all when stderr was
not a terminal, so a CI or k8s log showed no sign of life for minutes.

`ProgressDisplay` is what tqdm and ``hf download`` users expect:

* a terminal: one line redrawn in place (at most 10 times a second) with
  percent, a bar, bytes done / total, the rate, the ETA and where the run
  is (``layer 3/8 model.layers.3.mlp``) with the file being written; phases without bytes (loading,
  checking, finishing) show at once as ``converting: checking ...``.
* not a terminal: one plain line every `interval` seconds
  (``MEGAMOE_PROGRESS_INTERVAL``, default 10) while the run lasts, phases
  included (a heartbeat thread writes it when no byte arrives), plus a last
  line with the total and the rate; no carriage returns. A run that ends
  (or fails) within the first interval prints no line at all (its summary or
  its error says the rest), so short runs and error messages stay clean.

It is called as ``progress(done, total)`` (the `plan.Progress` protocol);
`stage`, `where` and `writing` (the output file) are optional extras the converter calls when present
(`plan.report_stage`). It imports nothing heavy, so the CLI can show the
first line before torch is imported.
"""
from __future__ import annotations

import shutil
import sys
import threading
import time
from typing import Callable, TextIO

from megamoe_runtime import knobs

from ..output.units import format_bytes

#: seconds between two lines when stderr is not a terminal (``MEGAMOE_PROGRESS_INTERVAL`` overrides)
DEFAULT_INTERVAL = 10.0
#: seconds between two redraws on a terminal
_TTY_REFRESH = 0.1


def _format_duration(s: float) -> str:
    s = max(0, int(round(s)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def interval_from_env(default: float = DEFAULT_INTERVAL) -> float:
    v = knobs.get("MEGAMOE_PROGRESS_INTERVAL")
    try:
        return max(0.0, float(v)) if v else default
    except ValueError:
        return default


class ProgressDisplay:
    """A byte progress display on `stream`; ``mode`` "tty" | "lines" | "off"
    ("auto": "tty" when `stream` is a terminal, else "lines")."""

    def __init__(self, label: str, mode: str = "auto", stream: TextIO | None = None,
                 interval: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            try:
                mode = "tty" if self.stream.isatty() else "lines"
            except (AttributeError, ValueError):
                mode = "lines"
        if mode not in ("tty", "lines", "off"):
            raise ValueError(f"progress mode {mode!r}")
        self.label, self.mode, self.clock = label, mode, clock
        self.interval = interval_from_env() if interval is None else interval
        self.done = self.total = 0
        self.phase: str | None = None
        self.location: str | None = None
        self.file: str | None = None  # the output file(s) being written (`writing`)
        self.t_start = clock()
        self.t_bytes: float | None = None  # when the first byte was reported (the rate counts from there)
        self._last_draw = float("-inf")
        self._last_line = self.t_start  # lines mode: the first line one interval in
        self._drawn = False
        self._lines = 0  # lines written (lines mode)
        self._closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    # ---------------------------------------------------------------- the protocol
    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or self._closed:
            return
        now = self.clock()
        if self.t_bytes is None:
            self.t_bytes = now
            self.phase = None  # bytes flow: the bar replaces the phase line (a later phase shows in it)
        self.done, self.total = max(self.done, done), total
        if self.mode == "lines":
            self._heartbeat()
        self._maybe_show(now)

    def stage(self, text: str) -> None:
        """A phase (``checking 48 MoE layers``, ``finishing ...``): shown at once."""
        if not self.enabled or self._closed:
            return
        self.phase = text
        self.file = None  # a new phase names its own file when it writes one
        if self.mode == "tty" or self.interval <= 0:
            self._show(self.clock(), force_line=True)
        else:
            self._heartbeat()

    def where(self, text: str) -> None:
        """Where the byte pass is (``layer 3/8 model.layers.3.mlp``), shown with the bytes."""
        self.location = text

    def writing(self, name: str) -> None:
        """The output file the byte pass is writing (``megamoe-experts-rank000-of-008-00002.safetensors``),
        shown after where it is."""
        self.file = name

    def close(self, ok: bool = True) -> None:
        """End the display; ``ok``: the run finished, so say 100% with the total and the rate."""
        if not self.enabled or self._closed:
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        now = self.clock()
        # lines mode: the last line closes a log that showed progress; a run shorter than one interval
        # printed none, and its summary says the same (so short runs print exactly what they did before)
        if ok and self.total and (self.mode == "tty" or self._lines):
            self.done, self.phase = self.total, None
            self.location = self.file = None
            self._show(now, force_line=True, final=True)
        if self.mode == "tty" and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self._closed = True

    def _heartbeat(self) -> None:
        """Lines mode: a daemon thread that writes the status once an interval passed without a line,
        so a long phase without bytes (checking a large model's scales) still shows in the log."""
        if self._beat is not None or self.interval <= 0:
            return
        def beat():
            while not self._stop.wait(min(self.interval, 1.0)):
                now = self.clock()
                if now - self._last_line >= self.interval:
                    self._show(now)
        self._beat = threading.Thread(target=beat, name="megamoe-progress", daemon=True)
        self._beat.start()

    # ---------------------------------------------------------------- rendering
    def _maybe_show(self, now: float) -> None:
        if self.mode == "tty":
            if now - self._last_draw >= _TTY_REFRESH:
                self._show(now)
        elif now - self._last_line >= self.interval:
            self._show(now)

    def rate(self, now: float) -> float | None:
        if self.t_bytes is None or now - self.t_bytes <= 0 or not self.done:
            return None
        return self.done / (now - self.t_bytes)

    def _here(self) -> str | None:
        """What the line says the run is doing: a phase after the bytes began (finishing), else the layer."""
        here = self.phase if self.phase is not None else self.location
        if self.file:
            return f"{here}, writing {self.file}" if here else f"writing {self.file}"
        return here

    def text(self, now: float, final: bool = False) -> str:
        """The status as one line of plain text (what a log line says)."""
        if self.phase is not None and self.t_bytes is None:
            return f"{self.label}: {self.phase} ({_format_duration(now - self.t_start)} elapsed)"
        total = max(self.total, 1)
        pct = min(100, int(100 * self.done / total)) if self.done < self.total else 100
        parts = [f"{self.label}: {pct:3d}%", f"{format_bytes(self.done)} / {format_bytes(self.total)}"]
        r = self.rate(now)
        if final:
            parts.append(f"in {_format_duration(now - self.t_start)}")
            if r:
                parts.append(f"{format_bytes(r)}/s")
            return ", ".join(parts[:1]) + " " + ", ".join(parts[1:])
        if r:
            parts.append(f"{format_bytes(r)}/s")
            parts.append(f"ETA {_format_duration(max(0, self.total - self.done) / r)}")
        if self._here():
            parts.append(self._here())
        return parts[0] + " " + ", ".join(parts[1:])

    def _bar_line(self, now: float, width: int) -> str:
        if self.phase is not None and self.t_bytes is None:
            return self.text(now)[:width - 1]
        total = max(self.total, 1)
        frac = min(1.0, self.done / total)
        pct = int(100 * frac) if self.done < self.total else 100
        r = self.rate(now)
        tail = f" {format_bytes(self.done)}/{format_bytes(self.total)}"
        if r:
            tail += f" {format_bytes(r)}/s"
            if self.done < self.total:
                tail += f" ETA {_format_duration((self.total - self.done) / r)}"
        if self._here():
            tail += f" {self._here()}"
        head = f"{self.label} {pct:3d}% "
        n = 20 if width - len(head) >= 40 else 10  # a steady bar; the tail is cut at the edge instead
        fill = int(n * frac)
        line = f"{head}|{'#' * fill}{'-' * (n - fill)}|{tail}"
        return line[:width - 1]

    def _show(self, now: float, force_line: bool = False, final: bool = False) -> None:
        if self.mode == "tty":
            width = shutil.get_terminal_size((100, 24)).columns
            self.stream.write("\r\x1b[K" + self._bar_line(now, width))
            self.stream.flush()
            self._drawn = True
            self._last_draw = now
            return
        with self._lock:
            if not force_line and now - self._last_line < self.interval:
                return
            self.stream.write(self.text(now, final=final) + "\n")
            self.stream.flush()
            self._last_line = now
            self._lines += 1


__all__ = ["ProgressDisplay", "format_bytes", "_format_duration", "DEFAULT_INTERVAL"]
