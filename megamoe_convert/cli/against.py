"""``megamoe-convert verify OUT --against SRC``: does a converted folder compute what its source computes?

Every MoE layer of OUT is served (reference backend, CPU) and compared with an fp32 MoE evaluated from
SRC's own tensors (`selfcheck.compare_with_source`: no layout code shared), on the same deterministic
tokens; each layer passes when its ``calc_diff`` is below the row's threshold (`selfcheck.THRESHOLDS`).
The source is read as the conversion read it: the format and any ``--quantize`` row come from OUT's
megamoe.json, so the user names only the two folders.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Union

from megamoe_runtime.format.manifest import read_manifest

from ..testing.selfcheck import THRESHOLDS, compare_with_source

__all__ = ["compare_folder_with_source", "layer_lines"]

#: the format name the converter records for an unquantized source (quantized, if at all, by --quantize)
_UNQUANTIZED = "unquantized"


def compare_folder_with_source(out: Union[str, Path], src: Union[str, Path], *, tokens: int = 16, seed: int = 0,
                               revision: Optional[str] = None) -> dict:
    """{"ok", "source", "format", "quantize", "row", "backend", "tokens", "seed", "thresholds", "layers",
    "seconds"}: one entry per MoE layer (`LayerResult.to_dict`), in order. ``revision``: a hub SRC's."""
    m = read_manifest(out)
    fmt = m.source.format
    quantize = m.row if fmt == _UNQUANTIZED and m.row != "bf16" else None
    t = time.perf_counter()
    results = compare_with_source(src, out, tokens=tokens, seed=seed, format=fmt, quantize=quantize,
                                  revision=revision)
    return {"ok": bool(results) and all(r.ok for r in results), "source": str(src), "format": fmt,
            "quantize": quantize, "row": m.row, "backend": "reference", "tokens": tokens, "seed": seed,
            "thresholds": dict(THRESHOLDS), "layers": [r.to_dict() for r in results],
            "seconds": round(time.perf_counter() - t, 3)}


def layer_lines(layers: list[dict]) -> list[str]:
    """The per-layer table of `LayerResult.to_dict` records: index, module, row, calc_diff against the row's
    threshold, ok or FAIL."""
    width = max((len(r["prefix"]) for r in layers), default=6)
    lines = [f"{'layer':>5}  {'module':<{width}}  {'row':<5}  {'calc_diff':>9}  {'threshold':>9}  result"]
    for r in layers:
        lines.append(f"{r['index']:>5}  {r['prefix']:<{width}}  {r['row']:<5}  {r['calc_diff']:>9.2e}  "
                     f"{r['threshold']:>9.0e}  {'ok' if r['ok'] else 'FAIL'}"
                     + ("  (shared expert fused)" if r["shared_fused"] else ""))
    return lines
