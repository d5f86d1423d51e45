"""The layer's backend call as one opaque op for ``torch.compile`` (and so for CUDA graphs).

Why: engines that decode fast compile the model and replay it as a CUDA graph (transformers'
``generate(cache_implementation="static")`` does both by default on a GPU). Dynamo cannot trace a
backend's forward: the triton backend plans its launches in Python and calls Triton kernels, the
deepgemm backend calls an extension. So under ``torch.compile`` the layer hands that call to
``torch.ops.megamoe.routed_experts``, a custom op whose fake implementation gives the output's
shape (bf16 ``[T, H]``, like the input), and the compiled graph calls the real backend at run time.
Outside a compile nothing changes: the layer calls its backend directly.

The op names the layer by an integer handle (custom ops take tensors and scalars, not modules); the
handle table holds weak references, so it never keeps a layer alive.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional

import torch

from ..errors import MegaMoEError

__all__ = ["register", "routed_call"]

_HANDLES: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def register(layer: Any) -> int:
    """A new handle for ``layer`` (called once, at construction, so tracing only reads a plain int)."""
    h = next(_NEXT)
    _HANDLES[h] = layer
    return h


@torch.library.custom_op("megamoe::routed_experts", mutates_args=())
def _routed_experts(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    handle: int, fused_shared: bool) -> torch.Tensor:
    layer = _HANDLES.get(handle)
    if layer is None:  # the compiled graph outlived the layer it was traced for
        raise MegaMoEError(f"megamoe::routed_experts: layer handle {handle} no longer exists (the compiled "
                           "model outlived its megamoe layer); compile the model again")
    y = layer.backend.forward(layer, hidden_states, topk_weights, topk_ids,
                              shared_input=hidden_states if fused_shared else None)
    # a custom op may not return one of its inputs or a view of one
    return y.clone() if y is hidden_states or y._base is not None else y


@_routed_experts.register_fake
def _(hidden_states, topk_weights, topk_ids, handle, fused_shared):
    return hidden_states.new_empty(hidden_states.shape)  # contiguous bf16 [T, H], as every backend returns


def routed_call(layer: Any, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared_input: Optional[torch.Tensor]) -> torch.Tensor:
    """``layer.backend.forward(...)``: directly in eager code, through the custom op under ``torch.compile``.

    ``shared_input`` is either None or ``hidden_states`` itself (the fused shared expert reads the same rows)."""
    if not torch.compiler.is_compiling():
        return layer.backend.forward(layer, hidden_states, topk_weights, topk_ids, shared_input=shared_input)
    if shared_input is not None and shared_input is not hidden_states:
        raise MegaMoEError("under torch.compile the fused shared expert must read the routed input itself")
    return torch.ops.megamoe.routed_experts(hidden_states, topk_weights, topk_ids, layer.op_handle,
                                            shared_input is not None)
