"""The layer API called the wrong way: each case is refused in one line naming what was wrong, or (the
silent ones) computes what an independent build computes. Every case failed before its fix."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import megamoe_runtime as mr
from megamoe_runtime.errors import (CheckpointError, LayerUnusableError, ManifestError, MegaMoEError, ReloadError,
                                    ScaleError)


def _inputs(spec, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, spec.hidden, generator=g).to(torch.bfloat16)
    w = torch.rand(T, spec.top_k, generator=g)
    ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[:spec.top_k] for _ in range(T)])
    return x, w, ids


@pytest.mark.parametrize("init", ["empty", "zeros"])
def test_a_layer_never_loaded_refuses_to_run(ckpts, init):
    """allocate_layer (or the constructor) gives parameters holding no weights: a forward ran on whatever
    memory they got (bf16 row: values ~1e38) or on zeros, silently."""
    _, out = ckpts.converted("bf16")
    ck = mr.open_checkpoint(out)
    layer = ck.allocate_layer(0, backend="reference", init=init)
    x, w, ids = _inputs(layer.spec)
    with pytest.raises(LayerUnusableError, match="model.layers.0.mlp is unusable: it was allocated and never loaded"):
        layer(x, w, ids)
    ck.load_layer(layer)
    assert torch.equal(layer(x, w, ids), ck.build_layer(0, backend="reference")(x, w, ids))


def test_no_forward_while_a_load_pass_is_open(ckpts):
    """Between begin_load (or a raw weight_loader call) and finish_load the weights may be half written: a
    forward then ran on a mix of two checkpoints (one expert's gate from another source here), silently."""
    _, out = ckpts.converted("bf16")
    layer = mr.open_checkpoint(out).build_layer(0, backend="reference")
    x, w, ids = _inputs(layer.spec)
    ref = layer(x, w, ids)
    layer.begin_load()
    with pytest.raises(LayerUnusableError, match="a load pass is open .* call finish_load"):
        layer(x, w, ids)
    layer.finish_load()
    assert torch.equal(layer(x, w, ids), ref)
    gate = torch.randn(layer.spec.intermediate, layer.spec.hidden).to(torch.bfloat16)
    layer.weight_loader(None, gate, "model.layers.0.mlp.experts.1.gate_proj.weight", "w1", 1)
    with pytest.raises(LayerUnusableError, match="a load pass is open"):
        layer(x, w, ids)


def test_load_state_dict_is_a_load(ckpts):
    """load_state_dict of an NVFP4 layer left the device scalars derived from the loaded ones (l2_alpha,
    a2_scales, l1_alpha_gate: what the deepgemm backend hands its kernels) and load_generation (its cached
    host a2) at the old checkpoint's values. Now they equal a fresh build of the checkpoint whose state dict
    was loaded, and a complete state dict makes a never-loaded layer usable; a partial one does not."""
    _, out_a = ckpts.converted("modelopt-nvfp4", seed=0)
    _, out_b = ckpts.converted("modelopt-nvfp4", seed=3)
    a = mr.open_checkpoint(out_a).build_layer(0, backend="reference")
    b = mr.open_checkpoint(out_b).build_layer(0, backend="reference")
    assert float(a.l2_activation_scale) != float(b.l2_activation_scale)
    gen = a.load_generation
    a.load_state_dict(b.state_dict())
    for name in ("l2_activation_scale", "a2_scales", "l2_alpha", "l1_alpha_gate"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.load_generation > gen
    x, w, ids = _inputs(a.spec)
    assert torch.equal(a(x, w, ids), b(x, w, ids))

    fresh = mr.open_checkpoint(out_b).allocate_layer(0, backend="reference")
    partial = {k: v for k, v in b.state_dict().items() if k != "l2_weight"}
    fresh.load_state_dict(partial, strict=False)
    with pytest.raises(LayerUnusableError, match="never loaded"):
        fresh(x, w, ids)
    fresh.load_state_dict(b.state_dict())
    assert torch.equal(fresh(x, w, ids), b(x, w, ids))


def test_topk_arguments_must_be_tensors(ckpts):
    _, out = ckpts.converted("bf16")
    layer = mr.open_checkpoint(out).build_layer(0, backend="reference")
    x, w, ids = _inputs(layer.spec)
    with pytest.raises(MegaMoEError, match=r"topk_weights must be a torch.Tensor \[5, 2\], got list"):
        layer(x, w.tolist(), ids)
    with pytest.raises(MegaMoEError, match=r"topk_ids must be a torch.Tensor \[5, 2\], got list"):
        layer(x, w, ids.tolist())


def test_layer_index_is_an_int(ckpts):
    """build_layer(True) built layer 1 (True == 1); build_layer("0") said 'no MoE layer 0; layers: [0, 1]'."""
    _, out = ckpts.converted("bf16")
    ck = mr.open_checkpoint(out)
    for bad in (True, "0", 0.0, None):
        with pytest.raises(ManifestError, match=r"a MoE layer index is an int, got .*; layers: \[0, 1\]"):
            ck.build_layer(bad)
    import numpy as np

    assert ck.build_layer(np.int64(1), backend="reference").layer_index == 1


def test_load_layer_refuses_what_it_cannot_load_into(ckpts):
    _, out = ckpts.converted("bf16")
    ck = mr.open_checkpoint(out)
    with pytest.raises(CheckpointError, match="load_layer takes a DeepGemmMegaMoEExperts .*, got Linear"):
        ck.load_layer(nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="is on the meta device: it has no storage to load into"):
        ck.build_layer(0, device="meta")  # was: AssertionError 'Torch not compiled with CUDA enabled'
    with pytest.raises(ReloadError, match=r"verify_reload takes a layer or a model \(torch.nn.Module\), got str"):
        mr.verify_reload("model.layers.0.mlp", out)
    with pytest.raises(CheckpointError, match="raw loads take a layer or a model"):
        mr.load_raw_weights("model", [])


def test_layer_index_and_prefix_naming_different_layers_refused(ckpts):
    """A layer whose layer_index names layer 0 and whose prefix names layer 1 was loaded with layer 0's
    weights, silently: which one the caller meant is unknown."""
    _, out = ckpts.converted("bf16")
    ck = mr.open_checkpoint(out)
    layer = ck.allocate_layer(1, backend="reference")
    layer.layer_index = 0
    with pytest.raises(CheckpointError, match=r"layer_index=0 and prefix='model.layers.1.mlp' name different"):
        ck.load_layer(layer)
    assert not mr.verify_reload(layer, out).ok


def test_a2_only_on_nvfp4_layers(ckpts):
    _, out = ckpts.converted("bf16")
    layer = mr.open_checkpoint(out).build_layer(0, backend="reference")
    with pytest.raises(ScaleError, match="row bf16 has no l2_activation_scale"):
        layer.set_l2_activation_scale(0.01)


@pytest.mark.parametrize("fmt", ["bf16", "modelopt-mxfp4"])
def test_a_raw_load_missing_an_expert_is_refused(ckpts, fmt):
    """A raw checkpoint without expert 3 of layer 0 raw-loaded into a fresh layer: the load completed and the
    layer ran expert 3 on uninitialised memory (bf16: NaN outputs; mxfp4: calc_diff 0.09 against the
    complete source), silently. Into a loaded layer the same load mixed two checkpoints."""
    from megamoe_runtime.load.raw_load import load_raw_checkpoint

    _, out = ckpts.converted(fmt)
    bad = ckpts.source(fmt, seed=1, missing_expert=(0, 3))
    ck = mr.open_checkpoint(out)
    for layer in (ck.allocate_layer(0, backend="reference"), ck.build_layer(0, backend="reference")):
        with pytest.raises(CheckpointError, match=r"raw load incomplete, the pass wrote no w1 weight for experts "
                                                  r"\[3\]; no w2 weight for experts \[3\]"):
            load_raw_checkpoint(layer, bad)
        with pytest.raises(LayerUnusableError, match="raw load's final checks failed"):
            layer(*_inputs(layer.spec))
    # a complete raw load makes it usable again
    load_raw_checkpoint(layer, ckpts.source(fmt, seed=1))
    assert torch.isfinite(layer(*_inputs(layer.spec))).all()


def test_a_partial_weight_loader_pass_completes_only_a_loaded_layer(ckpts):
    """weight_loader of one expert then finish_load: an update of a loaded layer's expert (the caller's
    choice), but a never-loaded layer's other experts hold no weights: refused, the layer stays unusable."""
    _, out = ckpts.converted("bf16")
    ck = mr.open_checkpoint(out)
    spec = ck.layer_spec(0)
    gate = torch.randn(spec.intermediate, spec.hidden).to(torch.bfloat16)
    name = "model.layers.0.mlp.experts.1.gate_proj.weight"
    loaded = ck.build_layer(0, backend="reference")
    loaded.weight_loader(None, gate, name, "w1", 1)
    loaded.finish_load()
    loaded(*_inputs(spec))
    fresh = ck.allocate_layer(0, backend="reference")
    fresh.weight_loader(None, gate, name, "w1", 1)
    with pytest.raises(CheckpointError, match=r"no w1 weight for experts \[0, 2, 3, 4, 5, 6, 7\]"):
        fresh.finish_load()
    with pytest.raises(LayerUnusableError):
        fresh(*_inputs(spec))


def test_a_raw_pass_whose_final_checks_fail_leaves_the_layer_unusable(ckpts):
    """One w1 weight_scale_2 raw-loaded into a served NVFP4 layer: finish_load refuses the incomplete pair,
    but the layer kept running on the half-updated l1_alpha (its derived l1_alpha_gate not refreshed)."""
    _, out = ckpts.converted("modelopt-nvfp4")
    layer = mr.open_checkpoint(out).build_layer(0, backend="reference")
    x, w, ids = _inputs(layer.spec)
    layer.weight_loader(None, torch.tensor(2.0 * float(layer.l1_alpha[0, 0])),
                        "model.layers.0.mlp.experts.0.gate_proj.weight_scale_2", "w1", 0)
    with pytest.raises(ScaleError, match="raw NVFP4 load incomplete"):
        layer.finish_load()
    with pytest.raises(LayerUnusableError, match="raw load's final checks failed: ScaleError"):
        layer(x, w, ids)


@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "fp8-block"])
@pytest.mark.parametrize("cast", ["float", "half", "bfloat16"])
def test_a_module_wide_cast_keeps_the_kernel_dtypes(ckpts, fmt, cast):
    """model.half() / .float() / .bfloat16() / .to(dtype) cast every floating tensor of every module: E4M3
    weights and fp32 block scales became bf16/fp16/fp32 (the next forward: LayoutError 'dtype torch.float32 !=
    torch.float8_e4m3fn'), and an NVFP4 layer's fp32 alphas became bf16 and ran, rounded, silently. The layer
    now keeps its dtypes and storage (with one warning); a device move still applies."""
    _, out = ckpts.converted(fmt)
    ck = mr.open_checkpoint(out)
    ref = ck.build_layer(0, backend="reference")
    layer = ck.build_layer(0, backend="reference")
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), layer)
    snap = layer.storage_snapshot()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        getattr(model, cast)()
    msgs = [str(g.message) for g in got]
    assert all(m.startswith("megamoe layers keep their kernel-layout dtypes: the cast (") for m in msgs), msgs
    if fmt == "fp8-block":  # E4M3 weights: every cast would change them
        assert msgs and "torch.float8_e4m3fn -> " in msgs[0]
    assert layer.storage_snapshot() == snap
    assert model[0].weight.dtype == getattr(torch, {"float": "float32", "half": "float16"}.get(cast, cast))
    x, w, ids = _inputs(layer.spec)
    assert torch.equal(layer(x, w, ids), ref(x, w, ids))
    layer.to("meta")
    assert layer.device.type == "meta" and layer.l1_weight.dtype == ref.l1_weight.dtype


class _NoCheckBackend:
    """Stands in for a GPU backend: takes any ids, records the call (the triton backend drops out-of-range ids
    and sums a repeated expert twice; neither is checked there)."""

    name, native_ep = "nocheck", False

    def __init__(self):
        self.calls = 0

    def forward(self, layer, x, w, ids, shared_input=None):
        self.calls += 1
        return torch.zeros_like(x)


@pytest.mark.parametrize("bad", ["out_of_range", "below_minus_one", "repeated"])
def test_check_routing_knob_refuses_bad_ids_on_any_backend(ckpts, monkeypatch, bad):
    """MEGAMOE_CHECK_ROUTING=1: the layer runs the reference backend's routing check before a backend that does
    not check; unset, the same ids reach the backend (the negative control); good ids pass with it set."""
    _, out = ckpts.converted("bf16")
    layer = mr.open_checkpoint(out).build_layer(0, backend="reference")
    layer.backend = spy = _NoCheckBackend()
    x, w, ids = _inputs(layer.spec)
    E = layer.spec.num_experts
    bad_ids = ids.clone()
    if bad == "out_of_range":
        bad_ids[2, 1], want = E, f"topk_ids\\[2, 1\\] = {E} is out of range; valid: -1 \\(masked\\) or 0..{E - 1}"
    elif bad == "below_minus_one":
        bad_ids[0, 0], want = -2, "topk_ids\\[0, 0\\] = -2 is out of range"
    else:
        bad_ids[3, 1], want = bad_ids[3, 0], f"token 3 routes to expert {int(bad_ids[3, 0])} more than once"
    monkeypatch.delenv("MEGAMOE_CHECK_ROUTING", raising=False)
    layer(x, w, bad_ids)
    assert spy.calls == 1
    monkeypatch.setenv("MEGAMOE_CHECK_ROUTING", "1")
    with pytest.raises(MegaMoEError, match=want):
        layer(x, w, bad_ids)
    assert spy.calls == 1
    masked = ids.clone()
    masked[1] = -1
    layer(x, w, masked)
    assert spy.calls == 2
