"""Runtime fixtures. The synthetic source checkpoints and their conversions
(``ckpts.source``, ``ckpts.converted``, ``ckpts.fresh_converted``) are built
once per session by the shared ``ckpts`` fixture in ``tests/conftest.py``.

* ``layer_bytes(layer)``: name -> uint8 bytes of every parameter and buffer.
"""
from __future__ import annotations

import pytest
import torch


def _layer_bytes(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
        out[name] = t.detach().contiguous().reshape(-1).view(torch.uint8).clone()
    return out


@pytest.fixture
def layer_bytes():
    return _layer_bytes
