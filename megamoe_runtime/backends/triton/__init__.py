"""Triton GPU path: staging kernels and the MoE forward on the kernel-layout bytes.

``TritonBackend`` (registered as ``"triton"``) is importable without triton;
the kernel modules (``staging``, ``moe``) import triton and are loaded only
when a forward runs.
"""
from .backend import TritonBackend

__all__ = ["TritonBackend"]
