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


def test_only_the_public_names_resolve():
    """No compatibility aliases: a name outside ``__all__`` is imported from its module."""
    import pytest

    for name in ("get_row", "ROWS", "Manifest", "FORMAT_VERSION", "ScaleError", "LayerInfo", "SafetensorsFile",
                 "parse_expert_weight_name"):
        with pytest.raises(AttributeError):
            getattr(mr, name)


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
    """checkpoint -> layer -> loaders -> file_io only: no module imports one above it, even lazily (verify and
    load_checks sit above the layer: the spec check builds a meta layer)."""
    import ast
    from pathlib import Path

    pkg = Path(mr.__file__).parent
    where = {"verify": "load.verify", "checkpoint": "load.checkpoint", "load_checks": "load.load_checks",
             "layer": "layer.experts", "loaders": "layer.loaders", "file_io": "files.file_io"}
    below = {"verify": {"checkpoint", "layer", "load_checks", "loaders", "file_io"},
             "checkpoint": {"layer", "load_checks", "loaders", "file_io"}, "load_checks": {"loaders", "file_io"},
             "layer": {"loaders", "file_io"}, "loaders": {"file_io"}, "file_io": set()}
    for mod, allowed_below in below.items():
        name = f"megamoe_runtime.{where[mod]}"
        tree = ast.parse((pkg / (where[mod].replace(".", "/") + ".py")).read_text())
        typing_only = {id(n) for blk in ast.walk(tree) if isinstance(blk, ast.If)
                       and getattr(blk.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(blk)}
        imported = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and id(n) not in typing_only:
                base = name.split(".")[:-n.level] if n.level else []
                target = ".".join(base + ([n.module] if n.module else []))
                imported |= {target} | {f"{target}.{a.name}" for a in n.names}
        above = {m for m in set(below) - allowed_below - {mod} if f"megamoe_runtime.{where[m]}" in imported}
        assert above == set(), f"{mod} imports {sorted(above)}, which sit above it"
