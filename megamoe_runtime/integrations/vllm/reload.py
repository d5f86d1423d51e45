"""Weight reload in a running vLLM engine from another converted folder (docs/ENGINES.md#vllm).

RL and A/B serving swap a model's weights without restarting the engine. vLLM's way in is a worker
extension: ``LLM(OUT, load_format="megamoe", worker_extension_cls=WORKER_EXTENSION)`` gives every worker
the methods of `MegaMoEWorkerExtension`, and ``llm.collective_rpc("megamoe_reload_weights", args=(NEW,))``
runs one on every rank (the server's ``--worker-extension-cls`` does the same).

A reload is all or nothing, checked before any live byte changes:

1. NEW is a megamoe folder of the SAME model: its manifest describes the running model's config (model type,
   expert count, top-k, sizes, row), its non-expert tensors have the running folder's names, shapes and
   dtypes, and each MoE layer's semantics (routed scaling, activation) are the running ones.
2. The meta dry run (`load.reload.verify_reload`, what ``megamoe-convert verify --reload-dry-run`` runs) on the
   live megamoe layers of this rank: every parameter byte written exactly once from NEW's headers, no name
   unused, nothing rebound.
3. The load checks of every layer at level ``checksums`` (`Checkpoint.check_load`: files, headers, lengths,
   identity, and every tensor's checksum against NEW's manifest -- a shard of another conversion of the same
   model has the same headers), and the checksums of NEW's non-expert tensors.

Then the non-expert tensors go through vLLM's own in-place reload (``model_runner.reload_weights`` with an
iterator over NEW's non-expert files: vLLM re-runs the processing its CPU/GPU linear kernels need), and each
MoE layer through `Checkpoint.load_layer` (one copy per stored tensor, this rank's files only). A refusal
leaves the engine serving the old weights.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from ...errors import CheckpointError
from ...load.checkpoint import open_checkpoint
from ...load.reload import verify_reload
from ..folder import check_folder_for_model
from .plugin import MegaMoEFusedMoEMethod, model_config_dict

__all__ = ["WORKER_EXTENSION", "MegaMoEWorkerExtension"]

#: the qualified name vLLM's ``worker_extension_cls`` takes
WORKER_EXTENSION = "megamoe_runtime.integrations.vllm.reload.MegaMoEWorkerExtension"


def _megamoe_layers(model: torch.nn.Module) -> dict[str, Any]:
    return {name: m.megamoe_experts for name, m in model.named_modules()
            if isinstance(getattr(m, "quant_method", None), MegaMoEFusedMoEMethod)}


def _dense_headers(ckpt: Any) -> dict[str, tuple]:
    """name -> (file, shape, dtype) of every non-expert tensor of a converted folder, from the headers."""
    from safetensors import safe_open

    out, by_file = {}, {}
    for te in ckpt.manifest.tensors.values():
        if te.layer is None:
            by_file.setdefault(te.file, []).append(te.name)
    for file, names in by_file.items():
        with safe_open(str(ckpt.root / file), "pt") as f:
            for n in names:
                sl = f.get_slice(n)
                out[n] = (file, tuple(sl.get_shape()), sl.get_dtype())
    return out


def _dense_tensors(ckpt: Any, names: dict[str, tuple]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for n, (file, _, _) in names.items():
        by_file.setdefault(file, []).append(n)
    for file, ns in sorted(by_file.items()):
        with safe_open(str(ckpt.root / file), "pt") as f:
            for n in ns:
                yield n, f.get_tensor(n)


def _check_reload(model: torch.nn.Module, vllm_config: Any, folder: str) -> tuple[Any, dict, dict, str]:
    """(new checkpoint, its non-expert headers, this rank's megamoe layers, dry-run summary) once ``folder``
    passed every check of the module doc; CheckpointError naming the folder and the problem otherwise."""
    new_root = Path(folder)
    mc = vllm_config.model_config
    running_root = Path(mc.model)
    layers = _megamoe_layers(model)
    if not layers:
        raise CheckpointError(f"{new_root}: the running model has no megamoe MoE layer to reload")
    running = model_config_dict(running_root, mc.hf_config)
    new = check_folder_for_model(new_root, running, dry_run=False)  # NEW describes the running model
    old = open_checkpoint(running_root)
    if new.row != old.row:
        raise CheckpointError(f"{new_root}: row {new.row!r}, the running model serves {old.row!r}")
    want, got = _dense_headers(old), _dense_headers(new)
    diff = sorted(set(want) ^ set(got))
    if diff:
        raise CheckpointError(f"{new_root}: its non-expert tensors differ in name from the running model's: "
                              + ", ".join(diff[:5]))
    bad = [n for n in want if want[n][1:] != got[n][1:]]
    if bad:
        n = bad[0]
        raise CheckpointError(f"{new_root}: {n} is {got[n][2]} {list(got[n][1])}, the running model's "
                              f"{want[n][2]} {list(want[n][1])}")
    rep = verify_reload(torch.nn.ModuleDict({k.replace(".", "_"): v for k, v in layers.items()}), new_root)
    if not rep.ok:
        raise CheckpointError(f"{new_root}: the reload dry run failed: " + "; ".join(rep.problems()[:3] + rep.errors[:3]))
    for name, layer in layers.items():  # checksums: a shard of another conversion has the same headers
        new.check_load(layer, verify="checksums").raise_if_failed(f"{new_root}: {name}")
    problems = _dense_checksum_problems(new)
    if problems:
        raise CheckpointError(f"{new_root}: " + "; ".join(problems[:3]))
    return new, got, layers, rep.summary()


def _dense_checksum_problems(ckpt: Any) -> list[str]:
    """The manifest's checksum of every non-expert tensor against the file (what the expert load checks do
    for the experts): a reload must not take dense layers from another conversion either."""
    from types import SimpleNamespace

    from ...files.folder import inside_folder
    from ...files.safetensors_header import parse_safetensors_header
    from ...load.load_checks import check_checksums

    entries = [te for te in ckpt.manifest.tensors.values() if te.layer is None]
    headers = {f: parse_safetensors_header(inside_folder(ckpt.root, f)) for f in {te.file for te in entries}}
    return check_checksums([SimpleNamespace(entry=te) for te in entries], headers)


def _reload_model(model_runner: Any, folder: str) -> dict:
    """Reload this rank's model from converted folder ``folder`` (see the module doc); a report dict."""
    model, vllm_config = model_runner.get_model(), model_runner.vllm_config
    new, dense, layers, summary = _check_reload(model, vllm_config, folder)
    model_runner.reload_weights(weights_iterator=_dense_tensors(new, dense), is_checkpoint_format=True)
    copied, files = 0, []
    for _, layer in layers.items():
        copied += new.load_layer(layer)
        files += [f for f in new.last_opened_files if f not in files]
    model.megamoe_load_report = {"folder": str(new.root), "expert_files_opened": files, "expert_bytes": copied,
                                 "dry_run": summary}
    return model.megamoe_load_report


def _load_report(model: torch.nn.Module) -> dict:
    """What this rank's megamoe loader (or the last reload) read: folder, expert files opened, bytes."""
    return dict(getattr(model, "megamoe_load_report", {}) or {})


class MegaMoEWorkerExtension:
    """Methods vLLM adds to every worker (``worker_extension_cls``), called through ``collective_rpc``."""

    def megamoe_reload_weights(self, folder: str) -> dict:
        return _reload_model(self.model_runner, folder)

    def megamoe_load_report(self) -> dict:
        report = _load_report(self.model_runner.get_model())
        pc = self.model_runner.vllm_config.parallel_config
        return {**report, "rank": int(getattr(self, "rank", 0)), "tp_size": int(pc.tensor_parallel_size)}
