"""The vLLM plugin's load path checks a converted folder exactly as megamoe's own loader does, at every verify
level; runs in the normal suite, without vLLM.

How the plugin loads (docs/ENGINES.md#vllm): the expert parameters it registers on vLLM's layer refuse vLLM's
raw ``weight_loader`` (`plugin._refuse_raw_load`); ``MegaMoEModelLoader`` runs `Checkpoint.check_load` on every
MoE layer (all or nothing) and then `Checkpoint.load_layer`, on the checkpoint ``MegaMoEConfig`` opened at the
level of ``quantization_config.verify`` / ``MEGAMOE_VERIFY`` / "headers". So a folder damaged after conversion
must meet the same checks as the native load: here the plugin's real classes run over a stand-in of the few
vLLM base classes they subclass (`_stub_vllm`), through config time (``maybe_update_config``), layer creation
(``get_quant_method`` / ``create_weights``) and the loader's ``load_weights``, and each damaged folder's outcome
is compared with the native load's at the same level. The vLLM path must refuse at least what the native one
refuses, no later:

* a NaN per-expert global scale (``l1_alpha``) and an fp32-subnormal one (``l2_global_scale``,
  docs/FORMATS.md#subnormal-scales): refused before any byte at "headers" and "checksums" on both paths; at
  "none" the native load leaves the layer unusable (the end-of-load check) and the plugin refuses at config time
  (its folder check, the meta dry run, runs the "headers" checks whatever the level);
* a NaN E4M3 block-scale byte (``l1_scale``): only "checksums" refuses it. "headers" reads the per-expert
  scalars, not the block scales (megamoe_runtime/load/load_checks.py), on both paths alike.

The subnormal case fails without the subnormal rule (both paths served the layer with a denormal alpha)."""
from __future__ import annotations

import dataclasses
import importlib
import logging
import struct
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import megamoe_runtime as mr
from megamoe_runtime.errors import LayerUnusableError, LoadCheckError, MegaMoEError
from megamoe_runtime.files.safetensors_header import parse_safetensors_header

PLUGIN = "megamoe_runtime.integrations.vllm.plugin"
LEVELS = ("none", "headers", "checksums")


def _stub_modules() -> dict[str, types.ModuleType]:
    """The vLLM modules plugin.py imports from, holding only the names it takes: minimal base classes."""

    class QuantizationConfig:
        def __init__(self):
            self.packed_modules_mapping = {}

    class FusedMoEMethodBase:
        def __init__(self, moe):
            self.moe = moe

    class RoutedExperts(torch.nn.Module):
        pass

    class DefaultModelLoader:
        def __init__(self, load_config):
            self.load_config = load_config

        def load_weights(self, model, model_config):  # vLLM's own (non-expert) tensors: none here
            model.vllm_default_load_ran = True

    class SourceConfig:  # the method vLLM would pick for the non-expert layers (unused here)
        @classmethod
        def override_quantization_method(cls, src, user):
            return None

        @classmethod
        def from_config(cls, src):
            return cls()

    class Methods(list):  # every source quant_method counts as registered
        def __contains__(self, name):
            return True

    names = {
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.model_executor.layers.fused_moe.fused_moe_method_base": {"FusedMoEMethodBase": FusedMoEMethodBase},
        "vllm.model_executor.layers.fused_moe.routed_experts": {"RoutedExperts": RoutedExperts},
        "vllm.model_executor.layers.linear": {"LinearBase": type("LinearBase", (torch.nn.Module,), {}),
                                              "UnquantizedLinearMethod": type("UnquantizedLinearMethod", (), {})},
        "vllm.model_executor.layers.quantization": {"QUANTIZATION_METHODS": Methods(),
                                                    "get_quantization_config": lambda name: SourceConfig,
                                                    "register_quantization_config": None},
        "vllm.model_executor.layers.quantization.base_config": {
            "QuantizationConfig": QuantizationConfig, "QuantizeMethodBase": type("QuantizeMethodBase", (), {})},
        "vllm.model_executor.model_loader": {"register_model_loader": None},
        "vllm.model_executor.model_loader.default_loader": {"DefaultModelLoader": DefaultModelLoader},
    }
    mods: dict[str, types.ModuleType] = {}
    for full, attrs in names.items():
        parts = full.split(".")
        for i in range(1, len(parts) + 1):
            mods.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        for k, v in attrs.items():
            setattr(mods[full], k, v)
    return mods


@pytest.fixture
def plugin(monkeypatch):
    """plugin.py imported over the stand-in modules (a real vLLM, if installed, is hidden meanwhile); afterwards
    sys.modules and the package attribute are as before."""
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, mod in _stub_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    pkg = importlib.import_module("megamoe_runtime.integrations.vllm")
    before = sys.modules.pop(PLUGIN, None), getattr(pkg, "plugin", None)
    try:
        yield importlib.import_module(PLUGIN)
    finally:
        sys.modules.pop(PLUGIN, None)
        if before[0] is not None:
            sys.modules[PLUGIN] = before[0]
        if before[1] is not None:
            pkg.plugin = before[1]
        elif hasattr(pkg, "plugin"):
            delattr(pkg, "plugin")


@dataclasses.dataclass
class _LoadConfig:
    load_format: str


def _outcome(fn) -> tuple[str, str]:
    """("served" | "unusable" | "refused", detail). "refused": before any byte of the layer was written (the load
    checks, or the plugin's config-time folder checks); "unusable": refused after writing started (the layer
    raises instead of running)."""
    try:
        fn()
    except LoadCheckError as e:
        return "refused", f"load checks: {e}"
    except LayerUnusableError as e:
        return "unusable", str(e)
    except MegaMoEError as e:  # the plugin's config-time checks of the folder
        return "refused", f"at config time: {type(e).__name__}: {e}"
    return "served", ""


def _native(folder, level: str) -> tuple[str, str]:
    ck = mr.open_checkpoint(folder, verify=level)

    def load():
        for li in ck.layers:
            ck.load_layer(ck.allocate_layer(li.index, backend="reference"))
    return _outcome(load)


def _vllm(plugin, folder, level: str, monkeypatch) -> tuple[tuple[str, str], torch.nn.Module]:
    """The plugin's path: config (verify level in quantization_config), one RoutedExperts per MoE layer, the
    loader. Returns the outcome and the model."""
    import json

    monkeypatch.setenv("MEGAMOE_BACKEND", "reference")
    qc_dict = {**json.loads((folder / "config.json").read_text())["quantization_config"], "verify": level}
    model = torch.nn.Module()

    def build_and_load():
        qc = plugin.MegaMoEConfig.from_config(qc_dict)
        assert qc.verify == level
        qc.maybe_update_config(str(folder), hf_config=None)
        assert qc.checkpoint.verify == level
        for li in qc.checkpoint.layers:
            routed = sys.modules["vllm.model_executor.layers.fused_moe.routed_experts"].RoutedExperts()
            routed.moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(
                use_all2all_kernels=False, use_ep=False, tp_size=1))
            method = qc.get_quant_method(routed, f"{li.prefix}.experts")
            assert isinstance(method, plugin.MegaMoEFusedMoEMethod)
            routed.quant_method = method
            s = li.spec
            method.create_weights(routed, s.experts_per_rank, s.hidden, s.intermediate, torch.bfloat16,
                                  global_num_experts=s.num_experts)
            model.add_module(f"moe{li.index}", routed)
        loader = plugin.MegaMoEModelLoader(_LoadConfig("megamoe"))
        loader.load_weights(model, SimpleNamespace(model=str(folder), quantization="megamoe", hf_config=None))
    return _outcome(build_and_load), model


def _poke(folder, name: str, offset: int, data: bytes) -> None:
    ck = mr.open_checkpoint(folder)
    te = ck.manifest.entry(name)
    h = parse_safetensors_header(folder / te.file)
    with open(folder / te.file, "r+b") as f:
        f.seek(h.data_start + h.tensors[te.name].begin + offset)
        f.write(data)


DAMAGES = {
    "clean": (None, 0, b""),
    "NaN global scale": ("model.layers.1.mlp.megamoe.l1_alpha", 4 * 5, struct.pack("<f", float("nan"))),
    "subnormal global scale": ("model.layers.0.mlp.megamoe.l2_global_scale", 4 * 1, struct.pack("<f", 2.0 ** -130)),
    "NaN E4M3 block-scale byte": ("model.layers.1.mlp.megamoe.l1_scale", 4 * 17 + 2, b"\x7f"),
}
#: damage -> (native outcome, vLLM path outcome) at verify none, headers, checksums. The vLLM path refuses a bad
#: per-expert scale even at "none": its config-time folder check (`integrations.folder.check_folder_for_model`,
#: the meta dry run) runs the load checks at "headers" whatever the level.
EXPECTED = {
    "clean": (("served", "served"), ("served", "served"), ("served", "served")),
    "NaN global scale": (("unusable", "refused"), ("refused", "refused"), ("refused", "refused")),
    "subnormal global scale": (("unusable", "refused"), ("refused", "refused"), ("refused", "refused")),
    "NaN E4M3 block-scale byte": (("served", "served"), ("served", "served"), ("refused", "refused")),
}
_STRICTNESS = {"served": 0, "unusable": 1, "refused": 2}


def _bytes(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().contiguous().reshape(-1).view(torch.uint8) for n, t in layer.named_parameters()}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_vllm_loader_checks_at_least_what_the_native_load_checks(plugin, ckpts, tmp_path, monkeypatch, damage):
    _, folder = ckpts.fresh_converted("modelopt-nvfp4", tmp_path / "out", seed=5)
    name, offset, data = DAMAGES[damage]
    if name is not None:
        _poke(folder, name, offset, data)
    for level, want in zip(LEVELS, EXPECTED[damage]):
        (native, nd), ((vllm, vd), model) = _native(folder, level), _vllm(plugin, folder, level, monkeypatch)
        where = f"{damage} at verify={level!r}: native {native} ({nd[:300]}); vLLM path {vllm} ({vd[:300]})"
        assert _STRICTNESS[vllm] >= _STRICTNESS[native], where
        assert (native, vllm) == want, where
        if damage == "clean":  # the plugin's layers hold exactly what the native load gives
            ck = mr.open_checkpoint(folder)
            for li in ck.layers:
                ref = _bytes(ck.build_layer(li.index, backend="reference"))
                got = _bytes(getattr(model, f"moe{li.index}").megamoe_experts)
                assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_vllm_layer_parameters_refuse_raw_weight_loading(plugin, ckpts, monkeypatch):
    """vLLM's default loader cannot push per-expert tensors into the kernel-layout parameters."""
    _, folder = ckpts.converted("modelopt-nvfp4")
    (outcome, detail), model = _vllm(plugin, folder, "headers", monkeypatch)
    assert outcome == "served", detail
    routed = getattr(model, f"moe{mr.open_checkpoint(folder).layers[0].index}")
    for vname, _ in plugin._VLLM_PARAM_ROLES:
        p = getattr(routed, vname)
        with pytest.raises(MegaMoEError, match="filled by the megamoe loader"):
            p.weight_loader(p, torch.zeros(1))
