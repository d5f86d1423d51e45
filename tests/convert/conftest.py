"""Shared converter fixtures: synthetic checkpoints built with megamoe_convert.synth.

* ``synth_ckpt(fmt, **kw)``: session-cached, read-only checkpoints (same
  arguments -> same folder); do not modify them.
* ``make_ckpt(fmt, **kw)``: a fresh checkpoint under the test's tmp_path, for
  tests that damage files or inject defects.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from megamoe_convert.synth import build_synthetic_checkpoint

SMALL = dict(num_layers=2, hidden=256, intermediate=128, num_experts=8, top_k=2)


@pytest.fixture(scope="package", autouse=True)
def _one_cpu_thread():
    """The tensors here are tiny: intra-op threads only add overhead (and
    contention when other suites run beside these)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _key(fmt: str, kw: dict[str, Any]) -> str:
    return fmt + "-" + json.dumps(kw, sort_keys=True, default=str)


@pytest.fixture(scope="session")
def synth_ckpt(tmp_path_factory) -> Callable[..., Path]:
    cache: dict[str, Path] = {}
    base = tmp_path_factory.mktemp("synth")

    def build(fmt: str, **kw: Any) -> Path:
        args = {**SMALL, **kw}
        k = _key(fmt, args)
        if k not in cache:
            cache[k] = build_synthetic_checkpoint(base / f"c{len(cache):03d}-{fmt}", fmt, **args)
        return cache[k]

    return build


@pytest.fixture
def make_ckpt(tmp_path) -> Callable[..., Path]:
    n = [0]

    def build(fmt: str, **kw: Any) -> Path:
        n[0] += 1
        return build_synthetic_checkpoint(tmp_path / f"ckpt{n[0]}-{fmt}", fmt, **{**SMALL, **kw})

    return build
