"""The vLLM classes of the plugin (imported by `megamoe_runtime.integrations.vllm.register` only).

Written against vLLM 0.33.0 (docs/ENGINES.md#vllm):

* `MegaMoEConfig` -- ``QuantizationConfig`` registered as ``megamoe``
  (vllm/model_executor/layers/quantization/__init__.py ``register_quantization_config``); claims a checkpoint
  in ``override_quantization_method`` (vllm/config/model.py ``_verify_quantization`` asks custom methods
  first); checks the folder in ``maybe_update_config`` (vllm/config/vllm.py ``_get_quantization_config``, at
  config time, before the model exists).
* `MegaMoEFusedMoEMethod` -- ``FusedMoEMethodBase`` for every ``RoutedExperts`` layer
  (vllm/model_executor/layers/fused_moe/routed_experts.py calls ``create_weights`` and, per forward,
  ``apply(layer, x, topk_weights, topk_ids, ...)`` after vLLM's own router).
* `MegaMoEModelLoader` -- ``DefaultModelLoader`` registered as load format ``megamoe``
  (vllm/model_executor/model_loader/__init__.py ``register_model_loader``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import (QUANTIZATION_METHODS, get_quantization_config,
                                                     register_quantization_config)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ... import knobs
from ...errors import CheckpointError
from ...format.manifest import MANIFEST_NAME
from ..folder import QUANT_METHOD, check_folder_for_model, verify_level
from ..warm import seed_for_folder

#: under vLLM's own logger tree, so its handler prints what the plugin reports (a name outside "vllm." is dropped)
_logger = init_logger("vllm.plugins.megamoe")

#: the name of the load format this plugin registers (the quantization method is `folder.QUANT_METHOD`)
_LOAD_FORMAT = "megamoe"

#: the model classes whose MoE blocks this plugin fills (vLLM architecture names; config.json's
#: ``architectures``). Kimi-K2 checkpoints name DeepseekV3ForCausalLM.
_SUPPORTED_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Glm4MoeForCausalLM",
    "MixtralForCausalLM",
)

#: vLLM's parameter names (its own DeepGemmMegaMoEExperts, vllm/model_executor/layers/fused_moe/
#: deep_gemm_mega_moe.py ``_create_weights``) -> the megamoe role holding the same bytes, shape and strides
_VLLM_PARAM_ROLES = (("w13_weight", "l1_weight"), ("w13_weight_scale", "l1_scale"),
                    ("w2_weight", "l2_weight"), ("w2_weight_scale", "l2_scale"))

#: which megamoe backend runs the experts: "auto" follows the device (deepgemm on SM100, triton on Hopper,
#: reference on the CPU); a name forces one
_BACKEND_ENV = "MEGAMOE_BACKEND"  # the same variable the transformers integration reads


def register_all() -> None:
    register_quantization_config(QUANT_METHOD)(MegaMoEConfig)
    register_model_loader(_LOAD_FORMAT)(MegaMoEModelLoader)


# --------------------------------------------------------------------------- folder checks


def _check_architecture(config: dict, where: str) -> str:
    """The one architecture of ``config`` this plugin serves; CheckpointError naming it otherwise."""
    archs = list(config.get("architectures") or [])
    known = [a for a in archs if a in _SUPPORTED_ARCHITECTURES]
    if not known:
        raise CheckpointError(
            f"{where}: architectures {archs} -- the megamoe vLLM plugin serves {', '.join(_SUPPORTED_ARCHITECTURES)}; "
            "another architecture's MoE blocks are not known to it")
    return known[0]


def _local_folder(model: str, revision: Optional[str]) -> tuple[Path, bool]:
    """(folder, local): a local folder as given, else the hub snapshot's JSON files (the shards come later,
    through vLLM's own download, and are checked then)."""
    p = Path(model)
    if p.is_dir():
        return p, True
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision, allow_patterns=["*.json"])), False


# --------------------------------------------------------------------------- quantization config


class MegaMoEConfig(QuantizationConfig):
    """``quant_method: megamoe``: routed experts in DeepGEMM MegaMoE kernel layout, everything else in the
    source's own format (``source_quantization_config``, handed to the vLLM method that reads it)."""

    def __init__(self, config: dict):
        self.source_config: Optional[QuantizationConfig] = None
        super().__init__()
        self.config = dict(config)
        self.row = config.get("row")
        #: the load check level: quantization_config "verify", else MEGAMOE_VERIFY, else the loader's default
        self.verify = verify_level(config)
        src = config.get("source_quantization_config")
        if isinstance(src, dict) and src:
            self.source_config = _source_quantization_config(src)
            self.source_config.packed_modules_mapping = self.packed_modules_mapping
        #: the opened checkpoint, set by `maybe_update_config` once the folder passed its checks
        self.checkpoint = None
        self.folder: Optional[Path] = None
        self.shards_checked = False

    # vLLM hands the model class's packed_modules_mapping to the quantization config by reference
    # (model_loader/utils.py) or updates it in place: the source's method must see the same dict
    @property
    def packed_modules_mapping(self) -> dict:
        return self._packed_modules_mapping

    @packed_modules_mapping.setter
    def packed_modules_mapping(self, value: dict) -> None:
        self._packed_modules_mapping = value
        if getattr(self, "source_config", None) is not None:
            self.source_config.packed_modules_mapping = value

    def __repr__(self) -> str:
        return f"MegaMoEConfig(row={self.row!r}, source={type(self.source_config).__name__ if self.source_config else None})"

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 90  # Hopper: megamoe's triton backend; SM100 runs the DeepGEMM kernels

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # everything is in config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MegaMoEConfig":
        if config.get("quant_method") != QUANT_METHOD:
            raise CheckpointError(f"quantization_config.quant_method is {config.get('quant_method')!r}, "
                                  f"not {QUANT_METHOD!r}")
        if int(config.get("format_version", 1)) != 1:
            raise CheckpointError(f"quantization_config.format_version {config.get('format_version')!r}: this "
                                  "plugin reads format 1 (upgrade megamoe)")
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: Optional[str],
                                     hf_config: Any = None) -> Optional[str]:
        if isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") == QUANT_METHOD \
                and user_quant in (None, QUANT_METHOD):
            return QUANT_METHOD
        return None

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: Optional[str] = None):
        """Check the folder against the model vLLM is about to build (config time: no weight exists yet)."""
        folder, local = _local_folder(model_name, revision)
        config = model_config_dict(folder, hf_config)
        _check_architecture(config, str(folder / "config.json"))
        self.checkpoint = check_folder_for_model(folder, config, dry_run=local, verify=self.verify)
        rsf = config.get("routed_scaling_factor")
        if rsf is not None:
            bad = [li for li in self.checkpoint.layers if abs(float(rsf) - li.spec.routed_scaling_factor)
                   > 1e-6 * max(1.0, abs(li.spec.routed_scaling_factor))]
            if bad:
                raise CheckpointError(
                    f"{folder / 'config.json'}: routed_scaling_factor {rsf} but {MANIFEST_NAME} says "
                    f"{bad[0].spec.routed_scaling_factor} (layer {bad[0].index}); the kernels apply the manifest's "
                    "and vLLM's router the config's: the two files disagree")
        self.folder, self.shards_checked = folder, local

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any):
        if self.source_config is not None:
            self.source_config.apply_vllm_mapper(hf_to_vllm_mapper)

    def get_checkpoint_weight_mapper(self):
        """The stored expert stacks (``<prefix>.megamoe.<role>``) are never fed to a model's ``load_weights``:
        the megamoe loader copies them; under another loader the layers refuse to run (see
        `MegaMoEFusedMoEMethod.process_weights_after_loading`)."""
        from vllm.model_executor.models.utils import WeightsMapper

        return super().get_checkpoint_weight_mapper() | WeightsMapper(orig_to_new_substr={".megamoe.": None})

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, RoutedExperts):
            return MegaMoEFusedMoEMethod(layer.moe_config, self, prefix)
        if self.source_config is not None:
            return self.source_config.get_quant_method(layer, prefix)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None

    def layer_index_for(self, prefix: str) -> int:
        """The manifest layer of vLLM's RoutedExperts ``prefix`` (``model.layers.3.mlp.experts``)."""
        if self.checkpoint is None:
            raise CheckpointError(f"{prefix}: the megamoe folder was not opened (vLLM did not call "
                                  "maybe_update_config on this config)")
        for li in self.checkpoint.layers:
            if prefix == li.prefix or prefix.startswith(li.prefix + "."):
                return li.index
        raise CheckpointError(
            f"{self.checkpoint.root}: vLLM builds a MoE layer at {prefix} but {MANIFEST_NAME} has no layer there "
            f"(its MoE layers: {', '.join(li.prefix for li in self.checkpoint.layers)})")


def model_config_dict(folder: Path, hf_config: Any) -> dict:
    """The model config vLLM built as a dict (text config of a composite model), with the
    ``quantization_config`` of config.json when the object does not carry it."""
    import json

    cfg: dict = {}
    if hf_config is not None:
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        cfg = text.to_dict() if hasattr(text, "to_dict") else dict(text)
        if not cfg.get("architectures"):
            cfg["architectures"] = getattr(hf_config, "architectures", None)
    path = folder / "config.json"
    if not cfg or not isinstance(cfg.get("quantization_config"), dict):
        try:
            disk = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read ({e})") from None
        cfg = {**disk, **{k: v for k, v in cfg.items() if v is not None}}
        cfg["quantization_config"] = disk.get("quantization_config")
    return cfg


def _source_quantization_config(src: dict) -> QuantizationConfig:
    """vLLM's own config for the source's quantization (the non-expert layers stay in its format): the
    first registered method whose ``override_quantization_method`` claims the dict, else its ``quant_method``
    (ModelConfig._verify_quantization probes the same hooks, in a preference order of its own that is not
    importable; for the producers the converter reads, one method claims each)."""
    method = src.get("quant_method")
    for name in QUANTIZATION_METHODS:
        if name == QUANT_METHOD:
            continue
        try:
            override = get_quantization_config(name).override_quantization_method(src, None)
        except Exception:  # a method whose probe needs more than the dict: not this checkpoint's
            continue
        if override is not None:
            method = override
            break
    if method not in QUANTIZATION_METHODS:
        raise CheckpointError(f"source_quantization_config.quant_method {method!r} is not a vLLM quantization "
                              "method; the non-expert layers cannot be read")
    return get_quantization_config(method).from_config(src)


# --------------------------------------------------------------------------- MoE method


def _refuse_raw_load(param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    raise CheckpointError("megamoe MoE parameters hold kernel layout and are filled by the megamoe loader "
                          "(--load-format megamoe), not from per-expert checkpoint tensors")


class MegaMoEFusedMoEMethod(FusedMoEMethodBase):
    """A RoutedExperts layer as a megamoe `DeepGemmMegaMoEExperts` (attribute ``megamoe_experts``) whose
    kernel tensors are also the layer's ``w13_weight``/``w2_weight``/scales (same Parameter objects)."""

    def __init__(self, moe: Any, quant_config: MegaMoEConfig, prefix: str):
        super().__init__(moe)
        self.quant_config = quant_config
        self.prefix = prefix
        self.layer_index = quant_config.layer_index_for(prefix)
        #: the routed_scaling_factor vLLM's MoE runner applies to this layer's output (set by the loader)
        self.runner_output_scale = 1.0

    def ep_rank_size(self, layer: torch.nn.Module) -> tuple[int, int]:
        pc = layer.moe_config.moe_parallel_config
        if getattr(pc, "use_all2all_kernels", False):
            raise CheckpointError(
                f"{self.quant_config.checkpoint.root}: {self.prefix}: expert parallelism across data-parallel ranks dispatches through vLLM's all-to-all "
                "backends, which the megamoe method does not implement; use EP within one data-parallel group "
                "(--tensor-parallel-size N --enable-expert-parallel: every rank sees every token, vLLM sums the ranks)")
        if pc.use_ep:
            return int(pc.ep_rank), int(pc.ep_size)
        if int(pc.tp_size) > 1:
            raise CheckpointError(
                f"{self.quant_config.checkpoint.root}: {self.prefix}: tensor parallel {pc.tp_size} would split each expert's intermediate dimension; "
                "a megamoe folder holds whole experts in kernel layout: serve with --enable-expert-parallel")
        return 0, 1

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
        ckpt = self.quant_config.checkpoint
        ep_rank, ep_size = self.ep_rank_size(layer)
        spec = ckpt.layer_spec(self.layer_index, ep_rank, ep_size)
        got = {"local experts": num_experts, "hidden": hidden_size, "intermediate": intermediate_size_per_partition,
               "experts": extra_weight_attrs.get("global_num_experts", spec.num_experts)}
        want = {"local experts": spec.experts_per_rank, "hidden": spec.hidden, "intermediate": spec.intermediate,
                "experts": spec.num_experts}
        bad = [f"{k} {got[k]} in vLLM, {want[k]} in {MANIFEST_NAME}" for k in got if int(got[k]) != int(want[k])]
        if bad:
            raise CheckpointError(f"{ckpt.root}: layer {self.layer_index} ({self.prefix}, EP rank {ep_rank} of "
                                  f"{ep_size}): " + "; ".join(bad))
        device = torch.get_default_device()
        backend = knobs.get(_BACKEND_ENV) or "auto"
        mm = ckpt.allocate_layer(self.layer_index, device=device, backend=backend, ep_rank=ep_rank, ep_size=ep_size)
        layer.register_module("megamoe_experts", mm)
        for name, role in _VLLM_PARAM_ROLES:
            p = getattr(mm, role, None)
            if p is not None:
                p.weight_loader = _refuse_raw_load
                layer.register_parameter(name, p)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        mm = layer.megamoe_experts
        if mm.load_generation == 0:
            raise CheckpointError(
                f"{self.prefix}: its routed experts were never loaded; a megamoe folder is served with "
                f"--load-format {_LOAD_FORMAT} (the default loader does not read the kernel-layout shards)")

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Any = None, shared_experts_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        mm, dtype = layer.megamoe_experts, x.dtype
        w = topk_weights.to(torch.float32)
        # vLLM's router has multiplied the weights by the layer's routed_scaling_factor; megamoe's kernels fold
        # the manifest's factor themselves, so the router's is taken back out (once, here)
        rsf = float(getattr(layer, "routed_scaling_factor", 1.0) or 1.0)
        if rsf != 1.0:
            w = w / rsf
        x = x.to(torch.bfloat16)
        if mm.spec.ep_size > 1:
            y = _ep_rank_partial(mm, x, w, topk_ids)
        else:
            y = mm(x, w, topk_ids)
        if self.runner_output_scale != 1.0:  # the runner scales our output again: hand it the unscaled sum
            y = (y.to(torch.float32) / self.runner_output_scale).to(torch.bfloat16)
        return y.to(dtype)


def _ep_rank_partial(mm: Any, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """This EP rank's share of the layer's output under vLLM's expert parallelism without an all-to-all
    backend: every rank sees every token, computes its own experts' pairs, and vLLM's runner sums the ranks'
    outputs. megamoe's backends compute local experts only (other ids contribute nothing); the shared expert
    is added by rank 0 alone, so the sum holds it once. (megamoe's own EP path, `ep.ep_forward`, dispatches
    through its own exchange and is not used under vLLM.)"""
    from ...errors import LayerUnusableError

    if mm.unusable_reason is not None:
        raise LayerUnusableError(f"{mm.prefix or 'layer'} is unusable: {mm.unusable_reason}")
    first = mm.spec.ep_rank == 0
    y = mm.backend.forward(mm, x, w, ids, shared_input=x if (mm.shared_fused and first) else None)
    if first and mm.shared_mlp is not None:
        y = (y.to(torch.float32) + mm.shared_mlp(x).to(torch.float32)).to(torch.bfloat16)
    return y


# --------------------------------------------------------------------------- model loader


def _adopt_runners(model: torch.nn.Module, check_only: bool = False) -> list[str]:
    """Fit vLLM's MoE runners to the megamoe layers they drive; returns the runners whose shared MLP was
    detached.

    A layer whose manifest holds kernel-layout shared experts runs them itself (fused into the launch where
    the backend fuses them); vLLM built its own shared MLP from config.json, and the checkpoint has no
    tensors for it, so that MLP is taken out of the runner (vllm/model_executor/layers/fused_moe/runner/
    moe_runner.py ``_shared_experts``, ``_select_forward``). A runner that scales the routed output by
    routed_scaling_factor is recorded, so the layer hands it the unscaled sum."""
    detached = []
    for name, runner in model.named_modules():
        routed = getattr(runner, "routed_experts", None)
        method = getattr(routed, "quant_method", None)
        if not isinstance(method, MegaMoEFusedMoEMethod):
            continue
        runner_scale = float(getattr(runner, "routed_scaling_factor", 1.0) or 1.0)
        spec = routed.megamoe_experts.spec
        vllm_rsf = runner_scale * float(getattr(routed, "routed_scaling_factor", 1.0) or 1.0)
        if abs(vllm_rsf - spec.routed_scaling_factor) > 1e-6 * max(1.0, abs(spec.routed_scaling_factor)):
            raise CheckpointError(
                f"{name}: vLLM applies routed_scaling_factor {vllm_rsf} (from config.json) but {MANIFEST_NAME} "
                f"says {spec.routed_scaling_factor}; the kernels apply the manifest's: the two files disagree")
        if check_only:
            continue
        method.runner_output_scale = runner_scale
        if routed.megamoe_experts.spec.shared is not None and getattr(runner, "_shared_experts", None) is not None:
            runner._shared_experts = None
            runner._forward_entry = runner._select_forward()
            detached.append(name)
    return detached


def seed_kernel_cache(folder: Path) -> Optional[Any]:
    """The folder's shipped kernel cache (``megamoe-convert warm``: ``FOLDER/kernel-cache``, or
    ``MEGAMOE_KERNEL_CACHE``) copied into triton's cache by the transformers integration's own function
    (`warm.seed_for_folder`), so the first forward does not wait for the kernels to compile
    (docs/KERNELS.md#cold-start). Called by the loader: it runs in each worker, the process that launches the
    kernels, before its first forward; vLLM's engine process never launches them.

    vLLM's torch.compile step, which comes after the load, points an unset ``TRITON_CACHE_DIR`` at a folder
    of its compile cache (vllm/compilation/compiler_interface.py ``InductorAdaptor.initialize_cache``); the
    kernels would then miss the folder seeded here. So once entries were seeded, an unset ``TRITON_CACHE_DIR``
    is set to that folder, which vLLM keeps as the caller's (its inductor kernels are cached there too); a
    value the user set is left alone. Returns the seed report (None: no cache, no CUDA, or unusable)."""
    rep = seed_for_folder(folder)
    if rep is None or rep.skipped:
        return rep
    if not os.environ.get("TRITON_CACHE_DIR", "").strip():
        os.environ["TRITON_CACHE_DIR"] = rep.target
    _logger.info("megamoe: kernel cache %s seeded into %s (%d entries new, %d present)", rep.cache, rep.target,
                rep.new_entries, rep.present_entries)
    return rep


def _is_megamoe_config(qc: Any) -> bool:
    return isinstance(qc, MegaMoEConfig)


class MegaMoEModelLoader(DefaultModelLoader):
    """``--load-format megamoe``: vLLM's default loader for the non-expert tensors (the expert shards are left
    out of its file list, so it never opens them), then each MoE layer from its pre-laid shards."""

    def __init__(self, load_config: Any):
        # the default loader's file discovery knows its own formats only: it reads the folder as safetensors
        import dataclasses

        super().__init__(dataclasses.replace(load_config, load_format="safetensors"))
        self.requested_load_config = load_config

    def _megamoe_layers(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        return [(name, m) for name, m in model.named_modules()
                if isinstance(getattr(m, "quant_method", None), MegaMoEFusedMoEMethod)]

    def _prepare_weights(self, model_name_or_path, subfolder, revision, fall_back_to_pt, allow_patterns_overrides):
        hf_folder, files, use_safetensors, index_file = super()._prepare_weights(
            model_name_or_path, subfolder, revision, fall_back_to_pt, allow_patterns_overrides)
        expert_files = getattr(self, "_expert_files", None)
        if expert_files:
            files = [f for f in files if os.path.basename(f) not in expert_files]
        return hf_folder, files, use_safetensors, index_file

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        ckpt, layers = self.check_experts(model, model_config)
        seed_kernel_cache(ckpt.root)
        self._expert_files = {te.file for te in ckpt.manifest.tensors.values() if te.layer is not None}
        super().load_weights(model, model_config)  # the non-expert tensors, vLLM's way
        self.fill_experts(model, ckpt, layers)

    def check_experts(self, model: torch.nn.Module, model_config: Any):
        """(checkpoint, [(name, RoutedExperts)]) once every MoE layer passed megamoe's load checks (spec,
        folder identity, every file's header and length): all or nothing, before the first byte is copied."""
        layers = self._megamoe_layers(model)
        if not layers:
            raise CheckpointError(f"--load-format {_LOAD_FORMAT}: {model_config.model} built no megamoe MoE layer "
                                  f"(quantization {model_config.quantization!r}; its config.json must name "
                                  f"quant_method {QUANT_METHOD!r})")
        qc = layers[0][1].quant_method.quant_config
        ckpt = qc.checkpoint
        if not qc.shards_checked:  # a hub snapshot's shards arrived after the config-time check
            check_folder_for_model(ckpt.root, model_config_dict(ckpt.root, model_config.hf_config), dry_run=True)
            qc.shards_checked = True
        for name, m in layers:
            ckpt.check_load(m.megamoe_experts).raise_if_failed(f"{ckpt.root}: {name}")
        _adopt_runners(model, check_only=True)
        return ckpt, layers

    def fill_experts(self, model: torch.nn.Module, ckpt: Any, layers: list) -> int:
        """Every MoE layer from its pre-laid shards (megamoe's ``load_layer``: one copy per stored tensor into
        the parameter, no transform; this rank's files only), then the runners fitted (`_adopt_runners`)."""
        self.expert_files_opened: list[str] = []
        copied = 0
        for name, m in layers:
            copied += ckpt.load_layer(m.megamoe_experts)
            self.expert_files_opened += [f for f in ckpt.last_opened_files if f not in self.expert_files_opened]
        self.expert_bytes_copied = copied
        # what this rank read, for the worker extension's load report (integrations/vllm/reload.py)
        model.megamoe_load_report = {"folder": str(ckpt.root), "expert_files_opened": list(self.expert_files_opened),
                                     "expert_bytes": copied}
        self.detached_shared = _adopt_runners(model)
        _logger.info("megamoe: %d MoE layers filled from %s (%d bytes from %s)", len(layers), ckpt.root, copied,
                    ", ".join(self.expert_files_opened))
        return copied
