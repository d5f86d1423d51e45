"""The package's public surface: what a server calls, and nothing it must not pay for."""
from __future__ import annotations

import subprocess
import sys

import megamoe_runtime as mr
from megamoe_runtime import errors

PUBLIC = {
    "open_checkpoint", "Checkpoint", "DeepGemmMegaMoEExperts", "MegaMoESharedExpert",
    "LayerSpec", "ActivationSpec", "SharedSpec", "make_expert_params_mapping", "load_raw_weights",
    "verify_reload", "dry_run_checkpoint", "ReloadReport", "get_backend", "register_backend", "Backend",
    "calc_diff", "MegaMoEError",
}


def test_all_is_the_user_surface():
    assert set(mr.__all__) == PUBLIC | {"errors", "__version__"}
    for name in PUBLIC:
        assert getattr(mr, name) is not None
    assert mr.errors is errors and issubclass(mr.errors.ScaleError, mr.MegaMoEError)


def test_names_exported_before_still_resolve():
    """Narrowing __all__ breaks no caller: the old names resolve to the same objects."""
    from megamoe_runtime.format import formats, manifest

    assert mr.ScaleError is errors.ScaleError and mr.LayoutError is errors.LayoutError
    assert mr.get_row is formats.get_row and mr.FORMAT_VERSION == manifest.FORMAT_VERSION


def test_unknown_name_is_an_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mr.nope  # noqa: B018


def test_import_stays_cheap():
    code = ("import sys, megamoe_runtime as mr; mr.open_checkpoint; mr.DeepGemmMegaMoEExperts; mr.verify_reload; "
            "print(sorted(m for m in ('triton', 'deep_gemm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_import_cycle_between_checkpoint_layer_and_loaders():
    """checkpoint -> layer -> load_checks -> loaders -> file_io only: no module imports one above it, even
    lazily (verify sits above them all: its spec check builds a meta layer)."""
    import ast
    from pathlib import Path

    pkg = Path(mr.__file__).parent
    below = {"verify": {"checkpoint", "layer", "load_checks", "loaders", "file_io"},
             "checkpoint": {"layer", "load_checks", "loaders", "file_io"}, "layer": {"load_checks", "loaders", "file_io"},
             "load_checks": {"loaders", "file_io"}, "loaders": {"file_io"}, "file_io": set()}
    for mod, allowed_below in below.items():
        tree = ast.parse((pkg / ("files/file_io.py" if mod == "file_io" else f"{mod}.py")).read_text())
        typing_only = {id(n) for blk in ast.walk(tree) if isinstance(blk, ast.If)
                       and getattr(blk.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(blk)}
        imported = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.level == 1 and id(n) not in typing_only:
                imported |= {n.module.split(".")[0]} if n.module else {a.name for a in n.names}
        above = (set(below) - allowed_below - {mod}) & imported
        assert above == set(), f"{mod} imports {sorted(above)}, which sit above it"
