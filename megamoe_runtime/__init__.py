"""megamoe runtime: DeepGEMM MegaMoE layer, kernel-layout contract and numerics.

    import megamoe_runtime as mr
    ckpt = mr.open_checkpoint(out_dir)          # reads and validates megamoe.json
    layer = ckpt.build_layer(layer_index, device="cpu", backend="reference", ep_rank=0, ep_size=1)
    y = layer(hidden_states, topk_weights, topk_ids)
    report = mr.verify_reload(layer, out_dir)   # meta-tensor dry run of a reload

Public names are imported lazily (PEP 562), so ``import megamoe_runtime`` stays
cheap at serve time and never imports torch.distributed, triton or deep_gemm
until they are used.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # checkpoint / layer / reload
    "open_checkpoint": "checkpoint",
    "Checkpoint": "checkpoint",
    "LayerInfo": "checkpoint",
    "SafetensorsFile": "checkpoint",
    "DeepGemmMegaMoEExperts": "layer",
    "MegaMoESharedExpert": "layer",
    "verify_reload": "reload",
    "dry_run_checkpoint": "reload",
    "ReloadReport": "reload",
    # loaders
    "make_expert_params_mapping": "loaders",
    "parse_expert_weight_name": "loaders",
    "load_raw_weights": "loaders",
    # formats
    "LayerSpec": "formats",
    "ActivationSpec": "formats",
    "SharedSpec": "formats",
    "Row": "formats",
    "WeightSpec": "formats",
    "ROWS": "formats",
    "get_row": "formats",
    # backends
    "get_backend": "backends",
    "register_backend": "backends",
    "Backend": "backends",
    # manifest
    "read_manifest": "manifest",
    "Manifest": "manifest",
    "FORMAT_VERSION": "manifest",
    # errors
    "MegaMoEError": "errors",
    "FormatError": "errors",
    "LayerSpecError": "errors",
    "LayoutError": "errors",
    "ManifestError": "errors",
    "CheckpointError": "errors",
    "ScaleError": "errors",
    "ReloadError": "errors",
    "BackendUnavailableError": "errors",
    # numerics helper
    "calc_diff": "testing",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'megamoe_runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
