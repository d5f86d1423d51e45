"""Is this folder a megamoe output of this model? Answered before an engine allocates a weight.

An engine builds its model from ``config.json`` and then asks a loader for weights. A folder that is not a
megamoe output, one whose manifest describes another model, or one with a shard missing must be refused
then, with one message naming what and where -- not after gigabytes went to the device, and never by
loading random experts. Everything here reads JSON and safetensors headers only.

The engine-neutral facts of a model config live here too (which config key holds the expert count, the
expert intermediate size), so every integration reads them the same way (docs/ENGINES.md#config).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from .. import knobs
from ..errors import CheckpointError
from ..format.manifest import MANIFEST_NAME
from ..load.checkpoint import Checkpoint, open_checkpoint
from ..load.load_checks import DEFAULT_VERIFY, VERIFY_LEVELS

__all__ = ["QUANT_METHOD", "VERIFY_ENV", "config_value", "check_folder_for_model",
           "verify_level", "weights_folder"]

#: the weight index an engine resolves shard names through
_INDEX_NAME = "model.safetensors.index.json"

#: the ``quantization_config.quant_method`` a converted folder's config.json names
QUANT_METHOD = "megamoe"

#: the environment variable naming the load check level when the quantization config names none
VERIFY_ENV = "MEGAMOE_VERIFY"

#: model-config fact -> the keys model families spell it with (first present wins)
_CONFIG_KEYS = {
    "num_experts": ("n_routed_experts", "num_experts", "num_local_experts"),
    "top_k": ("num_experts_per_tok", "moe_topk", "top_k"),
    "hidden": ("hidden_size",),
    "intermediate": ("moe_intermediate_size", "intermediate_size"),
    "num_layers": ("num_hidden_layers",),
}


def config_value(config: Mapping[str, Any], fact: str) -> Optional[Any]:
    """One fact of a (text) model config under any of its families' spellings; None when absent."""
    for key in _CONFIG_KEYS[fact]:
        if config.get(key) is not None:
            return config[key]
    return None


def _megamoe_quantization_config(config: Mapping[str, Any]) -> Optional[dict]:
    """The config's ``quantization_config`` when it names the megamoe method, else None."""
    qc = config.get("quantization_config")
    if isinstance(qc, Mapping) and qc.get("quant_method") == QUANT_METHOD:
        return dict(qc)
    return None


def weights_folder(files: list, model_path: Optional[Union[str, os.PathLike]] = None) -> Path:
    """The folder an engine's weight `files` come from: `model_path` when it is a local folder (what the user
    passed), else the folder most of the files are in (a hub snapshot). Every file must resolve inside it:
    an index entry such as ``../model-00001-of-00001.safetensors`` (or a link leaving the folder) is refused
    naming the entry and the tensors the index maps to it. Without this the folder was taken from the first
    file's parent, so such an entry was refused as "OUT/.. is not a megamoe output folder", naming neither
    the entry nor the index; and a file of the output must never be read from elsewhere."""
    from collections import Counter

    paths = [Path(f) for f in files]
    if model_path is not None and Path(model_path).is_dir():
        root = Path(model_path)
    else:
        root = Counter(p.parent for p in paths).most_common(1)[0][0]
    real_root = os.path.realpath(root)
    for p in paths:
        real = os.path.realpath(p)
        if os.path.commonpath([real_root, real]) == real_root:
            continue
        entry = os.path.relpath(p, root)
        index = root / _INDEX_NAME
        mapped = []
        if index.is_file():
            from ..files.json_io import read_json

            wm = read_json(index, error=CheckpointError).get("weight_map")
            mapped = sorted(k for k, v in wm.items() if v == entry) if isinstance(wm, dict) else []
        raise CheckpointError(
            f"{index if index.is_file() else root}: the weight file {entry!r}"
            + (f" (weight_map of {mapped[0]!r}" + (f" and {len(mapped) - 1} more" if len(mapped) > 1 else "")
               + ")" if mapped else "")
            + f" resolves to {real}, outside the folder {root}; a megamoe output's files are all inside it")
    return root


def verify_level(quantization_config: Optional[Mapping[str, Any]] = None) -> str:
    """The load check level an engine opens a folder with: ``quantization_config["verify"]`` (a user's
    ``MegaMoEConfig(verify=...)``, an edited config.json, vLLM's ``--hf-overrides``), else ``MEGAMOE_VERIFY``,
    else the loader's default; ValueError naming the valid levels otherwise. ``"checksums"`` hashes every
    loaded tensor against the manifest, so a flipped byte in a shard is refused instead of served."""
    level = (quantization_config or {}).get("verify") or knobs.get(VERIFY_ENV) or DEFAULT_VERIFY
    if level not in VERIFY_LEVELS:
        raise ValueError(f"megamoe verify level {level!r} is unknown; valid: {', '.join(VERIFY_LEVELS)}")
    return level


def check_folder_for_model(folder: Union[str, os.PathLike], config: Mapping[str, Any], *,
                           dry_run: bool = True, verify: Optional[str] = None) -> Checkpoint:
    """The opened checkpoint of ``folder`` after checking it belongs to ``config``; CheckpointError otherwise.

    Checks, in order: the folder holds ``megamoe.json`` (a manifest that reads and validates); the config
    names the megamoe method; the manifest's model (type, experts, top-k) and every MoE layer's sizes match
    the config; every layer index exists in the model; and (``dry_run``) a meta-tensor reload of every layer
    from the files' headers covers every parameter byte exactly once -- which finds a missing, truncated or
    mismatched shard by name without reading a weight. ``verify``: the level every later load of the returned
    checkpoint checks at (`verify_level`; default the loader's own)."""
    root = Path(folder)
    if not (root / MANIFEST_NAME).is_file():
        raise CheckpointError(
            f"{root} is not a megamoe output folder (no {MANIFEST_NAME}); convert the checkpoint first: "
            f"megamoe-convert convert SRC {root}")
    ckpt = open_checkpoint(root) if verify is None else open_checkpoint(root, verify=verify)
    qc = _megamoe_quantization_config(config)
    if qc is None:
        got = config.get("quantization_config")
        got = got.get("quant_method") if isinstance(got, Mapping) else got
        raise CheckpointError(
            f"{root / 'config.json'}: quantization_config.quant_method is {got!r}, not {QUANT_METHOD!r}; the "
            f"folder has {MANIFEST_NAME} but its config is not the one the converter wrote (convert again)")
    if qc.get("row") not in (None, ckpt.row):
        raise CheckpointError(f"{root}: config.json says row {qc.get('row')!r} but {MANIFEST_NAME} says "
                              f"{ckpt.row!r}: the two files come from different conversions")
    model = ckpt.manifest.model
    problems = []
    mt = config.get("model_type")
    if model.get("model_type") and mt and model["model_type"] != mt:
        problems.append(f"model_type {mt!r} in config.json, {model['model_type']!r} in {MANIFEST_NAME}")
    for fact, label in (("num_experts", "num_experts"), ("top_k", "top_k")):
        want, got = config_value(config, fact), model.get(label)
        if want is not None and got is not None and int(want) != int(got):
            problems.append(f"{label} {want} in config.json, {got} in {MANIFEST_NAME}")
    n_layers = config_value(config, "num_layers")
    hidden, inter = config_value(config, "hidden"), config_value(config, "intermediate")
    for li in ckpt.layers:
        s = li.spec
        if n_layers is not None and not 0 <= li.index < int(n_layers):
            problems.append(f"MoE layer {li.index} ({li.prefix}) but the model has {n_layers} layers")
        if hidden is not None and s.hidden != int(hidden):
            problems.append(f"layer {li.index}: hidden {s.hidden} in {MANIFEST_NAME}, hidden_size {hidden} in "
                            "config.json")
        if inter is not None and s.intermediate != int(inter):
            problems.append(f"layer {li.index}: expert intermediate {s.intermediate} in {MANIFEST_NAME}, "
                            f"{inter} in config.json")
    if problems:
        raise CheckpointError(f"{root}: {MANIFEST_NAME} does not describe the model config.json builds: "
                              + "; ".join(problems))
    if dry_run:
        from ..load.reload import dry_run_checkpoint

        errors = [e for rep in dry_run_checkpoint(root, ep_size=1) if not rep.ok for e in _report_problems(rep)]
        if errors:
            raise CheckpointError(f"{root}: the expert shards cannot be loaded: " + "; ".join(errors[:8])
                                  + (f" (and {len(errors) - 8} more)" if len(errors) > 8 else ""))
    return ckpt


def _report_problems(rep: Any) -> list[str]:
    out = list(rep.errors)
    if not out:  # a file error (missing, truncated, bad header) leaves its bytes unwritten: name the cause only
        out += [f"{name}: {sum(b - a for a, b in cov.missing)} byte(s) never written"
                for name, cov in rep.missing.items()]
    out += [f"unknown tensor {n}" for n in rep.unknown_names]
    out += [f"tensor {n} listed twice" for n in rep.duplicate_names]
    return out or ["the reload dry run failed"]
