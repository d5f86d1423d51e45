"""DeepGemmMegaMoEExperts: kernel-layout parameters allocated once, the forward
signature, and shared-expert fusion decided at construction."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import megamoe_runtime as mr
from megamoe_runtime.backends.reference import ReferenceBackend, reference_forward, shared_slot
from megamoe_runtime.errors import BackendUnavailableError, LayerSpecError, LayerUnusableError, MegaMoEError, ScaleError
from megamoe_runtime.format import codecs, layout
from megamoe_runtime.format.manifest import kernel_strides_of
from megamoe_runtime.layer.experts import DeepGemmMegaMoEExperts
from megamoe_runtime.testing import calc_diff


def _inputs(T: int = 7, H: int = 256, K: int = 2, E: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[1, 1] = -1
    return x, w, ids


@pytest.mark.parametrize("row", ["mxfp4", "mxfp8", "nvfp4", "bf16"])
def test_parameters_are_the_kernel_tensors(row):
    spec = mr.LayerSpec(row, hidden=256, intermediate=128, num_experts=8, top_k=2, ep_rank=1, ep_size=2)
    layer = DeepGemmMegaMoEExperts(spec, backend="reference")
    shapes = layout.kernel_shapes(row, 4, 256, 128)
    for role, shape in shapes.items():
        p = getattr(layer, role)
        assert isinstance(p, nn.Parameter) and not p.requires_grad
        assert tuple(p.shape) == shape and p.dtype == (torch.int32 if "scale" in role else
                                                       spec.row_spec.weight.kernel_dtype)
        storage = "mn_major_physical" if "scale" in role else "contiguous"
        assert tuple(p.stride()) == kernel_strides_of(storage, shape)
        if "scale" in role:
            layout.check_kernel_strides(p, role)
            assert layout.physical(p).is_contiguous()
    if row == "bf16":
        assert layer.l1_scale is None and layer.l2_scale is None
    if row == "nvfp4":
        assert layer.l1_alpha.shape == (4, 2) and layer.l2_global_scale.shape == (4,)
        assert torch.isnan(layer.l2_activation_scale)  # unset until loaded
        assert set(dict(layer.named_buffers())) == {"l2_activation_scale", "a2_scales", "l2_alpha", "l1_alpha_gate"}
    assert layer.spec.local_experts == range(4, 8)
    assert "local 4..7" in repr(layer)


def test_stored_physical_copy_reaches_the_kernel_view():
    """A file stores an MN-major scale in its physical order; one copy_ into
    param.transpose(-1, -2) makes the kernel view exactly its transpose."""
    spec = mr.LayerSpec("mxfp4", hidden=256, intermediate=128, num_experts=2, top_k=1)
    layer = DeepGemmMegaMoEExperts(spec, backend="reference")
    phys = torch.arange(2 * 2 * 256, dtype=torch.int32).reshape(2, 2, 256)  # [E_l, P1, 2I]
    ptr = layer.l1_scale.data_ptr()
    layer.load_stored("l1_scale", phys, storage="mn_major_physical", experts=(0, 2))
    assert torch.equal(layer.l1_scale, phys.transpose(-1, -2)) and layer.l1_scale.data_ptr() == ptr
    with pytest.raises(mr.errors.LayoutError, match="stored dtype torch.int64"):
        layer.load_stored("l1_scale", phys.long(), storage="mn_major_physical")
    with pytest.raises(mr.errors.LayoutError, match="not all local"):
        layer.load_stored("l1_scale", phys[:1], storage="mn_major_physical", experts=(2, 3))


def test_forward_is_the_reference_numerics(ckpts):
    _, out = ckpts.converted("modelopt-mxfp4", shared=1)
    ck = mr.open_checkpoint(out)
    layer = ck.build_layer(0, backend="reference")
    assert layer.shared_fused and layer.shared_reason == ""
    x, w, ids = _inputs()
    y = layer(x, w, ids)
    ref = reference_forward(layer.spec, layer.kernel_tensors(), x, w, ids, shared=layer.shared_kernel_tensors())
    assert torch.equal(y, ref)
    with pytest.raises(LayerSpecError, match="fused into this layer"):
        layer(x, w, ids, shared_experts=nn.Identity())


def test_unfused_checkpoint_shared_expert_is_built_by_the_layer(ckpts, layer_bytes):
    _, out = ckpts.converted("modelopt-mxfp4", shared=1)
    ck = mr.open_checkpoint(out)
    fused = ck.build_layer(1, backend="reference")
    unfused = ck.build_layer(1, backend="reference", fuse_shared=False)
    assert not unfused.shared_fused and "fuse_shared=False" in unfused.shared_reason
    assert isinstance(unfused.shared_mlp, mr.MegaMoESharedExpert)
    assert not hasattr(unfused, "shared_l1_weight") or unfused.shared_l1_weight is None
    fb, ub = layer_bytes(fused), layer_bytes(unfused)
    for role in ("shared_l1_weight", "shared_l1_scale", "shared_l2_weight", "shared_l2_scale"):
        assert torch.equal(fb[role], ub[f"shared_mlp.{role}"])
    x, w, ids = _inputs(seed=1)
    y = unfused(x, w, ids)
    routed = reference_forward(unfused.spec, unfused.kernel_tensors(), x, w, ids)
    sh = shared_slot(unfused.spec, unfused.shared_kernel_tensors(), x)
    assert torch.equal(y, (routed.float() + sh.float()).to(torch.bfloat16))  # added once
    assert calc_diff(y, fused(x, w, ids)) < 1e-4
    with pytest.raises(LayerSpecError, match="twice"):
        unfused(x, w, ids, shared_experts=nn.Identity())


class _NoFuse(ReferenceBackend):
    name = "nofuse"

    def supports_fused_shared(self, spec):
        return False


def test_backend_that_cannot_fuse_gets_the_layer_built_shared_mlp(ckpts):
    _, out = ckpts.converted("modelopt-mxfp4", shared=1)
    layer = mr.open_checkpoint(out).build_layer(0, backend=_NoFuse())
    assert not layer.shared_fused and "nofuse" in layer.shared_reason and layer.shared_mlp is not None


class _MLP(nn.Module):
    def __init__(self, H, I, dtype, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_proj = nn.Linear(H, I, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(H, I, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(I, H, bias=False, dtype=dtype)
        for m in (self.gate_proj, self.up_proj, self.down_proj):
            m.weight.data.copy_(torch.randn(m.weight.shape, generator=g) * 0.05)
            m.weight.requires_grad_(False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def test_engine_shared_module_fused_when_it_matches_a_fusable_spec(ckpts):
    _, out = ckpts.converted("bf16")
    ck = mr.open_checkpoint(out)
    mlp = _MLP(256, 128, torch.bfloat16)
    plain = ck.build_layer(0, backend="reference")
    fused = mr.DeepGemmMegaMoEExperts(ck.layer_spec(0), backend="reference", shared_experts=mlp,
                                      prefix="model.layers.0.mlp", layer_index=0)
    ck.load_layer(fused)
    assert fused.shared_fused and fused.spec.shared == mr.SharedSpec("bf16", 1, 128)
    assert torch.equal(layout.read_l1_weight(fused.shared_l1_weight, 1), mlp.up_proj.weight)
    x, w, ids = _inputs(seed=2)
    y = fused(x, w, ids)
    assert calc_diff(y, plain(x, w, ids, shared_experts=mlp)) < 1e-4
    with pytest.raises(LayerSpecError, match="fused into this layer"):
        fused(x, w, ids, shared_experts=mlp)


def test_engine_shared_module_mxfp8_fused_into_an_mx_row(ckpts):
    _, out = ckpts.converted("modelopt-mxfp4")
    ck = mr.open_checkpoint(out)
    ref = _MLP(256, 128, torch.float32, seed=3)
    mlp = nn.Module()
    for name in ("gate_proj", "up_proj", "down_proj"):
        q, s = codecs.quantize_mxfp8(getattr(ref, name).weight.detach())
        sub = nn.Module()
        sub.weight = nn.Parameter(q, requires_grad=False)
        sub.register_buffer("weight_scale", s)
        setattr(mlp, name, sub)
    layer = mr.DeepGemmMegaMoEExperts(ck.layer_spec(0), backend="reference", shared_experts=mlp)
    assert layer.shared_fused and layer.spec.shared.precision == "mxfp8"
    back = layout.read_l2_scale(layer.shared_l2_scale, 4)
    assert torch.equal(back, mlp.down_proj.weight_scale)


def test_non_fusable_shared_module_runs_outside_once(ckpts):
    _, out = ckpts.converted("bf16")
    ck = mr.open_checkpoint(out)
    mlp = _MLP(256, 128, torch.float16)
    layer = mr.DeepGemmMegaMoEExperts(ck.layer_spec(0), backend="reference", shared_experts=mlp,
                                      prefix="model.layers.0.mlp", layer_index=0)
    ck.load_layer(layer)
    assert not layer.shared_fused and "float16" in layer.shared_reason and layer.spec.shared is None
    x, w, ids = _inputs(seed=4)
    y = layer(x, w, ids, shared_experts=lambda h: mlp(h.half()))
    routed = layer(x, w, ids)
    assert torch.equal(y, (routed.float() + mlp(x.half()).float()).to(torch.bfloat16))
    with pytest.raises(LayerSpecError, match="cannot be fused.*float16"):
        mr.DeepGemmMegaMoEExperts(ck.layer_spec(0), backend="reference", shared_experts=mlp, fuse_shared=True)
    with pytest.raises(LayerSpecError, match="one source of shared experts"):
        spec = mr.LayerSpec.from_dict({**ck.layer_spec(0).to_dict(), "shared": {"precision": "bf16",
                                                                               "num_shared": 1,
                                                                               "intermediate": 128}})
        mr.DeepGemmMegaMoEExperts(spec, backend="reference", shared_experts=_MLP(256, 128, torch.bfloat16))


def test_forward_argument_checks_and_unloaded_scales(ckpts):
    spec = mr.LayerSpec("nvfp4", hidden=256, intermediate=128, num_experts=8, top_k=2)
    layer = DeepGemmMegaMoEExperts(spec, backend="reference", init="zeros")
    x, w, ids = _inputs()
    with pytest.raises(LayerUnusableError, match="never loaded"):
        layer(x, w, ids)
    with pytest.raises(ScaleError, match="l1_alpha is unset"):
        layer.finish_load()  # NaN scales: a load that wrote none of them does not complete
    with pytest.raises(LayerUnusableError, match="never loaded"):
        layer(x, w, ids)
    _, out = ckpts.converted("modelopt-nvfp4")
    layer = mr.open_checkpoint(out).build_layer(0, backend="reference")
    with pytest.raises(MegaMoEError, match="bf16"):
        layer(x.float(), w, ids)
    with pytest.raises(MegaMoEError, match="topk_weights must be float32"):
        layer(x, w.double(), ids)
    with pytest.raises(MegaMoEError, match="topk_ids must be integer"):
        layer(x, w, ids.float())
    with pytest.raises(MegaMoEError, match="topk_ids must be integer"):
        layer(x, w, ids[:, :1])


def test_backend_selection():
    spec = mr.LayerSpec("mxfp4", hidden=256, intermediate=128, num_experts=8, top_k=2)
    assert DeepGemmMegaMoEExperts(spec).backend.name == "reference"  # auto on CPU
    with pytest.raises(BackendUnavailableError, match="deepgemm"):
        DeepGemmMegaMoEExperts(spec, backend="deepgemm")
    with pytest.raises(BackendUnavailableError, match="unknown backend 'nope'"):
        DeepGemmMegaMoEExperts(spec, backend="nope")
    status = mr.backends.backend_status("cpu", spec)
    assert status["reference"] is True and status["triton"] != True  # noqa: E712


def test_ep_rank_forward_needs_a_process_group(ckpts):
    _, out = ckpts.converted("bf16")
    layer = mr.open_checkpoint(out).build_layer(0, backend="reference", ep_rank=1, ep_size=2)
    x, w, ids = _inputs()
    with pytest.raises(MegaMoEError, match="EP rank 1 of 2 .* needs torch.distributed initialised"):
        layer(x, w, ids)


def test_recv_stats_counting_needs_no_host_sync():
    """Counting ``cumulative_local_expert_recv_stats`` in the layer (backends that do
    not count themselves, e.g. triton) is a hot-path op: no data-dependent shapes
    (boolean-mask indexing, bincount), which would sync the host every forward.
    Meta tensors have no data, so any such op fails on them."""

    class Stub:
        name = "stub"

        def supports(self, spec):
            return True

        def supports_fused_shared(self, spec):
            return False

        def forward(self, layer, x, w, ids, shared_input=None):
            return torch.empty_like(x)

    spec = mr.LayerSpec("bf16", hidden=256, intermediate=128, num_experts=8, top_k=2)
    layer = DeepGemmMegaMoEExperts(spec, device="meta", backend=Stub())
    layer.begin_load()
    layer.finish_load()  # "loaded" (the stub reads no weights)
    stats = layer.track_expert_recv_stats()
    x = torch.empty(5, 256, dtype=torch.bfloat16, device="meta")
    w = torch.empty(5, 2, dtype=torch.float32, device="meta")
    ids = torch.empty(5, 2, dtype=torch.int64, device="meta")
    layer(x, w, ids)
    assert layer.expert_recv_stats is stats and stats.shape == (8,) and stats.dtype == torch.int32
    # and the counts are right on real tensors (masked -1 and other ranks' ids ignored)
    spec = mr.LayerSpec("bf16", hidden=256, intermediate=128, num_experts=8, top_k=2)
    layer = DeepGemmMegaMoEExperts(spec, backend=Stub())
    layer.begin_load()
    layer.finish_load()
    stats = layer.track_expert_recv_stats()
    ids = torch.tensor([[0, 3], [3, -1], [7, 0]])
    layer(torch.zeros(3, 256, dtype=torch.bfloat16), torch.ones(3, 2), ids)
    layer(torch.zeros(3, 256, dtype=torch.bfloat16), torch.ones(3, 2), ids)
    assert stats.tolist() == [4, 0, 0, 4, 0, 0, 0, 2]


def test_set_l2_activation_scale_outside_a_load_refreshes_what_kernels_read(ckpts):
    """a2 set by hand (not through a load) reaches l2_alpha / a2_scales at once,
    in place, and advances load_generation so cached host scalars are re-read."""
    _, out = ckpts.converted("modelopt-nvfp4")
    ck = mr.open_checkpoint(out)
    layer = ck.build_layer(ck.layers[0].index, backend="reference")
    ptrs = (layer.l2_alpha.data_ptr(), layer.a2_scales.data_ptr())
    gen = layer.load_generation
    layer.set_l2_activation_scale(0.5)
    assert torch.equal(layer.l2_alpha, layer.l2_global_scale * 0.5)
    assert bool((layer.a2_scales == 0.5).all())
    assert (layer.l2_alpha.data_ptr(), layer.a2_scales.data_ptr()) == ptrs
    assert layer.load_generation == gen + 1


@pytest.mark.parametrize("a2", [1e300, 1e-300, 3.5e38])
def test_a2_outside_float32_is_a_scale_error(ckpts, a2):
    """a2 is stored as FP32: a double that overflows to inf or underflows to 0
    there is refused with a ScaleError naming the value, and the buffer keeps
    its old value (a bare fill_ would raise a RuntimeError or store 0)."""
    _, out = ckpts.converted("modelopt-nvfp4")
    ck = mr.open_checkpoint(out)
    layer = ck.build_layer(ck.layers[0].index, backend="reference")
    before = float(layer.l2_activation_scale)
    with pytest.raises(ScaleError, match="float32"):
        layer.set_l2_activation_scale(a2)
    assert float(layer.l2_activation_scale) == before
    layer.set_l2_activation_scale(1e-30)  # negative control: small but a float32 normal
    assert float(layer.l2_activation_scale) == torch.tensor(1e-30, dtype=torch.float32).item()


# --------------------------------------------------------------------------- backend hooks around loads


class _HookRecorder(ReferenceBackend):
    """A backend with the optional load hooks (the triton backend keeps its fold flags with them): records
    each call with the layer's load generation, so a test sees which loads announce writes and results."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, int]] = []

    def weights_changing(self, layer) -> None:
        self.events.append(("changing", layer.load_generation))

    def weights_loaded(self, layer) -> None:
        self.events.append(("loaded", layer.load_generation))


def test_backend_hooks_bracket_every_load(ckpts):
    """Every path that writes weights calls ``weights_changing`` before its first byte and every load that
    succeeds calls ``weights_loaded`` after it (with the new generation), so facts a backend derives from
    the weights never outlive them; a dry run moves no byte and leaves the layer loaded."""
    _, out = ckpts.converted("modelopt-nvfp4")
    ck = mr.open_checkpoint(out)
    rec = _HookRecorder()
    layer = ck.build_layer(0, backend=rec)
    assert rec.events and rec.events[0][0] == "changing" and rec.events[-1] == ("loaded", layer.load_generation)
    rec.events.clear()
    ck.load_layer(layer)  # a stored reload
    assert rec.events[0][0] == "changing" and rec.events[-1] == ("loaded", layer.load_generation)
    assert [e for e, _ in rec.events].count("loaded") == 1
    rec.events.clear()
    layer.load_state_dict(layer.state_dict())
    assert rec.events[0][0] == "changing" and rec.events[-1] == ("loaded", layer.load_generation)
    rec.events.clear()
    layer.begin_load()  # a load that fails: changing, and no loaded until one succeeds
    layer.abort_load()
    assert [e for e, _ in rec.events] == ["changing"]
    rec.events.clear()
    rep = mr.verify_reload(layer, out)
    assert rep.ok, rep.problems()
    assert not rec.events or rec.events[-1][0] == "loaded", rec.events  # never left announcing a write
