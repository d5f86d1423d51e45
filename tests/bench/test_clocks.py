"""bench/clocks.py: the clock and power of a timing's window, from polls of nvidia-smi (faked here: no GPU)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import clocks  # noqa: E402


def test_parse_sample_reads_a_poll_and_refuses_what_is_not_one():
    assert clocks.parse_sample("1860, 497.25, 0x0000000000000004") == (1860.0, 497.25, "0x0000000000000004")
    assert clocks.parse_sample("[N/A], 300, 0x0") is None
    assert clocks.parse_sample("NVIDIA-SMI has failed") is None
    assert clocks.parse_sample("") is None


def test_summarize_counts_only_parsed_samples():
    s = clocks.summarize([(1800.0, 400.0, "0x4"), (1900.0, 500.0, "0x0"), (2000.0, 600.0, "0x4")])
    assert s == dict(n=3, sm_mhz_mean=1900.0, sm_mhz_min=1800.0, power_w_mean=500.0, power_w_max=600.0,
                     throttle=["0x0", "0x4"])
    assert clocks.summarize([]) == dict(n=0)


def test_window_holds_the_polls_of_its_interval_only():
    polls = iter(["1500, 100, 0x0"] * 3 + ["1700, 300, 0x4"] * 1000)
    with clocks.ClockSampler(period_s=0.005, query=lambda: next(polls)) as cs:
        while len(cs.samples) < 4:
            time.sleep(0.002)
        t0 = time.time()
        while len([t for t, _ in cs.samples if t >= t0]) < 3:
            time.sleep(0.002)
        t1 = time.time()
    late = cs.window(t0, t1)
    assert late["n"] >= 3 and late["sm_mhz_mean"] == 1700.0 and late["throttle"] == ["0x4"]
    first = cs.window(cs.samples[0][0], cs.samples[2][0])
    assert first == dict(n=3, sm_mhz_mean=1500.0, sm_mhz_min=1500.0, power_w_mean=100.0, power_w_max=100.0,
                         throttle=["0x0"])
    # negative control: a window before the first poll holds nothing
    assert cs.window(0.0, cs.samples[0][0] - 1) == dict(n=0)


def test_a_failing_query_gives_no_sample_and_no_error():
    def broken() -> str:
        raise OSError("nvidia-smi: not found")

    with clocks.ClockSampler(period_s=0.005, query=broken) as cs:
        time.sleep(0.03)
    assert cs.samples and all(line == "" for _, line in cs.samples)
    assert cs.window(0.0, time.time()) == dict(n=0)


def test_kernel_bench_records_a_labelled_timing_under_clocks(monkeypatch):
    """bench/kernel.py's ``_bench``: with a sampler running, a labelled timing gets its window's clock and power;
    an unlabelled one (the copy-bandwidth probe) and any timing without ``--clocks`` record nothing."""
    import kernel

    def slow_median(fn, graph, rep, warmup):
        time.sleep(0.05)
        return 1.25

    monkeypatch.setattr(kernel, "_bench_median", slow_median)
    monkeypatch.setattr(kernel, "CLOCKS", [])
    assert kernel._bench(lambda: None, label="off") == 1.25 and kernel.CLOCKS == []  # no sampler: nothing
    with clocks.ClockSampler(period_s=0.005, query=lambda: "1777, 555, 0x4") as cs:
        monkeypatch.setattr(kernel, "_SAMPLER", [cs])
        kernel._bench(lambda: None, label="mixtral mxfp4 bf16-frag T=4096")
        kernel._bench(lambda: None)  # unlabelled
    assert len(kernel.CLOCKS) == 1
    rec = kernel.CLOCKS[0]
    assert rec["label"] == "mixtral mxfp4 bf16-frag T=4096" and rec["us"] == 1250.0
    assert rec["n"] >= 2 and rec["sm_mhz_mean"] == 1777.0 and rec["power_w_max"] == 555.0
