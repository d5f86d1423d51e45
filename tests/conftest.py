"""Suite-wide hooks and the shared checkpoint-building fixtures.

Synthetic checkpoints (megamoe_convert.testing.synth) and their conversions are built
once per session, keyed by their parameters, and shared read-only by the
converter and runtime trees:

* ``ckpts.source(fmt, **kw)``: a synthetic checkpoint in source format ``fmt``.
* ``ckpts.converted(fmt, ep_size=1, **kw)``: ``(source_dir, converted_dir)``.
* ``ckpts.fresh_converted(fmt, path, ...)``: a private conversion a test may damage.
* ``synth_ckpt(fmt, **kw)``: ``ckpts.source`` (same arguments -> same folder); do not modify it.
* ``make_ckpt(fmt, **kw)``: a fresh checkpoint under the test's tmp_path, for
  tests that damage files or inject defects.

Unset sizes default to :data:`SMALL`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

SMALL = dict(num_layers=2, hidden=256, intermediate=128, num_experts=8, top_k=2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _key(*parts: Any) -> str:
    return json.dumps(parts, sort_keys=True, default=str)


def _build(path: Path, fmt: str, **kw: Any) -> Path:
    from megamoe_convert.testing.synth import build_synthetic_checkpoint

    return build_synthetic_checkpoint(path, fmt, **{**SMALL, **kw})


class CheckpointStore:
    """The session's synthetic checkpoints and conversions, one cache keyed by parameters."""

    def __init__(self, base: Path):
        self.base = base
        self._src: dict[str, Path] = {}
        self._conv: dict[str, tuple[Path, Path]] = {}

    def source(self, fmt: str, **kw: Any) -> Path:
        k = _key(fmt, {**SMALL, **kw})
        if k not in self._src:
            self._src[k] = _build(self.base / f"src{len(self._src):03d}-{fmt}", fmt, **kw)
        return self._src[k]

    def converted(self, fmt: str, ep_size: int = 1, **kw: Any) -> tuple[Path, Path]:
        from megamoe_convert.pipeline.convert import convert

        k = _key(fmt, ep_size, {**SMALL, **kw})
        if k not in self._conv:
            src = self.source(fmt, **kw)
            out = self.base / f"out{len(self._conv) + 1:03d}-{fmt}-ep{ep_size}"
            convert(src, out, ep_size=ep_size)
            self._conv[k] = (src, out)
        return self._conv[k]

    def fresh_converted(self, fmt: str, path: Path, ep_size: int = 1, **kw: Any) -> tuple[Path, Path]:
        from megamoe_convert.pipeline.convert import convert

        src = self.source(fmt, **kw)
        convert(src, path, ep_size=ep_size)
        return src, path


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> CheckpointStore:
    return CheckpointStore(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="session")
def synth_ckpt(ckpts) -> Callable[..., Path]:
    return ckpts.source


@pytest.fixture
def make_ckpt(tmp_path) -> Callable[..., Path]:
    n = [0]

    def build(fmt: str, **kw: Any) -> Path:
        n[0] += 1
        return _build(tmp_path / f"ckpt{n[0]}-{fmt}", fmt, **kw)

    return build


def run_bounded(code: str, *, mem_mb: int = 1400, timeout_s: float = 120.0, env: dict | None = None):
    """Run python `code` in a subprocess whose address space is capped at `mem_mb` MiB (RLIMIT_AS; importing
    torch and megamoe takes about 650 MiB of it) and whose wall time is capped at `timeout_s`: hostile-input
    tests prove a refusal happens in bounded memory and time, not merely that it happens. Returns the
    CompletedProcess; a MemoryError or kill shows up as a non-zero return code with the traceback in stderr."""
    import os
    import subprocess
    import sys

    pre = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({mem_mb << 20}, {mem_mb << 20}))\n")
    full_env = {**os.environ, **(env or {})}
    root = str(Path(__file__).resolve().parents[1])
    full_env["PYTHONPATH"] = root + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", pre + code], capture_output=True, text=True, timeout=timeout_s,
                          env=full_env)


@pytest.fixture
def bounded_python():
    """:func:`run_bounded` as a fixture."""
    return run_bounded


#: convert() keyword arguments a real producer export (tests/fixtures/real) needs to convert: the exports
#: whose activation recipe the kernel makes coarser need the opt-in (and NVFP4 ones without a w2 input
#: scale the L2 activation scale); Quark's weight-only NVFP4 quantizes gate and up with separate global
#: scales. Every other fixture converts with no options.
REAL_CONVERT_OPTIONS: dict[str, dict] = {
    "modelopt-w4a16-nvfp4-qwen3moe": dict(accept_activation_change=True, l2_activation_scale=0.002),
    "modelopt-w4a8-nvfp4-fp8-qwen3moe": dict(accept_activation_change=True),
    "llmcompressor-nvfp4a16-qwen3moe": dict(accept_activation_change=True, l2_activation_scale=0.002),
    "llmcompressor-mxfp4a16-qwen3moe": dict(accept_activation_change=True),
    "quark-mxfp4-weight-only-qwen3moe": dict(accept_activation_change=True),
    "quark-nvfp4-weight-only-qwen3moe": dict(accept_activation_change=True, l2_activation_scale=0.002,
                                             on_scale_mismatch="requantize"),
}


@pytest.fixture
def real_convert_options():
    """:data:`REAL_CONVERT_OPTIONS`: fixture name -> convert() kwargs."""
    return REAL_CONVERT_OPTIONS
