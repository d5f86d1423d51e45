"""open_checkpoint / build_layer / load_layer: the public API, EP file isolation,
in-place reload, and safetensors header validation."""
from __future__ import annotations

import json
import struct

import pytest
import torch

import megamoe_runtime as mr
from megamoe_runtime.errors import CheckpointError, ManifestError
from megamoe_runtime.files.file_io import SAFETENSORS_DTYPES, SafetensorsFile, read_safetensors_header
from megamoe_runtime.format.manifest import with_self_digest


def test_public_api_open_build_forward(ckpts):
    _, out = ckpts.converted("modelopt-mxfp4")
    ckpt = mr.open_checkpoint(out)
    assert [li.index for li in ckpt.layers] == [0, 1]
    li = ckpt.layers[1]
    assert li.prefix == "model.layers.1.mlp" and li.spec.row == "mxfp4" and li.spec.num_experts == 8
    layer = ckpt.build_layer(1, device="cpu", backend="reference", ep_rank=0, ep_size=1)
    assert isinstance(layer, mr.DeepGemmMegaMoEExperts) and layer.layer_index == 1
    torch.manual_seed(0)
    x = torch.randn(6, 256).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, -1], [7, 3], [-1, -1], [5, 4], [6, 0]])
    w = torch.rand(6, 2)
    y = layer(x, w, ids)
    assert y.shape == (6, 256) and y.dtype == torch.bfloat16
    assert torch.count_nonzero(y[3]) == 0  # fully masked token
    assert "Checkpoint(" in repr(ckpt) and "row=mxfp4" in repr(ckpt)


def test_ep_rank_opens_only_its_own_files_and_reshards(ckpts, layer_bytes):
    _, out2 = ckpts.converted("modelopt-mxfp8", ep_size=2)
    _, out1 = ckpts.converted("modelopt-mxfp8", ep_size=1)
    ck2, ck1 = mr.open_checkpoint(out2), mr.open_checkpoint(out1)
    for rank in range(2):
        own = ck2.build_layer(0, backend="reference", ep_rank=rank, ep_size=2)
        assert ck2.last_opened_files == [f"megamoe-experts-rank{rank:03d}-of-002-00001.safetensors"]
        assert ck2.files_for(0, rank, 2) == ck2.last_opened_files
        resliced = ck1.build_layer(0, backend="reference", ep_rank=rank, ep_size=2)  # slices of the ep1 files
        a, b = layer_bytes(own), layer_bytes(resliced)
        assert all(torch.equal(a[k], b[k]) for k in a)
    # ep2 files merged into one ep1 layer
    merged = ck2.build_layer(0, backend="reference", ep_rank=0, ep_size=1)
    assert len(ck2.last_opened_files) == 2
    a, b = layer_bytes(ck1.build_layer(0, backend="reference")), layer_bytes(merged)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_allocate_layer_is_build_layer_before_its_load(ckpts, layer_bytes):
    """The reload dry run builds its meta layers with `allocate_layer`: the layer `build_layer` loads."""
    _, out = ckpts.converted("modelopt-mxfp8", ep_size=2)
    ckpt = mr.open_checkpoint(out)
    empty = ckpt.allocate_layer(0, device="cpu", backend="reference", ep_rank=1, ep_size=2)
    built = ckpt.build_layer(0, device="cpu", backend="reference", ep_rank=1, ep_size=2)
    assert empty.spec == built.spec and (empty.prefix, empty.layer_index) == (built.prefix, built.layer_index)
    assert empty.load_generation == 0 and built.load_generation == 1
    ckpt.load_layer(empty)
    a, b = layer_bytes(empty), layer_bytes(built)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "bf16"])
def test_reload_writes_into_the_same_storage(ckpts, layer_bytes, fmt):
    _, out_a = ckpts.converted(fmt, seed=0)
    _, out_b = ckpts.converted(fmt, seed=3)
    ck_a, ck_b = mr.open_checkpoint(out_a), mr.open_checkpoint(out_b)
    layer = ck_a.build_layer(0, backend="reference")
    snap = layer.storage_snapshot()
    gen = layer.load_generation
    ck_b.load_layer(layer)
    after = layer.storage_snapshot()
    assert after == snap  # data_ptr, storage offset, shape, strides, dtype, device of every param and buffer
    assert layer.load_generation == gen + 1
    fresh = ck_b.build_layer(0, backend="reference")
    a, b = layer_bytes(fresh), layer_bytes(layer)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if fmt == "modelopt-nvfp4":  # derived device scalars refreshed in place
        assert float(layer.l2_activation_scale) == pytest.approx(ck_b.layers[0].scalars["l2_activation_scale"])
        assert torch.equal(layer.l2_alpha, layer.l2_global_scale * layer.l2_activation_scale)
        assert torch.equal(layer.a2_scales, layer.l2_activation_scale.expand(8))


def test_manifest_and_file_mismatches_are_named(ckpts, tmp_path):
    _, out = ckpts.fresh_converted("bf16", tmp_path / "out")
    with pytest.raises(ManifestError, match="no megamoe.json"):
        mr.open_checkpoint(tmp_path)
    with pytest.raises(ManifestError, match=r"nothing-here does not exist: a megamoe output is the folder"):
        mr.open_checkpoint(tmp_path / "nothing-here")  # the README's "./out" before any conversion made it
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ManifestError, match=r"a-file is not a folder"):
        mr.open_checkpoint(tmp_path / "a-file")
    m = json.loads((out / "megamoe.json").read_text())
    name = "model.layers.0.mlp.megamoe.l1_weight"
    m["tensors"][name]["file"] = "model-00001-of-00001.safetensors"  # listed file lacks the tensor
    del m["manifest_sha256"]  # a hand-edited manifest without its self-digest is refused outright
    (out / "megamoe.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="no manifest_sha256"):
        mr.open_checkpoint(out)
    (out / "megamoe.json").write_text(json.dumps(with_self_digest(m)))  # digested: the other checks apply
    ck = mr.open_checkpoint(out)
    with pytest.raises(CheckpointError, match=f"no tensor {name!r}"):
        ck.build_layer(0, backend="reference")
    with pytest.raises(CheckpointError, match="layer_index=5"):
        ck.load_layer(mr.DeepGemmMegaMoEExperts(ck.layer_spec(0), backend="reference", layer_index=5))


def test_layer_shape_mismatch_is_refused(ckpts):
    _, out = ckpts.converted("bf16")
    ck = mr.open_checkpoint(out)
    spec = mr.LayerSpec("bf16", hidden=128, intermediate=128, num_experts=8, top_k=2)
    with pytest.raises(CheckpointError, match="hidden=256"):
        ck.load_layer(mr.DeepGemmMegaMoEExperts(spec, backend="reference", layer_index=0))


def _write_st(path, header: dict, data: bytes = b"", *, raw_header: bytes | None = None):
    hb = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def test_safetensors_header_validation(tmp_path):
    p = tmp_path / "a.safetensors"
    _write_st(p, {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    entries, meta, start = read_safetensors_header(p)
    assert entries["t"].shape == (2,) and start == p.stat().st_size - 8 and meta == {}
    cases = {
        "truncated": (dict(header={"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, data=b"\0" * 4),
                      "truncated"),
        "garbage": (dict(header={}, raw_header=b"\xff\xfe not json"), "garbage safetensors header"),
        "dup": (dict(header={}, raw_header=b'{"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
                                           b'"t": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}',
                     data=b"\0\0"), "duplicate tensor name 't'"),
        "gap": (dict(header={"t": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, data=b"\0\0"), "gap"),
        "bytes": (dict(header={"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, data=b"\0" * 8),
                  "expected 12"),
    }
    for label, (kw, msg) in cases.items():
        q = tmp_path / f"{label}.safetensors"
        _write_st(q, **kw)
        with pytest.raises(CheckpointError, match=msg):
            read_safetensors_header(q)
    q = tmp_path / "short.safetensors"
    q.write_bytes(b"\1\2")
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors_header(q)


@pytest.mark.parametrize("st,dt", [("BF16", torch.bfloat16), ("F16", torch.float16), ("F32", torch.float32),
                                   ("F8_E4M3", torch.float8_e4m3fn), ("F8_E5M2", torch.float8_e5m2),
                                   ("F8_E8M0", torch.float8_e8m0fnu), ("U8", torch.uint8), ("I8", torch.int8),
                                   ("I32", torch.int32), ("I64", torch.int64)])
def test_meta_stand_ins_and_zero_copy_views_for_every_dtype(tmp_path, st, dt):
    assert SAFETENSORS_DTYPES[st] == dt
    from safetensors.torch import save_file

    t = torch.arange(24, dtype=torch.int32).to(torch.uint8).view(dt if torch.empty((), dtype=dt).element_size() == 1
                                                                 else torch.uint8)
    if t.dtype != dt:
        t = torch.arange(24).to(dt) if dt != torch.float8_e8m0fnu else t
    t = t.reshape(2, -1).contiguous()
    p = tmp_path / "x.safetensors"
    save_file({"x": t}, str(p))
    with SafetensorsFile(p) as f:
        m = f.meta("x")
        assert m.is_meta and m.dtype == dt and m.shape == t.shape
        v = f.tensor("x")
        assert v.dtype == dt and torch.equal(v.view(torch.uint8), t.view(torch.uint8))
        del v, m
