"""``TritonBackend``: the Backend protocol (ARCHITECTURE.md) over the Triton kernels.

Importing this module does not import triton; the kernels are imported on
first use, so the registry can say why the backend cannot run (no triton, no
CUDA, a GPU older than sm_89, which lacks the E4M3 conversions).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Optional, Union

import torch

from megamoe_runtime.errors import BackendUnavailableError, MegaMoEError, install_hint
from megamoe_runtime.format.roles import KERNEL_ROLES, SHARED_PREFIX, shared_role

__all__ = ["TritonBackend", "local_pair_problem"]

_MIN_CAPABILITY = (8, 9)


class _Roles:
    def __init__(self, layer: Any, prefix: str):
        for role in KERNEL_ROLES:
            setattr(self, role, getattr(layer, prefix + role, None))


class _NvScalars:
    def __init__(self, layer: Any):
        self.l1_alpha = layer.l1_alpha
        self.l2_global_scale = layer.l2_global_scale
        self.l2_activation_scale = getattr(layer, "l2_activation_scale")


def local_pair_problem(spec: Any, ids: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """The spec and expert ids of an EP pair compute (``TritonBackend.pairs``) as the one-rank problem it is:
    every received pair belongs to this rank, so the rank's ``E_l`` experts are the whole layer (ids made
    local, one slot per row, no shared expert). With the EP spec the tile rule would read the pairs as the
    whole batch's and expect only ``E_l / num_experts`` of them here (``configs.local_pairs``, right for a
    rank that sees every token's ids), picking tiles for ``ep_size`` times fewer pairs than it gets."""
    E_l = spec.experts_per_rank
    one = dataclasses.replace(spec, top_k=1, shared=None, num_experts=E_l, ep_rank=0, ep_size=1)
    return one, ids - spec.ep_rank * E_l


class TritonBackend:
    """Triton MoE forward on the kernel-layout bytes (CUDA, sm_89+; tuned on H200).

    Computes the reference backend's numerics (docs/NUMERICS.md) for
    every row (mxfp4, mxfp8, nvfp4, bf16), swiglu (clamp, alpha, beta) and
    situ, NVFP4 alphas and a2, routed scaling, and the fused shared expert of
    every precision the row allows. Only the fp32 accumulation order of the
    GEMMs differs from the reference.
    """

    name = "triton"

    def __init__(self, device: Union[str, torch.device, None] = None, config: Any = None):
        self.device = torch.device(device) if device is not None else None
        self.config = config

    @staticmethod
    def available(device: Union[str, torch.device, None] = None) -> Union[bool, str]:
        if importlib.util.find_spec("triton") is None:
            return f"triton is not installed ({install_hint('gpu')})"
        dev = torch.device(device) if device is not None else torch.device("cuda")
        if dev.type != "cuda" or not torch.cuda.is_available():
            return "the triton backend needs a CUDA device"
        cap = torch.cuda.get_device_capability(dev)
        if cap < _MIN_CAPABILITY:
            return (f"the triton backend needs compute capability >= {_MIN_CAPABILITY[0]}.{_MIN_CAPABILITY[1]} "
                    f"(E4M3 conversions); this GPU is {cap[0]}.{cap[1]}")
        return True

    def supports(self, spec: Any) -> Union[bool, str]:
        from .configs import ROW_W_KIND

        if spec.row not in ROW_W_KIND:
            return f"row {spec.row!r} is not implemented by the triton backend"
        if spec.hidden % 128 or spec.intermediate % 128:
            return f"hidden={spec.hidden} and intermediate={spec.intermediate} must be multiples of 128"
        if spec.shared is not None and spec.shared.folded_intermediate % 128:
            return "the folded shared intermediate must be a multiple of 128"
        return True

    def weight_tiles(self, spec: Any, device: Any) -> int:
        """Rows per tile of the in-memory weight arrangement this backend reads fastest (the layer
        derives it after each load, `megamoe_runtime.format.weight_tiles`); 0 keeps the converted layout."""
        from .configs import resolve_w_tile

        return resolve_w_tile(spec, device, self.config)

    def copy_e2m1_bits(self, src: Any, dst: Any, to_tiled: bool) -> None:
        """The tiled arrangement's E2M1 bit permutation as one pass on the GPU (``weight_tiles.CopyBits``):
        the layer's tiling passes copy through it."""
        from .bit_order import copy_e2m1_bits

        copy_e2m1_bits(src, dst, to_tiled)

    def weights_changing(self, layer: Any) -> None:
        """A load is about to write the weights: the fold flags no longer describe them, so the kernels
        go back to scanning each tile's scales (``FOLD_SCAN``) until `weights_loaded`. In place: a
        captured CUDA graph reads the flags' storage."""
        from .operands import FOLD_SCAN

        flags = getattr(layer, "triton_fold_flags", None)
        if flags is not None and getattr(layer, "_triton_fold_flags_set", False):
            flags.fill_(FOLD_SCAN)
            layer._triton_fold_flags_set = False

    def weights_loaded(self, layer: Any) -> None:
        """After a successful load: per expert, whether the fold decode takes all its scale bytes
        (`moe.fold_flags`), so the kernels read one flag per tile instead of scanning the tile's scale
        words after the main loop. Computed on the device (no host sync) into the same storage on
        every reload."""
        from .moe import fold_flags

        if layer.device.type != "cuda":
            return
        flags = getattr(layer, "triton_fold_flags", None)
        shape = (2, layer.spec.experts_per_rank)
        if flags is None or tuple(flags.shape) != shape or flags.device != layer.device:
            flags = torch.empty(shape, dtype=torch.int32, device=layer.device)
            layer.triton_fold_flags = flags
        fold_flags(layer.spec, _Roles(layer, ""), out=flags)
        layer._triton_fold_flags_set = True

    def supports_fused_shared(self, spec: Any) -> bool:
        if spec.shared is None:
            return False
        ok, _ = spec.row_spec.can_fuse_shared(spec.shared.precision)
        return bool(ok)

    def pairs(self, layer: Any, rows: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert side of an EP forward (`megamoe_runtime.layer.ep`): bf16 ``[N, H]``
        slot outputs of (row, raw top-k weight, global expert id) pairs owned
        by this rank: the routed part of the forward with one slot per row."""
        if rows.device.type != "cuda":
            raise BackendUnavailableError("the triton backend runs on CUDA tensors only")
        from .moe import moe_forward

        spec, local_ids = local_pair_problem(layer.spec, ids)
        scalars = _NvScalars(layer) if spec.row_spec.has_alphas else None
        _, slots = moe_forward(spec, _Roles(layer, ""), rows, weights.reshape(-1, 1), local_ids.reshape(-1, 1),
                               scalars=scalars, config=self.config, return_slots=True,
                               w_tile=getattr(layer, "weight_tiles", 0), fold_flags=_fold_flags(layer))
        return slots[:, 0]

    def shared_slot(self, layer: Any, shared_input: torch.Tensor) -> torch.Tensor:
        """The fused shared expert's bf16 slot (column K) on ``shared_input``."""
        if getattr(layer, shared_role("l1_weight"), None) is None:
            raise MegaMoEError("the layer holds no fused shared expert tensors (shared_l1_weight is missing)")
        from .moe import moe_forward

        spec = layer.spec
        t, k = shared_input.shape[0], spec.top_k
        ids = torch.full((t, k), -1, dtype=torch.int64, device=shared_input.device)  # no routed pair
        w = torch.zeros(t, k, dtype=torch.float32, device=shared_input.device)
        scalars = _NvScalars(layer) if spec.row_spec.has_alphas else None
        _, slots = moe_forward(spec, _Roles(layer, ""), shared_input, w, ids, scalars=scalars,
                               shared=_Roles(layer, SHARED_PREFIX), config=self.config, return_slots=True,
                               shared_input=shared_input, w_tile=getattr(layer, "weight_tiles", 0),
                               fold_flags=_fold_flags(layer))
        return slots[:, k]

    def forward(self, layer: Any, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, shared_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        """bf16 ``[T, H]``. The fused shared expert (slot K) runs exactly when
        ``shared_input`` is given, on that input (as the reference backend)."""
        if hidden_states.device.type != "cuda":
            raise BackendUnavailableError("the triton backend runs on CUDA tensors only")
        spec = layer.spec
        shared = None
        if shared_input is not None:
            if getattr(layer, shared_role("l1_weight"), None) is None:
                raise MegaMoEError("shared_input was given but the layer holds no fused shared expert "
                                   "tensors (shared_l1_weight is missing); pass shared_input=None and "
                                   "run the shared expert outside")
            shared = _Roles(layer, SHARED_PREFIX)
        scalars = _NvScalars(layer) if spec.row_spec.has_alphas else None
        from .moe import moe_forward

        return moe_forward(spec, _Roles(layer, ""), hidden_states, topk_weights, topk_ids,
                           scalars=scalars, shared=shared, config=self.config, shared_input=shared_input,
                           w_tile=getattr(layer, "weight_tiles", 0), fold_flags=_fold_flags(layer))


def _fold_flags(layer: Any) -> Optional[torch.Tensor]:
    """The layer's fold flags where `TritonBackend.weights_loaded` made them for its device; None: the
    kernels scan the scales themselves."""
    flags = getattr(layer, "triton_fold_flags", None)
    if flags is None or flags.device != layer.device:
        return None
    return flags
