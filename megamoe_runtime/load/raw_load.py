"""Raw (unconverted) checkpoints into MegaMoE layers, vLLM style: the model-level drivers.

`load_raw_weights(model, pairs)` routes ``(name, tensor)`` pairs to the
`DeepGemmMegaMoEExperts` layers of a model by MoE prefix and drives each
layer's ``weight_loader`` / ``shared_weight_loader`` (the per-layer code is in
`megamoe_runtime.layer.loaders`); `load_raw_checkpoint(model, dir)` feeds it from a
folder of ``*.safetensors``. This module sits above the layer (it finds layers
by type), so the loaders need not import the layer back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ..errors import CheckpointError
from ..files.file_io import SafetensorsFile
from ..layer.experts import DeepGemmMegaMoEExperts
from ..layer.loaders import parse_expert_weight_name

__all__ = ["RawLoadReport", "load_raw_weights", "load_raw_checkpoint"]


@dataclass
class RawLoadReport:
    """What a raw load consumed: names written, skipped (other ranks' experts),
    not for any layer given, and not understood."""

    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


def _layers_by_prefix(layer_or_model: torch.nn.Module) -> dict[str, "DeepGemmMegaMoEExperts"]:
    if not isinstance(layer_or_model, torch.nn.Module):
        raise CheckpointError(f"raw loads take a layer or a model (torch.nn.Module), got {type(layer_or_model).__name__}")
    out: dict[str, DeepGemmMegaMoEExperts] = {}
    for name, mod in layer_or_model.named_modules():
        if isinstance(mod, DeepGemmMegaMoEExperts):
            key = mod.prefix or name
            if key in out:
                raise CheckpointError(f"two MegaMoE layers share the prefix {key!r}; give each a distinct prefix")
            out[key] = mod
    if not out:
        raise CheckpointError("no DeepGemmMegaMoEExperts layer found in the given module")
    return out


def load_raw_weights(layer_or_model: torch.nn.Module,
                     weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True) -> RawLoadReport:
    """Drive the raw loaders over ``(name, tensor)`` pairs, vLLM style, and
    finish the load (NVFP4 pairs complete, a2 computed, derived scalars
    refreshed). Names are routed to layers by their MoE prefix
    (``layer.prefix``). With ``strict`` an expert tensor no layer can use
    raises (otherwise it is reported in ``unknown``), and so does a layer
    left with a local expert's weight or block scale unwritten (the layer is
    then unusable until a load succeeds). Without ``strict`` a partial pass
    updates a usable layer's experts it names; a layer not usable yet (never
    loaded, or a failed load) needs every local expert either way."""
    layers = _layers_by_prefix(layer_or_model)
    rep = RawLoadReport()
    for lyr in layers.values():
        lyr.begin_load("raw")
        lyr.load_state().require_all = strict  # a checkpoint missing a local expert is refused
    touched: set[int] = set()  # id() of the layers this load wrote into
    current = None
    try:
        for name, tensor in weights:
            current = name
            ref = parse_expert_weight_name(name)
            if ref is None:
                rep.unused.append(name)
                continue
            lyr = layers.get(ref.prefix)
            if lyr is None:
                rep.unused.append(name)
                continue
            if ref.unsupported:
                if strict:
                    raise CheckpointError(f"{name}: {ref.unsupported}")
                rep.unknown.append(name)
                continue
            if ref.shared:
                if lyr.param_for_role(ref.weight_role) is None:
                    rep.unused.append(name)
                    continue
                touched.add(id(lyr))
                lyr.shared_weight_loader(None, tensor, name, ref.shard_id)
                rep.written.append(name)
                continue
            touched.add(id(lyr))
            ok = lyr.weight_loader(None, tensor, name, ref.shard_id, ref.expert_id)
            (rep.written if ok else rep.skipped).append(name)
    except BaseException as e:
        for lyr in layers.values():
            lyr.abort_load()
            if id(lyr) in touched:  # a streamed load cannot be checked first: what it wrote is a mix now
                lyr.mark_unusable(f"a raw load failed at {current} after writing into this layer: "
                                  f"{type(e).__name__}: {e}")
        raise
    for lyr in layers.values():
        try:
            lyr.finish_load()
        except BaseException as e:
            lyr.mark_unusable(f"a raw load's final checks failed: {type(e).__name__}: {e}")
            raise
    return rep


def load_raw_checkpoint(layer_or_model: torch.nn.Module, checkpoint_dir: Any, *, strict: bool = True) -> RawLoadReport:
    """Raw-load every MegaMoE layer in ``layer_or_model`` from an unconverted
    checkpoint folder (``*.safetensors``, sharded or not), vLLM style.

    Each file is mmap'ed; an expert tensor is read only if this rank needs it
    (its expert is local, or it is a w2 input scale: every rank reads all of
    those so a2 agrees). Tensors arrive in file order, which is any order as
    far as the loaders care.
    """
    root = Path(checkpoint_dir)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files")
    layers = _layers_by_prefix(layer_or_model)

    def feed() -> Iterator[tuple[str, torch.Tensor]]:
        for path in files:
            with SafetensorsFile(path) as f:
                for name in f.keys():
                    ref = parse_expert_weight_name(name)
                    if ref is None or ref.prefix not in layers:
                        continue
                    lyr = layers[ref.prefix]
                    if (ref.expert_id is not None and ref.kind != "input_scale"
                            and ref.expert_id not in lyr.spec.local_experts):
                        yield name, f.meta(name)  # skipped by the loader without reading data
                        continue
                    yield name, f.tensor(name)

    return load_raw_weights(layer_or_model, feed(), strict=strict)
