"""The MoE block transformers runs once its routed experts are a megamoe layer.

transformers' MoE blocks (DeepSeek-V2/V3 and Kimi-K2, GLM-4 MoE, Qwen3-MoE, Mixtral) share one shape: a
router module ``gate`` whose forward returns ``(logits, top-k weights, top-k ids)``, an ``experts`` module
called with those, and for some a ``shared_experts`` MLP added afterwards. `MegaMoEBlock` keeps the
router exactly as transformers has it (its parameters load under the same names) and replaces the rest with
one `DeepGemmMegaMoEExperts`, which runs the routed experts and, when the checkpoint has one, the shared
expert (fused into the same launch where the backend can, else added once by the layer).

Routed scaling: DeepGEMM's kernels apply ``routed_scaling_factor`` themselves (the layer's spec carries
the manifest's value), while transformers' DeepSeek/GLM routers multiply their weights by it. The router's
own factor is therefore checked against the manifest and set to 1.0, so it is applied exactly once, where
the kernels apply it (docs/ENGINES.md#routed-scaling).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from ...errors import CheckpointError, MegaMoEError

__all__ = ["MOE_BLOCKS", "MegaMoEBlock", "is_moe_block", "adapt_router"]

#: transformers MoE block class -> whether it adds a shared expert (the architectures the integration knows)
MOE_BLOCKS = {
    "DeepseekV3MoE": True,  # DeepSeek-V3 / R1, Kimi-K2 (model_type deepseek_v3)
    "DeepseekV2Moe": True,
    "Glm4MoeMoE": True,
    "Qwen3MoeSparseMoeBlock": False,
    "MixtralSparseMoeBlock": False,
}


def is_moe_block(module: nn.Module) -> bool:
    return type(module).__name__ in MOE_BLOCKS


def adapt_router(router: nn.Module, where: str, routed_scaling_factor: float) -> None:
    """Make the router return unscaled top-k weights (the layer applies the manifest's factor).

    CheckpointError when the router's own factor is not the manifest's: the folder was converted from
    another model config, and serving it would scale every routed expert wrongly."""
    own = getattr(router, "routed_scaling_factor", None)
    if own is None:
        if not math.isclose(routed_scaling_factor, 1.0, rel_tol=0, abs_tol=0):
            raise CheckpointError(f"{where}: megamoe.json has routed_scaling_factor {routed_scaling_factor} but "
                                  f"transformers' {type(router).__name__} has none (the model applies 1.0)")
        return
    if float(own) != float(routed_scaling_factor):
        raise CheckpointError(f"{where}: routed_scaling_factor is {own} in config.json but "
                              f"{routed_scaling_factor} in megamoe.json")
    router.routed_scaling_factor = 1.0


class MegaMoEBlock(nn.Module):
    """A transformers MoE block whose experts (and shared expert) run as one megamoe layer.

    ``gate`` is transformers' router module, unchanged but for its routed scaling (see the module doc);
    ``megamoe`` is the `DeepGemmMegaMoEExperts` built and loaded from the folder after transformers loaded
    the other weights (None until then), so its parameters' names are the folder's tensor names."""

    def __init__(self, gate: nn.Module, layer_index: int, source_class: str,
                 shared_experts: Optional[nn.Module] = None):
        super().__init__()
        self.gate = gate
        #: transformers' shared-expert MLP when the layer does not fuse it (loaded from the pass-through
        #: tensors under its own names), added to the routed output as transformers' block adds it
        self.shared_experts = shared_experts
        self.layer_index = layer_index
        self.source_class = source_class
        self.register_module("megamoe", None)

    def extra_repr(self) -> str:
        return f"layer_index={self.layer_index}, replaces={self.source_class}"

    def attach(self, layer: nn.Module) -> None:
        self.megamoe = layer

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        layer: Optional[Any] = self.megamoe
        if layer is None:
            raise MegaMoEError(f"MoE layer {self.layer_index}: its megamoe experts were never loaded (the model was "
                               "built without from_pretrained on a megamoe folder)")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, ids = self.gate(x)
        y = layer(x.to(torch.bfloat16), weights.to(torch.float32), ids).to(hidden_states.dtype).reshape(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(hidden_states)
        return y
