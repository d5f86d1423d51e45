"""SM clock, board power and throttle reasons, sampled in a thread while a benchmark times something.

Why: a compute-bound layer timed in a tight loop (``do_bench`` on a graph replay) runs under the board's power
cap, so its SM clock is not the one an eager profile with idle gaps sees, and two layers that draw different
power get different clocks for the same work. ``bench/kernel.py --clocks`` prints, for every timing, the clock
and power over exactly that timing's window (docs/bench-log/kernels.md, "eighth session": ours against the
peer at 4096 tokens).

    with ClockSampler() as cs:
        t0 = time.time(); run(); t1 = time.time()
        print(cs.window(t0, t1))   # {'n': 12, 'sm_mhz_mean': 1860.0, ..., 'throttle': ['0x...04']}

The sampler polls ``nvidia-smi`` (no NVML binding needed), so samples come every 50-150 ms: a window shorter
than that holds none, and a few samples are an indication, not a trace.
"""
from __future__ import annotations

import statistics
import subprocess
import threading
import time
from typing import Callable, Optional

#: what one poll asks nvidia-smi for, in this order
QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def nvidia_smi() -> str:
    """One poll of the first GPU: ``"MHz, W, 0x..."``."""
    out = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=10).stdout
    return out.strip().splitlines()[0] if out.strip() else ""


def parse_sample(line: str) -> Optional[tuple[float, float, str]]:
    """(SM MHz, board W, throttle reasons) of one poll's line, or None for a line that is not one (an error
    text, "[N/A]" fields): such polls are left out of every window rather than counted as zero."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        return float(parts[0]), float(parts[1]), parts[2]
    except ValueError:
        return None


def summarize(samples: list[tuple[float, float, str]]) -> dict:
    """Clock and power statistics of parsed samples (``n`` 0 and no figures when there are none)."""
    if not samples:
        return dict(n=0)
    mhz = [s[0] for s in samples]
    watts = [s[1] for s in samples]
    return dict(n=len(samples), sm_mhz_mean=round(statistics.fmean(mhz), 1), sm_mhz_min=min(mhz),
                power_w_mean=round(statistics.fmean(watts), 1), power_w_max=max(watts),
                throttle=sorted({s[2] for s in samples}))


class ClockSampler:
    """Polls ``query`` (default: ``nvidia_smi``) every ``period_s`` in a daemon thread between ``start`` and
    ``stop`` (or over a ``with`` block); ``window(t0, t1)`` summarizes the polls whose time (``time.time()``) lies in [t0, t1]."""

    def __init__(self, period_s: float = 0.05, query: Callable[[], str] = nvidia_smi) -> None:
        self.period_s = period_s
        self.query = query
        self.samples: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            try:
                line = self.query()
            except (OSError, subprocess.SubprocessError):  # no nvidia-smi, or it hung: no sample
                line = ""
            self.samples.append((t, line))
            self._stop.wait(self.period_s)

    def start(self) -> "ClockSampler":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def __enter__(self) -> "ClockSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def window(self, t0: float, t1: float) -> dict:
        parsed = [parse_sample(line) for t, line in list(self.samples) if t0 <= t <= t1]
        return summarize([p for p in parsed if p is not None])
