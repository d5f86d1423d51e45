"""Triton GPU path: staging kernels and the MoE forward on the kernel-layout bytes.

``TritonBackend`` (registered as ``"triton"``) is importable without triton;
the kernel modules import triton and are loaded only when a forward runs. One
job per module: ``staging`` (dispatch quantizers, routing plan), ``configs``
(tile configs and regimes), ``operands`` (the operand tiles the GEMMs share),
``l1`` (gate/up GEMM and epilogue), ``l2`` (down GEMM and combine), ``launch``
(host-side launch arguments), ``decode_check`` (the inline-asm decodes'
self-check), ``bit_order`` (the tiled E2M1 bit order, one kernel the layer's
tiling passes copy through), ``mma8`` (the FP8 tensor-core path), ``moe``
(``moe_forward``: the checks, staging, launches and fold flags of one forward).
"""
from .backend import TritonBackend

__all__ = ["TritonBackend"]
