"""Run a test module's kernels under Triton's CPU interpreter, in a fresh process.

Why a process of its own: ``TRITON_INTERPRET`` is read when triton is imported, and the rest of the suite
runs with it unset (the sm_90 compile tests need the real JIT). Shared by the triton backend's interpreter
tests, so that the environment and the one known interpreter limit below are handled in one place.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[3]


def interpreted_output(test_file: str, expr: str, timeout: int) -> str:
    """The last line the module at ``test_file`` prints for ``print(expr)``, with the module bound to ``m``
    (and ``json`` imported), run with ``TRITON_INTERPRET=1`` and no GPU visible. Skips where triton's
    interpreter cannot run the kernels at all; fails with the child's stderr on any other error."""
    pytest.importorskip("triton")
    code = ("import importlib.util, json, sys; s = importlib.util.spec_from_file_location('t', sys.argv[1]); "
            f"m = importlib.util.module_from_spec(s); s.loader.exec_module(m); print({expr})")
    # the module's own folder first, as pytest puts it (test modules import their siblings, this one included)
    path = os.pathsep.join(p for p in (str(Path(test_file).parent), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-c", code, str(test_file)], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=_ROOT)
    if r.returncode and "only 0-dimensional arrays can be converted to Python scalars" in r.stderr:
        # triton's CPU interpreter (3.6) holds a runtime scalar argument as a 1-element array and takes int() of
        # it for range(); numpy >= 2.4 refuses that. The kernels run on the GPU tests either way.
        import numpy as np
        import triton

        pytest.skip(f"triton {triton.__version__}'s interpreter cannot take range() over a scalar argument with "
                    f"numpy {np.__version__}")
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]
