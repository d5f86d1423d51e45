"""`megamoe-convert demo`: build a tiny synthetic checkpoint, convert, verify, serve and compare, in one folder.

``--keep DIR`` leaves the folders in DIR for the next steps a user tries (inspect, convert, from_pretrained).
Running it again refreshes DIR: the demo writes a marker (`_MARKER`) listing every file it wrote, and removes
those folders again only while the marker proves they are still exactly what it wrote (same files, same
sizes). A folder it did not write, or one whose files changed since, is never touched: the run is refused
naming it.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable

from megamoe_runtime.errors import MegaMoEError

__all__ = ["prepare_keep", "run_demo"]

#: the sizes of the demo's synthetic checkpoint
_DEMO_SIZES = dict(num_layers=2, hidden=256, intermediate=256, num_experts=8, top_k=2)

#: what the demo writes into its folder: the synthetic source, its conversion, and the transformers step's
_FOLDERS = ("source", "converted", "hf-source", "hf-converted")

#: the file in a kept demo folder listing what the demo wrote there
_MARKER = ".megamoe-demo.json"


def _listing(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` (relative path -> size)."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def prepare_keep(root: Path) -> None:
    """Make ``root`` ready for a demo run: created if missing; an earlier demo's folders removed when its
    marker proves they are unchanged; MegaMoEError naming every folder the demo would need but did not
    write (or that changed since), touching nothing."""
    marker = root / _MARKER
    written: dict[str, dict[str, int]] = {}
    if marker.is_file():
        try:
            written = json.loads(marker.read_text()).get("written", {})
        except (ValueError, AttributeError, OSError) as e:
            raise MegaMoEError(f"{marker}: unreadable demo marker ({e}); remove {root} or pick another --keep "
                               "folder") from None
    blocked = []
    for name in _FOLDERS:
        p = root / name
        if not p.exists() and not p.is_symlink():
            continue
        if name not in written or p.is_symlink() or not p.is_dir():
            blocked.append(f"{p} (not written by the demo)")
        elif _listing(p) != written[name]:
            blocked.append(f"{p} (changed since the demo wrote it)")
    if blocked:
        raise MegaMoEError(f"--keep {root}: the demo writes {', '.join(_FOLDERS)} there and would replace "
                           f"{'; '.join(blocked)}; move them away or pick another --keep folder")
    for name in _FOLDERS:
        if (root / name).exists():
            shutil.rmtree(root / name)
    marker.unlink(missing_ok=True)
    root.mkdir(parents=True, exist_ok=True)


def _record(root: Path) -> None:
    """The marker: every file of every demo folder, as written (what `prepare_keep` checks next time)."""
    written = {name: _listing(root / name) for name in _FOLDERS if (root / name).is_dir()}
    (root / _MARKER).write_text(json.dumps({"written_by": "megamoe-convert demo", "written": written}, indent=1)
                               + "\n")


def run_demo(root: Path, fmt: str, ep_size: int, tokens: int = 16,
             log: Callable[[str], None] = lambda m: None) -> dict:
    """Build, convert, verify and compare in ``root`` (empty, or prepared by `prepare_keep`); then the
    transformers step (`demo_generate`). The result dict the CLI prints (and dumps with --json)."""
    from megamoe_runtime.load.verify import verify_output

    from ..testing import synth
    from ..pipeline.convert import convert as do_convert
    from .demo_generate import demo_generate
    from ..testing.selfcheck import compare_with_source

    src, out = root / "source", root / "converted"
    try:
        synth.build_synthetic_checkpoint(src, fmt, **_DEMO_SIZES, seed=0)
        s = do_convert(src, out, ep_size=ep_size, log=log)
        v = verify_output(out)
        t = time.perf_counter()
        layers = compare_with_source(src, out, tokens=tokens, seed=0)
        compare = {"backend": "reference", "tokens": tokens, "seed": 0, "ok": all(r.ok for r in layers),
                   "layers": [r.to_dict() for r in layers], "seconds": round(time.perf_counter() - t, 3)}
        generate = demo_generate(root, log=lambda m: None)
    finally:
        _record(root)
    return {"ok": v.ok and compare["ok"] and generate["ok"], "format": fmt, "src": str(src), "out": str(out),
            "layers": _DEMO_SIZES["num_layers"], "experts_per_layer": _DEMO_SIZES["num_experts"],
            "hidden": _DEMO_SIZES["hidden"], "intermediate": _DEMO_SIZES["intermediate"],
            "convert": s.to_dict(), "verify": v.to_dict(), "compare": compare, "generate": generate}
