#!/usr/bin/env python
"""Run a script (or pytest, as a plugin) with ``block8.TILES["prefill"]`` set from a JSON file: the tiles a
sweep (``bench/block8_gpu.py sweep``, its ``pin.json``) chose, tried in the same GPU call before they are
written into ``block8.TILES``.

    BLOCK8_PIN=DIR/pin.json python bench/block8_pin.py bench/deepgemm_sm90.py --layer ...
    BLOCK8_PIN=DIR/pin.json PYTHONPATH=$PWD:$PWD/bench python -m pytest -p block8_pin -m gpu tests/...
"""
from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path


def apply() -> None:
    path = os.environ.get("BLOCK8_PIN")
    if not path or not os.path.isfile(path):
        return
    from megamoe_runtime.backends.triton import block8

    with open(path) as f:
        block8.TILES["prefill"] = block8.Block8Config(**json.load(f))
    print(f"block8 prefill tiles pinned from {path}: {block8.TILES['prefill']}", flush=True)


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
apply()

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
