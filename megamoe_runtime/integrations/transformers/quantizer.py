"""`MegaMoEHfQuantizer`: transformers' ``from_pretrained`` on a megamoe output folder.

transformers calls a quantizer twice around its own weight loading (quantizers/base.py):

* before (the model is on the meta device): the folder is checked against the model config
  (`integrations.folder.check_folder_for_model`: manifest, sizes, a meta-tensor dry run of every expert
  shard) -- so bad input fails before one weight is allocated -- then every MoE block at a manifest layer
  becomes a `MegaMoEBlock` holding transformers' router, quantized non-expert linears become
  `PendingLinear` stand-ins, and the folder's expert tensors are named to transformers as keys to skip.
  transformers then loads the router, attention, norms and embeddings as it always does.
* after: each MoE layer is built on the device transformers put its router on and loaded in place from the
  shards (`Checkpoint.build_layer`: one copy per stored tensor, no transform, the layer's all-or-nothing
  checks), and each pending linear is decoded into the model's dtype (`integrations.dense`).

Nothing is written into the folder. The experts never exist in a checkpoint format in memory: the layer's
parameters are allocated once, in kernel layout, and the files are read into them.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer

from ...errors import CheckpointError
from ...format.source_formats import is_quantized_linear
from ..dense import decode_linear_weight
from ..folder import check_folder_for_model, weights_folder
from ..warm import seed_for_folder
from .blocks import MOE_BLOCKS, MegaMoEBlock, adapt_router, is_moe_block

__all__ = ["MegaMoEHfQuantizer", "PendingLinear"]


class PendingLinear(nn.Module):
    """A non-expert ``nn.Linear`` whose weight is stored quantized in the folder: no weight parameter (so
    transformers neither expects nor casts it), replaced by a float ``nn.Linear`` after loading."""

    def __init__(self, linear: nn.Linear, name: str, tensors: dict[str, str]):
        super().__init__()
        self.in_features, self.out_features, self.name = linear.in_features, linear.out_features, name
        self.tensors = tensors  # suffix -> file
        self.bias = linear.bias  # a bias is stored in float and loaded by transformers as usual

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - replaced before any forward
        raise CheckpointError(f"{self.name}: its quantized weight was never decoded (load through from_pretrained)")


class MegaMoEHfQuantizer(HfQuantizer):
    """The ``megamoe`` method: pre-laid-out expert shards loaded in place; see the module doc."""

    requires_calibration = False

    def __init__(self, quantization_config: Any, **kwargs: Any):
        super().__init__(quantization_config, **kwargs)
        self.checkpoint: Optional[Any] = None
        self.blocks: dict[str, MegaMoEBlock] = {}
        self.pending: dict[str, PendingLinear] = {}

    # ------------------------------------------------------------------ transformers' hooks

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        if not self.pre_quantized:
            raise ValueError("megamoe loads folders written by `megamoe-convert convert`; it cannot quantize a model "
                             "at load time (convert the checkpoint first)")

    def update_dtype(self, dtype: Optional[torch.dtype]) -> torch.dtype:
        return torch.bfloat16 if dtype is None else dtype  # the kernels take bf16 activations

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return False  # the converted folder is the serialized form; save_pretrained would not round-trip it

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        # the layer's backend call is one custom op under torch.compile (layer/compiled.py), so generate's
        # static-cache compile (and its CUDA graphs on a GPU) may take the whole model
        return True

    def _process_model_before_weight_loading(self, model: nn.Module, checkpoint_files: Optional[list] = None,
                                             **kwargs: Any) -> nn.Module:
        if not checkpoint_files:
            raise CheckpointError("megamoe: from_pretrained found no weight files to load the folder from")
        folder = weights_folder(checkpoint_files, getattr(model.config, "name_or_path", None))
        _fetch_manifest_from_hub(folder, getattr(model.config, "name_or_path", None))
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        cfg = config.to_dict()
        cfg["quantization_config"] = self.quantization_config.to_dict()
        # transformers builds the model under a meta-device context; the checks' own small tensors (the dry
        # run's bookkeeping) are real
        with torch.device("cpu"):
            ckpt = check_folder_for_model(folder, cfg, verify=self.quantization_config.verify)
        self.checkpoint = ckpt
        seed_for_folder(folder)  # a shipped kernel cache into triton's, before any kernel compiles (integrations/warm.py)
        ignore: set[str] = set()
        for li in ckpt.layers:
            path = _module_path(model, li.prefix)
            if path is None:
                raise CheckpointError(f"{folder}: megamoe.json has MoE layer {li.index} at {li.prefix!r}, which "
                                      f"{type(model).__name__} does not have")
            block = model.get_submodule(path)
            name = type(block).__name__
            if not is_moe_block(block):
                raise CheckpointError(
                    f"{folder}: {li.prefix} is a {name} in {type(model).__name__}, not a MoE block the megamoe "
                    f"integration knows ({', '.join(sorted(MOE_BLOCKS))})")
            has_shared = MOE_BLOCKS[name]
            outside = None
            if has_shared and li.spec.shared is None and ckpt.manifest.layer(li.index).shared.get("present"):
                outside = block.shared_experts  # not fused (e.g. the fp8_block row): runs as transformers' MLP
            elif has_shared != (li.spec.shared is not None):
                raise CheckpointError(
                    f"{folder}: layer {li.index}: transformers' {name} {'adds' if has_shared else 'has no'} a shared "
                    f"expert but megamoe.json's layer {'has none' if has_shared else 'has one'}")
            adapt_router(block.gate, f"{folder}: layer {li.index} ({li.prefix})", li.spec.routed_scaling_factor)
            new = MegaMoEBlock(block.gate, li.index, name, shared_experts=outside)
            model.set_submodule(path, new)
            self.blocks[path] = new
            ignore |= {"^" + re.escape(p + ".megamoe.") for p in (li.prefix, path)}
        missed = [n for n, m in model.named_modules() if is_moe_block(m)]
        if missed:
            raise CheckpointError(f"{folder}: MoE blocks {missed[:4]} have no converted experts in megamoe.json "
                                  "(their experts would be random): convert the whole model")
        ignore |= self._plan_pending_linears(model, ckpt)
        model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | ignore
        return model

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        ckpt = self.checkpoint
        backend = self.quantization_config.backend
        for prefix, block in self.blocks.items():
            device = block.gate.weight.device
            if device.type == "meta":
                raise CheckpointError(f"{prefix}: offloaded to disk by the device map; megamoe layers must live on "
                                      "a device (give them a GPU or the CPU in device_map)")
            block.attach(ckpt.build_layer(block.layer_index, device=device, backend=backend))
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
        for name, pending in self.pending.items():
            self._decode_pending(model, name, pending, dtype)
        self.pending = {}
        return model

    # ------------------------------------------------------------------ non-expert linears

    def _plan_pending_linears(self, model: nn.Module, ckpt: Any) -> set[str]:
        """Quantized non-expert linears -> `PendingLinear`; the regexes of their stored tensors to skip."""
        by_module: dict[str, dict[str, Any]] = {}
        for te in ckpt.manifest.tensors.values():
            if te.role == "passthrough" and "." in te.name:
                mod, suffix = te.name.rsplit(".", 1)
                by_module.setdefault(mod, {})[suffix] = te
        ignore: set[str] = set()
        for mod, entries in sorted(by_module.items()):
            if not is_quantized_linear({s: te.dtype for s, te in entries.items()}):
                continue
            try:
                linear = model.get_submodule(mod)
            except AttributeError:
                continue  # not part of this model class (transformers reports it as unexpected)
            if not isinstance(linear, nn.Linear):
                raise CheckpointError(f"{ckpt.root}: {mod} is stored quantized but is a {type(linear).__name__} in "
                                      f"{type(model).__name__}, not a linear layer")
            stored = {s: te.file for s, te in entries.items() if s != "bias"}
            pending = PendingLinear(linear, mod, stored)
            model.set_submodule(mod, pending)
            self.pending[mod] = pending
            ignore |= {"^" + re.escape(f"{mod}.{s}") + "$" for s in stored}
        return ignore

    def _decode_pending(self, model: nn.Module, name: str, pending: PendingLinear, dtype: torch.dtype) -> None:
        from safetensors import safe_open

        device = _device_near(model, name)
        tensors = {}
        for file in sorted(set(pending.tensors.values())):  # each file opened once per linear
            with safe_open(str(self.checkpoint.path_of(file)), "pt", device="cpu") as f:
                for suffix in (s for s, fl in pending.tensors.items() if fl == file):
                    tensors[suffix] = f.get_tensor(f"{name}.{suffix}").to(device)
        w = decode_linear_weight(name, tensors, pending.in_features)
        linear = nn.Linear(pending.in_features, pending.out_features, bias=pending.bias is not None,
                           device="meta", dtype=dtype)
        linear.weight = nn.Parameter(w.to(dtype), requires_grad=False)
        if pending.bias is not None:
            linear.bias = pending.bias
        model.set_submodule(name, linear)


def _fetch_manifest_from_hub(folder: Path, name_or_path: Optional[str]) -> None:
    """A converted folder published on the hub: transformers downloads config.json and the files its index
    lists, not ``megamoe.json``. Fetch it into the same snapshot (the folder's name is the commit), so the
    manifest read is the one of the same revision. A local folder, or a hub id that is not one, is left to
    the folder checks (which say "not a megamoe output folder")."""
    from ...format.manifest import MANIFEST_NAME

    if (folder / MANIFEST_NAME).exists() or not name_or_path or Path(name_or_path).exists():
        return
    if folder.parent.name != "snapshots" or "/" not in str(name_or_path):
        return
    try:
        from huggingface_hub import hf_hub_download

        hf_hub_download(str(name_or_path), MANIFEST_NAME, revision=folder.name, cache_dir=folder.parents[2])
    except Exception as e:  # noqa: BLE001 - any hub failure becomes the folder check's clear refusal
        raise CheckpointError(f"{name_or_path}: could not fetch {MANIFEST_NAME} of revision {folder.name} from the "
                              f"hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); a megamoe "
                              "output needs it beside its shards") from None


def _module_path(model: nn.Module, prefix: str) -> Optional[str]:
    """The model's module path of a checkpoint prefix: the prefix itself, or -- where transformers renames a
    family's legacy checkpoint names on load (Mixtral's ``block_sparse_moe`` is its ``mlp``) -- the one MoE
    block among the children of the prefix's parent."""
    try:
        model.get_submodule(prefix)
        return prefix
    except AttributeError:
        pass
    parent = prefix.rsplit(".", 1)[0] if "." in prefix else ""
    try:
        holder = model.get_submodule(parent) if parent else model
    except AttributeError:
        return None
    found = [n for n, m in holder.named_children() if is_moe_block(m)]
    return f"{parent}.{found[0]}" if len(found) == 1 and parent else None


def _device_near(model: nn.Module, name: str) -> torch.device:
    """The device of the nearest non-meta parameter of ``name``'s ancestors (where transformers placed that
    part of the model): a decoded linear goes where its neighbours went."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        mod = model.get_submodule(".".join(parts[:i])) if i else model
        for p in mod.parameters():
            if p.device.type != "meta":
                return p.device
    return torch.device("cpu")
