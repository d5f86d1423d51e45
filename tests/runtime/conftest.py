"""Runtime fixtures: synthetic source checkpoints (megamoe_convert.synth) and
their conversions, built once per session and shared read-only.

* ``ckpts.source(fmt, **kw)``: a synthetic checkpoint in source format ``fmt``.
* ``ckpts.converted(fmt, ep_size=1, **kw)``: ``(source_dir, converted_dir)``.
* ``ckpts.fresh_converted(fmt, path, ...)``: a private conversion a test may damage.
* ``layer_bytes(layer)``: name -> uint8 bytes of every parameter and buffer.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

SMALL = dict(num_layers=2, hidden=256, intermediate=128, num_experts=8, top_k=2)


def _key(*parts: Any) -> str:
    return json.dumps(parts, sort_keys=True, default=str)


class _Store:
    def __init__(self, base: Path):
        self.base = base
        self._src: dict[str, Path] = {}
        self._conv: dict[str, tuple[Path, Path]] = {}
        self._n = 0

    def source(self, fmt: str, **kw: Any) -> Path:
        from megamoe_convert.synth import build_synthetic_checkpoint

        args = {**SMALL, **kw}
        k = _key(fmt, args)
        if k not in self._src:
            self._src[k] = build_synthetic_checkpoint(self.base / f"src{len(self._src):03d}-{fmt}", fmt, **args)
        return self._src[k]

    def converted(self, fmt: str, ep_size: int = 1, **kw: Any) -> tuple[Path, Path]:
        from megamoe_convert.convert import convert

        k = _key(fmt, ep_size, {**SMALL, **kw})
        if k not in self._conv:
            src = self.source(fmt, **kw)
            self._n += 1
            out = self.base / f"out{self._n:03d}-{fmt}-ep{ep_size}"
            convert(src, out, ep_size=ep_size)
            self._conv[k] = (src, out)
        return self._conv[k]

    def fresh_converted(self, fmt: str, path: Path, ep_size: int = 1, **kw: Any) -> tuple[Path, Path]:
        from megamoe_convert.convert import convert

        src = self.source(fmt, **kw)
        convert(src, path, ep_size=ep_size)
        return src, path


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> _Store:
    return _Store(tmp_path_factory.mktemp("runtime-ckpts"))


def _layer_bytes(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
        out[name] = t.detach().contiguous().reshape(-1).view(torch.uint8).clone()
    return out


@pytest.fixture
def layer_bytes():
    return _layer_bytes
