"""Loaders: raw (vLLM-style) and pre-laid-out loading give the same bytes;
NVFP4 scalar state (pairwise w1/w3 check within one load, a2 over all experts)."""
from __future__ import annotations

import random

import pytest
import torch

from megamoe_runtime.files.tensor_bytes import byte_view
from torch.utils._python_dispatch import TorchDispatchMode

import megamoe_runtime as mr
from megamoe_runtime.errors import CheckpointError, LayoutError, ScaleError
from megamoe_runtime.files.file_io import FileSlice, SafetensorsFile
from megamoe_runtime.layer.experts import DeepGemmMegaMoEExperts
from megamoe_runtime.layer.loaders import make_expert_params_mapping, parse_expert_weight_name
from megamoe_runtime.load.raw_load import load_raw_checkpoint, load_raw_weights


def _raw_layer(ckpt: mr.Checkpoint, index: int, ep_rank: int = 0, ep_size: int = 1) -> DeepGemmMegaMoEExperts:
    li = ckpt.layer_entry(index)
    return DeepGemmMegaMoEExperts(ckpt.layer_spec(index, ep_rank, ep_size), backend="reference",
                                  prefix=li.prefix, layer_index=index)


def _expert_tensors(src) -> list[tuple[str, torch.Tensor]]:
    out = []
    for path in sorted(src.glob("*.safetensors")):
        with SafetensorsFile(path) as f:
            for name in f.keys():
                if parse_expert_weight_name(name) is not None:
                    out.append((name, f.tensor(name).clone()))
    return out


# every row, every scale convention (ModelOpt multiplier, CT divisor, Quark input_scale_2,
# DeepSeek-V4 I8 + F8_E8M0), unquantized sources, and fused shared experts per fusable precision
BYTE_IDENTITY = [
    ("modelopt-nvfp4", {}),
    ("ct-nvfp4", {}),
    ("quark-nvfp4", {}),
    ("modelopt-nvfp4", {"shared": 1, "shared_format": "bf16"}),
    ("modelopt-mxfp4", {}),
    ("modelopt-mxfp4", {"shared": 2}),  # mxfp4 shared -> mxfp8 (exact), S=2 folded
    ("deepseek-v4", {}),
    ("ct-mxfp8", {}),
    ("modelopt-mxfp8", {"shared": 1}),
    ("bf16", {"shared": 1}),
    ("fp32", {"naming": "w123"}),
]


@pytest.mark.parametrize("fmt,kw", BYTE_IDENTITY, ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in kw.items())}"
                                                       for f, kw in BYTE_IDENTITY])
def test_raw_load_is_byte_identical_to_convert_then_load(ckpts, layer_bytes, fmt, kw):
    src, out = ckpts.converted(fmt, **kw)
    ck = mr.open_checkpoint(out)
    for li in ck.layers:
        converted = ck.build_layer(li.index, backend="reference")
        raw = _raw_layer(ck, li.index)
        rep = load_raw_checkpoint(raw, src)
        assert rep.written and not rep.unknown
        a, b = layer_bytes(converted), layer_bytes(raw)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"{fmt} layer {li.index}: {name} differs"
        assert converted.shared_fused == raw.shared_fused == (li.spec.shared is not None)


def test_raw_load_any_order_and_ep_filtering(ckpts, layer_bytes):
    """Shuffled shards, two EP ranks: each rank keeps only its experts, yet both
    read every expert's w2 input scale, so a2 agrees and equals the converter's."""
    src, out = ckpts.converted("modelopt-nvfp4", ep_size=2)
    ck = mr.open_checkpoint(out)
    tensors = _expert_tensors(src)
    a2 = []
    for rank in range(2):
        random.Random(rank).shuffle(tensors)
        layer = _raw_layer(ck, 0, rank, 2)
        layer.prefix = ck.layer_entry(0).prefix
        model = torch.nn.ModuleDict({"l0": layer})
        rep = load_raw_weights(model, [(n, t) for n, t in tensors if n.startswith(layer.prefix + ".")])
        assert rep.skipped and all(int(n.split(".experts.")[1].split(".")[0]) not in layer.spec.local_experts
                                   for n in rep.skipped)
        ref = ck.build_layer(0, backend="reference", ep_rank=rank, ep_size=2)
        assert ck.last_opened_files == [f"megamoe-experts-rank{rank:03d}-of-002-00001.safetensors"]
        ra, rb = layer_bytes(ref), layer_bytes(layer)
        for name in ra:
            assert torch.equal(ra[name], rb[name]), f"rank {rank}: {name}"
        a2.append(float(layer.l2_activation_scale))
    assert a2[0] == a2[1] == pytest.approx(ck.layers[0].scalars["l2_activation_scale"], rel=0, abs=0)


def test_w13_scale_mismatch_raises_naming_expert_and_values(ckpts):
    src = ckpts.source("modelopt-nvfp4", scale_mismatch=(0, 3), mismatch_factor=2.0)
    _, out = ckpts.converted("modelopt-nvfp4")
    ck = mr.open_checkpoint(out)
    layer = _raw_layer(ck, 0)
    with pytest.raises(ScaleError, match=r"expert 3: w1 \(gate\) weight_scale_2 = .* and w3 \(up\) weight_scale_2 = "):
        load_raw_checkpoint(layer, src)


def test_reload_with_changed_scales_in_shuffled_order_passes(ckpts, layer_bytes):
    """The pairwise w1/w3 check compares values of ONE load, never the slot: a
    reload whose w3 (new value) arrives before w1 must not be compared with the
    old w1 still in the parameter."""
    src_a, out_a = ckpts.converted("modelopt-nvfp4", seed=0)
    src_b, out_b = ckpts.converted("modelopt-nvfp4", seed=7)
    ck_a, ck_b = mr.open_checkpoint(out_a), mr.open_checkpoint(out_b)
    layer = _raw_layer(ck_a, 0)
    load_raw_checkpoint(layer, src_a)
    snap = layer.storage_snapshot()
    old_alpha = layer.l1_alpha.clone()
    tensors = [(n, t) for n, t in _expert_tensors(src_b) if n.startswith(layer.prefix + ".")]
    # every w3 global scale first, then everything else shuffled
    w3_first = sorted(tensors, key=lambda nt: (0 if ".up_proj.weight_scale_2" in nt[0] else 1, random.random()))
    assert any(".up_proj.weight_scale_2" in n for n, _ in w3_first[:8])
    load_raw_weights(layer, w3_first)
    assert not torch.equal(layer.l1_alpha, old_alpha), "the synthetic reload must change the scales"
    assert layer.storage_snapshot() == snap
    fresh = ck_b.build_layer(0, backend="reference")
    a, b = layer_bytes(fresh), layer_bytes(layer)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_w2_input_scale_of_any_expert_is_an_error(ckpts):
    src, out = ckpts.converted("modelopt-nvfp4")
    ck = mr.open_checkpoint(out)
    layer = _raw_layer(ck, 0, ep_rank=0, ep_size=2)
    tensors = [(n, t) for n, t in _expert_tensors(src)
               if n.startswith(layer.prefix + ".") and n != f"{layer.prefix}.experts.6.down_proj.input_scale"]
    with pytest.raises(ScaleError, match=r"w2 input scale missing for experts \[6\].*ALL experts"):
        load_raw_weights(layer, tensors)
    # the streamed load wrote its bytes before the final check refused it: the layer will not run on them
    from megamoe_runtime.errors import LayerUnusableError

    assert "w2 input scale missing" in layer.unusable_reason
    x = torch.zeros(2, layer.spec.hidden, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(LayerUnusableError, match="raw load's final checks failed"):
        layer(x, torch.ones(2, 2), ids)
    load_raw_weights(layer, [(n, t) for n, t in _expert_tensors(src) if n.startswith(layer.prefix + ".")])
    assert layer.unusable_reason is None  # a load that succeeds makes it usable again


class _CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def test_prelaid_load_is_one_write_per_stored_tensor_into_the_same_storage(ckpts, layer_bytes, monkeypatch):
    _, out = ckpts.converted("modelopt-nvfp4")
    ck = mr.open_checkpoint(out)
    layer = ck.build_layer(0, backend="reference")
    snap, before = layer.storage_snapshot(), layer_bytes(layer)
    items = ck.plan(0, 0, 1, roles=layer.roles())
    reads = []
    real_read = FileSlice.read_into
    monkeypatch.setattr(FileSlice, "read_into", lambda self, dst: (reads.append(dst), real_read(self, dst)))
    with _CountCopies() as counter:
        ck.load_layer(layer)
    # one read per stored tensor, straight into the parameter's storage ...
    assert len(reads) == len(items)
    params = {layer.param_for_role(it.role).untyped_storage().data_ptr() for it in items}
    assert {d.untyped_storage().data_ptr() for d in reads} == params
    # ... and the only copy_ are the in-place refreshes of the derived device scalars
    assert counter.copies == 2
    # a tensor source goes in with exactly one copy_
    with _CountCopies() as counter:
        for it, src in ck.iter_sources(items):
            layer.load_stored(it.role, src, storage=it.entry.storage, experts=it.experts)
    assert counter.copies == len(items)
    assert layer.storage_snapshot() == snap
    after = layer_bytes(layer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_make_expert_params_mapping_drives_a_vllm_style_loop(ckpts, layer_bytes):
    src, out = ckpts.converted("ct-nvfp4")
    ck = mr.open_checkpoint(out)
    layer = _raw_layer(ck, 1)
    mapping = make_expert_params_mapping(ck.layers[1].spec.num_experts, fmt="compressed-tensors")
    params = {f"{layer.prefix}.experts.{n}": p for n, p in list(layer.named_parameters()) + list(layer.named_buffers())}
    layer.begin_load("raw")
    for name, tensor in _expert_tensors(src):
        if not name.startswith(layer.prefix + "."):
            continue
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            target = name.replace(weight_name, param_name) if param_name else None
            layer.weight_loader(params.get(target), tensor, name, shard_id, expert_id)
            break
        else:
            pytest.fail(f"no mapping for {name}")
    layer.finish_load()
    ref = ck.build_layer(1, backend="reference")
    a, b = layer_bytes(ref), layer_bytes(layer)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_parse_names_and_loader_argument_errors(ckpts):
    r = parse_expert_weight_name("model.layers.3.mlp.experts.17.up_proj.weight_global_scale")
    assert (r.prefix, r.expert_id, r.shard_id, r.kind, r.divisor, r.param_name) == \
        ("model.layers.3.mlp", 17, "w3", "global_scale", True, "l1_alpha")
    r = parse_expert_weight_name("layers.2.ffn.experts.5.w2.scale")
    assert (r.prefix, r.expert_id, r.shard_id, r.param_name) == ("layers.2.ffn", 5, "w2", "l2_scale")
    r = parse_expert_weight_name("model.layers.1.mlp.shared_experts.gate_proj.weight")
    assert r.shared and r.param_name == "shared_l1_weight"
    r = parse_expert_weight_name("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv")  # fp8_block's scale
    assert not r.unsupported and (r.kind, r.divisor, r.param_name) == ("scale", False, "l2_scale")
    assert parse_expert_weight_name("model.layers.1.mlp.gate.weight") is None

    _, out = ckpts.converted("modelopt-nvfp4")
    ck = mr.open_checkpoint(out)
    layer = _raw_layer(ck, 0)
    w = torch.zeros(128, 128, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="shard_id='w4'"):
        layer.weight_loader(None, w, "x.experts.0.gate_proj.weight", "w4", 0)
    with pytest.raises(LayoutError, match="expert_id=8"):
        layer.weight_loader(None, w, "x.experts.8.gate_proj.weight", "w1", 8)
    with pytest.raises(LayoutError, match="loads into 'l1_weight'"):
        layer.weight_loader(layer.l2_weight, w, "x.experts.0.gate_proj.weight", "w1", 0)
    with pytest.raises(CheckpointError, match="bias"):
        layer.weight_loader(None, w, "x.experts.0.gate_proj.bias", "w1", 0)
    with pytest.raises(LayoutError, match="source shape"):
        layer.weight_loader(None, torch.zeros(64, 128, dtype=torch.uint8), "x.experts.0.gate_proj.weight", "w1", 0)
    with pytest.raises(ScaleError, match="finite and > 0"):
        layer.weight_loader(None, torch.tensor(float("nan")), "x.experts.0.down_proj.weight_scale_2", "w2", 0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_parallel_file_reads_land_every_byte(tmp_path, monkeypatch, device):
    """Large stored tensors are read by several threads (CPU: straight into the
    parameter; CUDA: per-thread pinned chunks and streams): every byte lands once."""
    import megamoe_runtime.files.file_io as L

    monkeypatch.setattr(L, "_READ_CHUNK", 3 * 4096)
    monkeypatch.setattr(L, "_READ_MIN_PARALLEL", 8192)
    monkeypatch.setattr(L, "_worker_staging", {})
    monkeypatch.setenv("MEGAMOE_LOAD_THREADS", "3")
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, ((1 << 20) + 4096 + 123,), dtype=torch.uint8, generator=g)
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(byte_view(data)))
    n = data.numel() - 4096 - 7
    dst = torch.zeros(n, dtype=torch.uint8, device=device)
    L.read_file_into(path, 4096, n, dst)
    assert torch.equal(dst.cpu(), data[4096:4096 + n])
    with pytest.raises(CheckpointError, match="truncated"):
        L.read_file_into(path, 4096 + 8, n, torch.zeros(n, dtype=torch.uint8, device=device))
    with pytest.raises(LayoutError, match="cannot read"):
        L.read_file_into(path, 0, n, torch.zeros(n + 1, dtype=torch.uint8, device=device))


def test_gpu_chunk_knob(monkeypatch):
    import megamoe_runtime.files.file_io as L

    monkeypatch.delenv("MEGAMOE_LOAD_GPU_CHUNK_MB", raising=False)
    assert L._gpu_chunk() == L._READ_CHUNK
    monkeypatch.setenv("MEGAMOE_LOAD_GPU_CHUNK_MB", "1.5")
    assert L._gpu_chunk() == 3 << 19
    monkeypatch.setenv("MEGAMOE_LOAD_GPU_CHUNK_MB", "0")
    assert L._gpu_chunk() == 4096  # never below a page
