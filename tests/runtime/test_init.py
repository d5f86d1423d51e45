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
