"""Converter test settings. The checkpoint-building fixtures (``synth_ckpt``,
``make_ckpt``, ``ckpts``) are shared with the runtime tests: see
``tests/conftest.py``."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def _one_cpu_thread():
    """The tensors here are tiny: intra-op threads only add overhead (and
    contention when other suites run beside these)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
