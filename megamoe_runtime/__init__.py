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

__version__ = "0.1.0"

#: What a server calls: build, load, reload-check and run a layer. The error
#: classes live in ``megamoe_runtime.errors`` (``mr.errors.ScaleError``); the
#: row table, codecs, layout and manifest internals in their own modules.
_EXPORTS = {
    # open a converted folder, build and run layers
    "open_checkpoint": "load.checkpoint",
    "Checkpoint": "load.checkpoint",
    "DeepGemmMegaMoEExperts": "layer.experts",
    "MegaMoESharedExpert": "layer.experts",
    # describe a layer
    "LayerSpec": "format.formats",
    "ActivationSpec": "format.formats",
    "SharedSpec": "format.formats",
    # raw (unconverted) checkpoints, vLLM style
    "make_expert_params_mapping": "layer.loaders",
    "load_raw_weights": "load.raw_load",
    # reload safety
    "verify_reload": "load.reload",
    "dry_run_checkpoint": "load.reload",
    "ReloadReport": "load.reload",
    # backends
    "get_backend": "backends",
    "register_backend": "backends",
    "Backend": "backends",
    # comparing forwards
    "calc_diff": "testing",
    # the base error (every megamoe error is one; the others are in ``errors``)
    "MegaMoEError": "errors",
}
__all__ = sorted(_EXPORTS) + ["errors", "__version__"]


def __getattr__(name: str) -> object:
    if name == "errors":
        value: object = importlib.import_module(f"{__name__}.errors")
    else:
        mod = _EXPORTS.get(name)
        if mod is None:
            raise AttributeError(f"module 'megamoe_runtime' has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
