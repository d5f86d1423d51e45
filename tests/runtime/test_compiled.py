"""torch.compile of a layer (``layer/compiled.py``): the backend call is one opaque op, the bits are eager's."""
from __future__ import annotations

import pytest
import torch

import megamoe_runtime as mr
from megamoe_runtime.errors import MegaMoEError
from megamoe_runtime.layer import compiled

OP = torch.ops.megamoe.routed_experts


def _inputs(layer, T: int = 7, seed: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    spec = layer.spec
    x = torch.randn(T, spec.hidden, generator=g).to(torch.bfloat16)
    w = torch.rand(T, spec.top_k, generator=g)
    ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[:spec.top_k] for _ in range(T)])
    ids[1, -1] = -1
    return x.to(device), w.to(device), ids.to(device)


def recording_backend(graphs: list):
    """A dynamo backend that keeps each traced graph and runs it as traced (no inductor: CPU tests need no
    compiler)."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


def op_calls(graphs: list) -> int:
    return sum(1 for gm in graphs for n in gm.graph.nodes
               if n.op == "call_function" and n.target in (OP, OP.default))


@pytest.fixture(scope="module")
def layer(ckpts):
    _, out = ckpts.converted("modelopt-mxfp4", shared=1)
    return mr.open_checkpoint(out).build_layer(0, backend="reference")


def test_compiled_layer_is_one_op_with_eager_bits(layer):
    assert layer.shared_fused  # the op also carries the fused shared expert
    x, w, ids = _inputs(layer)
    want = layer(x, w, ids)
    graphs: list = []
    got = torch.compile(layer, backend=recording_backend(graphs), fullgraph=True)(x, w, ids)
    assert torch.equal(got, want)
    assert op_calls(graphs) == 1
    # another batch size runs the same way (a new trace or a dynamic one: either way one op per graph)
    x2, w2, ids2 = _inputs(layer, T=3, seed=1)
    got2 = torch.compile(layer, backend=recording_backend(graphs), fullgraph=True)(x2, w2, ids2)
    assert torch.equal(got2, layer(x2, w2, ids2))


def test_without_the_op_the_layer_does_not_compile(layer, monkeypatch):
    """Negative control: a routed call that skips the op hands dynamo the backend itself, and a whole-graph
    compile fails (the reference backend's input checks branch on tensor data: a host sync per call)."""
    monkeypatch.setattr(compiled, "routed_call", lambda lay, x, w, ids, sh: lay.backend.forward(
        lay, x, w, ids, shared_input=sh))
    torch._dynamo.reset()
    x, w, ids = _inputs(layer)
    graphs: list = []
    try:
        with pytest.raises(Exception):
            torch.compile(layer, backend=recording_backend(graphs), fullgraph=True)(x, w, ids)
    finally:
        torch._dynamo.reset()
    assert op_calls(graphs) == 0


def test_a_freed_layer_is_named_not_run():
    spec = mr.LayerSpec("mxfp8", hidden=256, intermediate=128, num_experts=4, top_k=2)
    tmp = mr.DeepGemmMegaMoEExperts(spec, backend="reference")
    h = tmp.op_handle
    x, w, ids = _inputs(tmp, T=2)
    del tmp
    import gc

    gc.collect()
    with pytest.raises(MegaMoEError, match=f"layer handle {h} no longer exists"):
        OP(x, w, ids, h, False)


def test_handles_are_per_layer(layer):
    spec = mr.LayerSpec("mxfp8", hidden=256, intermediate=128, num_experts=4, top_k=2)
    other = mr.DeepGemmMegaMoEExperts(spec, backend="reference")
    assert other.op_handle != layer.op_handle and compiled._HANDLES[other.op_handle] is other


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("row", ["modelopt-mxfp4", "modelopt-nvfp4"])
def test_gpu_inductor_cuda_graphs_give_eager_bits(ckpts, row):
    """The triton backend under inductor with CUDA graphs ("reduce-overhead", what transformers' static-cache
    generate uses): replays equal eager bit for bit, also after the inputs change in place."""
    _, out = ckpts.converted(row, shared=1)
    lay = mr.open_checkpoint(out).build_layer(0, device="cuda")
    assert lay.backend.name in ("triton", "deepgemm")
    x, w, ids = _inputs(lay, T=5, device="cuda")
    c = torch.compile(lay, mode="reduce-overhead", fullgraph=True)
    for seed in (0, 1, 2):  # the first calls record, the later ones replay the graph
        x2, w2, ids2 = _inputs(lay, T=5, seed=seed, device="cuda")
        x.copy_(x2), w.copy_(w2), ids.copy_(ids2)
        got = c(x, w, ids).clone()
        assert torch.equal(got, lay(x, w, ids)), seed


def test_a_compiled_layer_still_refuses_when_unusable(layer):
    """The forward's own checks stay in front of the op (dynamo guards on them): a layer marked unusable (a
    failed reload) refuses through the compiled call too, naming why, and runs again once usable."""
    from megamoe_runtime.errors import LayerUnusableError

    x, w, ids = _inputs(layer)
    torch._dynamo.reset()
    c = torch.compile(layer, backend=recording_backend([]))  # transformers' generate compiles this way
    want = c(x, w, ids)
    layer.unusable_reason = "a reload failed (test)"
    try:
        with pytest.raises(LayerUnusableError, match="a reload failed"):
            c(x, w, ids)
    finally:
        layer.unusable_reason = None
    assert torch.equal(c(x, w, ids), want)
    torch._dynamo.reset()
