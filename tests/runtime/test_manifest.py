"""Manifest schema: round trip, determinism, refusal of newer / malformed
manifests, and the stored <-> kernel view helper."""
import copy
import json

import pytest
import torch

from megamoe_runtime.errors import LayoutError, ManifestError
from megamoe_runtime.format import layout
from megamoe_runtime.format.formats import ActivationSpec, LayerSpec
from megamoe_runtime.format.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    STORAGE_CONTIGUOUS,
    STORAGE_MN_MAJOR,
    FileEntry,
    LayerEntry,
    Manifest,
    SourceInfo,
    TensorEntry,
    kernel_strides_of,
    kernel_view,
    manifest_bytes,
    read_manifest,
    storage_of_role,
    to_stored,
    write_manifest,
)

SHA = "ab" * 32


def _entry(name, role, shape, dtype="I32", ep_rank=0, layer=3, file="f.safetensors", experts=(0, 4)):
    storage = storage_of_role(role)
    stored = tuple(shape[:-2]) + (shape[-1], shape[-2]) if storage == STORAGE_MN_MAJOR else tuple(shape)
    return TensorEntry(name=name, layer=layer, role=role, ep_rank=ep_rank, experts=experts, file=file,
                       dtype=dtype, stored_shape=stored, kernel_shape=tuple(shape),
                       kernel_strides=kernel_strides_of(storage, shape), storage=storage, checksum=SHA)


def _manifest(ep_size=1):
    spec = LayerSpec("mxfp4", 256, 128, 4 * ep_size, 2, ActivationSpec(), ep_size=ep_size).to_dict()
    tensors = {}
    for r in range(ep_size):
        for t in (_entry("model.layers.3.mlp.megamoe.l1_scale", "l1_scale", (4, 256, 2), ep_rank=r),
                  _entry("model.layers.3.mlp.megamoe.l1_weight", "l1_weight", (4, 256, 128), "I8", ep_rank=r)):
            key = t.name if ep_size == 1 else f"{t.name}@rank{r:03d}"
            tensors[key] = t
    tensors["model.embed_tokens.weight"] = TensorEntry(
        "model.embed_tokens.weight", None, "passthrough", None, None, "f.safetensors", "BF16", (10, 256),
        (10, 256), (256, 1), STORAGE_CONTIGUOUS, SHA)
    return Manifest(
        converter_version="0.1.0",
        source=SourceInfo("org/model", "hub", "abc123", "quark-mxfp4", "cd" * 32),
        row="mxfp4", ep_size=ep_size,
        layers=[LayerEntry(3, "model.layers.3.mlp", spec, {}, {"present": False})],
        tensors=tensors, files={"f.safetensors": FileEntry(100, SHA)},
        model={"top_k": 2},
    )


def test_round_trip_and_deterministic(tmp_path):
    m = _manifest()
    write_manifest(tmp_path, m)
    first = (tmp_path / MANIFEST_NAME).read_bytes()
    back = read_manifest(tmp_path)
    assert back.to_dict() == m.to_dict()
    assert back.format_version == FORMAT_VERSION
    write_manifest(tmp_path, back)
    assert (tmp_path / MANIFEST_NAME).read_bytes() == first == manifest_bytes(m)
    assert b"time" not in first
    le = back.layer(3)
    assert le.layer_spec(0).row == "mxfp4"
    assert set(back.tensors_of(3, 0)) == {"l1_scale", "l1_weight"}


def test_ep_keys_and_lookup(tmp_path):
    m = _manifest(ep_size=2)
    write_manifest(tmp_path, m)
    back = read_manifest(tmp_path)
    assert back.entry("model.layers.3.mlp.megamoe.l1_scale", 1).ep_rank == 1
    assert "model.layers.3.mlp.megamoe.l1_scale@rank001" in back.tensors
    assert back.entry("model.embed_tokens.weight").role == "passthrough"
    with pytest.raises(ManifestError, match="no tensor"):
        back.entry("nope", 0)


def _write_raw(tmp_path, d):
    from megamoe_runtime.format.manifest import with_self_digest

    # hand-edited, then digested (a manifest without its digest is refused before any other check)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(with_self_digest(d)))


def test_newer_version_refused(tmp_path):
    d = _manifest().to_dict()
    d["format_version"] = FORMAT_VERSION + 1
    _write_raw(tmp_path, d)
    with pytest.raises(ManifestError, match="newer megamoe.*Upgrade"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("tensors"), "missing key 'tensors'"),
    (lambda d: d.update(format="other"), "'format' is 'other'"),
    (lambda d: d.update(format_version="1"), "format_version: expected int"),
    (lambda d: d.update(ep_size=0), "ep_size"),
    (lambda d: d["files"]["f.safetensors"].update(sha256="xyz"), "sha256"),
    (lambda d: d["files"]["f.safetensors"].update(digest="md5"), "digest: unknown digest kind 'md5'.*upgrade"),
    (lambda d: d["tensors"]["model.layers.3.mlp.megamoe.l1_scale"].update(storage="weird"), "storage"),
    (lambda d: d["tensors"]["model.layers.3.mlp.megamoe.l1_scale"].update(file="g.safetensors"), "not listed"),
    (lambda d: d["tensors"]["model.layers.3.mlp.megamoe.l1_scale"].update(stored_shape=[4, 256, 2]),
     "stored_shape"),
    (lambda d: d["tensors"]["model.layers.3.mlp.megamoe.l1_scale"].update(kernel_strides=[512, 2, 1]),
     "kernel_strides"),
    (lambda d: d["tensors"]["model.layers.3.mlp.megamoe.l1_scale"].update(dtype="Q7"), "dtype"),
    (lambda d: d["tensors"]["model.layers.3.mlp.megamoe.l1_scale"].update(layer=9), "layer"),
    (lambda d: d["layers"][0]["spec"].update(hidden=200), "layers\\[0\\].spec.*hidden=200"),
    (lambda d: d["layers"][0]["scalars"].update(l2_activation_scale=None), "finite number"),
])
def test_malformed_refused(tmp_path, mutate, match):
    d = copy.deepcopy(_manifest().to_dict())
    mutate(d)
    _write_raw(tmp_path, d)
    with pytest.raises(ManifestError, match=match):
        read_manifest(tmp_path)


def test_file_digest_kinds(tmp_path):
    """files[name].digest names how sha256 was computed; absent means a
    whole-file sha256; the header-and-tensors kind is for safetensors only."""
    from megamoe_runtime.format.manifest import DIGEST_HEADER_AND_TENSORS, DIGEST_SHA256, header_and_tensor_digest
    import hashlib

    d = _manifest().to_dict()
    assert d["files"]["f.safetensors"]["digest"] == DIGEST_SHA256
    del d["files"]["f.safetensors"]["digest"]
    _write_raw(tmp_path, d)
    assert read_manifest(tmp_path).files["f.safetensors"].digest == DIGEST_SHA256
    d["files"]["f.safetensors"]["digest"] = DIGEST_HEADER_AND_TENSORS
    _write_raw(tmp_path, d)
    assert read_manifest(tmp_path).files["f.safetensors"].digest == DIGEST_HEADER_AND_TENSORS
    d["files"]["config.json"] = {"size": 3, "sha256": SHA, "digest": DIGEST_HEADER_AND_TENSORS}
    _write_raw(tmp_path, d)
    with pytest.raises(ManifestError, match="safetensors files only"):
        read_manifest(tmp_path)
    # the definition: header bytes, then raw tensor digests by data offset (ties by name)
    a, b, e = (hashlib.sha256(x).digest() for x in (b"a", b"b", b""))
    want = hashlib.sha256(b"HDR" + e + a + b).hexdigest()
    assert header_and_tensor_digest(b"HDR", [(1, 3, "b", b), (0, 0, "e", e), (0, 1, "a", a)]) == want


def test_missing_and_not_json(tmp_path):
    with pytest.raises(ManifestError, match="not a finished megamoe output"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(tmp_path)


def test_write_refuses_invalid(tmp_path):
    m = _manifest()
    m.ep_size = 0
    with pytest.raises(ManifestError):
        write_manifest(tmp_path, m)
    assert not (tmp_path / MANIFEST_NAME).exists()


@pytest.mark.parametrize("hidden", [128, 256])  # 128: P = 1, a size-1 dim
def test_kernel_view_of_stored_scale(hidden):
    kt = layout.allocate_kernel_tensors("mxfp4", 3, hidden, 128)
    kt.l1_scale.copy_(torch.randint(-2**31, 2**31 - 1, kt.l1_scale.shape, dtype=torch.int32))
    stored, storage = to_stored(kt.l1_scale, storage_of_role("l1_scale"))
    assert storage == STORAGE_MN_MAJOR and stored.is_contiguous()
    assert stored.data_ptr() == kt.l1_scale.data_ptr()  # no copy
    entry = _entry("x", "l1_scale", tuple(kt.l1_scale.shape), layer=0, experts=(0, 3))
    file_tensor = stored.clone()  # what safetensors gives back
    view = kernel_view(file_tensor, entry)
    assert view.shape == kt.l1_scale.shape and view.stride() == kt.l1_scale.stride()
    assert torch.equal(view, kt.l1_scale)
    layout.check_kernel_strides(view, "x")
    # one copy_ of the file tensor into the physical base rebuilds the kernel bytes
    dst = layout.allocate_kernel_tensors("mxfp4", 3, hidden, 128).l1_scale
    layout.physical(dst).copy_(file_tensor)
    assert torch.equal(dst, kt.l1_scale)


def test_kernel_view_checks():
    entry = _entry("x", "l1_weight", (2, 16, 8), "I8", layer=0, experts=(0, 2))
    with pytest.raises(LayoutError, match="stored_shape"):
        kernel_view(torch.zeros(2, 16, 4, dtype=torch.int8), entry)
    with pytest.raises(LayoutError, match="dtype"):
        kernel_view(torch.zeros(2, 16, 8, dtype=torch.uint8), entry)
    assert kernel_view(torch.zeros(2, 16, 8, dtype=torch.int8), entry).is_contiguous()
    with pytest.raises(LayoutError, match="cannot be stored"):
        to_stored(torch.zeros(4, 4, 4)[:, ::2], STORAGE_CONTIGUOUS)


def test_self_digest_catches_an_edited_manifest(tmp_path):
    """The manifest carries a digest of itself: an edit that keeps it valid JSON
    and a valid schema (a scale, a checksum digit) is refused by name."""
    from megamoe_runtime.format.manifest import SELF_DIGEST_KEY, manifest_bytes, read_manifest, with_self_digest

    m = _manifest()
    (tmp_path / MANIFEST_NAME).write_bytes(manifest_bytes(m))
    read_manifest(tmp_path)
    d = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert len(d[SELF_DIGEST_KEY]) == 64
    d["ep_size"] = d["ep_size"]  # untouched: still fine after a JSON round trip
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(d, indent=3))
    read_manifest(tmp_path)
    name = next(iter(d["tensors"]))
    d["tensors"][name]["sha256"] = "0" * 64
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ManifestError, match="modified or corrupted"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(with_self_digest(d)))
    read_manifest(tmp_path)  # re-stamped: the self-digest alone does not refuse it


def test_records_json_generated_from_their_fields():
    """Each record's JSON is its fields in declaration order (the manifest's bytes depend on that order); the
    checksum is stored under its algorithm; a recipe-less source has no recipe key; parsing inverts it."""
    from dataclasses import dataclass, fields

    from megamoe_runtime.format.manifest import _check_codecs, LayerEntry, SourceInfo, TensorEntry

    t = TensorEntry(name="m.megamoe.l1_scale", layer=0, role="l1_scale", ep_rank=0, experts=(0, 4), file="f",
                    dtype="I32", stored_shape=(4, 2, 8), kernel_shape=(4, 8, 2), kernel_strides=(16, 1, 8),
                    storage="mn_major_physical", checksum="ab" * 32, checksum_kind="blake3")
    d = t.to_dict()
    assert list(d) == [f.name for f in fields(TensorEntry)][:-2] + ["blake3"]
    assert d["experts"] == [0, 4] and d["stored_shape"] == [4, 2, 8]
    assert TensorEntry.from_json(json.loads(json.dumps(d)), "t", checksum_kind="blake3") == t
    with pytest.raises(ManifestError, match=r"t: missing key 'sha256'"):
        TensorEntry.from_json(d, "t")  # sha256 expected
    with pytest.raises(ManifestError, match=r"t.experts: expected 2 ints"):
        TensorEntry.from_json({**d, "experts": [1]}, "t", checksum_kind="blake3")
    s = SourceInfo(id="x", kind="local", revision=None, format="f", content_hash=None)
    assert list(s.to_dict()) == ["id", "kind", "revision", "format", "content_hash"]
    assert SourceInfo.from_json(s.to_dict(), "s") == s
    with pytest.raises(ManifestError, match=r"s.recipe: expected dict, got NoneType"):
        SourceInfo.from_json({**s.to_dict(), "recipe": None}, "s")
    le = LayerEntry(index=1, prefix="p", spec={}, scalars={}, shared={}, repairs=({"expert": 0},))
    assert list(le.to_dict()) == ["index", "prefix", "spec", "scalars", "shared", "repairs"]
    assert LayerEntry.from_json({k: v for k, v in le.to_dict().items() if k != "repairs"}, "l").repairs == ()

    @dataclass(frozen=True)
    class WithSet:
        x: "set"  # annotations are strings in the runtime (from __future__ import annotations)

    with pytest.raises(TypeError, match="WithSet.x: no manifest JSON codec for type 'set'"):
        _check_codecs(WithSet)


def _fp8_block_manifest():
    """A one-layer fp8_block manifest: its fp32 block scales are stored contiguous, its layout recorded."""
    spec = LayerSpec("fp8_block", 256, 128, 4, 2, ActivationSpec()).to_dict()
    import dataclasses

    tensors = {}
    for t in (_entry("model.layers.3.mlp.megamoe.l1_scale", "l1_scale", (4, 2, 2), "F32"),
              _entry("model.layers.3.mlp.megamoe.l1_weight", "l1_weight", (4, 256, 256), "F8_E4M3")):
        st = storage_of_role(t.role, "fp8_block")  # without the row it would say MN-major for the scale
        tensors[t.name] = dataclasses.replace(t, storage=st, stored_shape=t.kernel_shape,
                                              kernel_strides=kernel_strides_of(st, t.kernel_shape))
    return Manifest(converter_version="0.1.0", source=SourceInfo("org/model", "hub", "abc123", "fp8-block", "cd" * 32),
                    row="fp8_block", ep_size=1, layers=[LayerEntry(3, "model.layers.3.mlp", spec, {}, {"present": False})],
                    tensors=tensors, files={"f.safetensors": FileEntry(100, SHA)}, model={"top_k": 2},
                    layout="sm90-block-fp8/1")


def test_fp8_block_layout_is_recorded_and_refused_when_it_differs(tmp_path):
    m = _fp8_block_manifest()
    assert storage_of_role("l1_scale", "fp8_block") == STORAGE_CONTIGUOUS == storage_of_role("l1_weight")
    assert storage_of_role("l1_scale") == STORAGE_MN_MAJOR == storage_of_role("l1_scale", "mxfp8")
    write_manifest(tmp_path, m)
    back = read_manifest(tmp_path)
    assert back.layout == "sm90-block-fp8/1" and back.to_dict()["layout"] == "sm90-block-fp8/1"
    for layout_value, want in (("sm90-block-fp8/2", "'sm90-block-fp8/2'.*only in layout 'sm90-block-fp8/1'"),
                               (None, "in layout None, but this megamoe reads that row only in layout "
                                      "'sm90-block-fp8/1'")):
        d = m.to_dict()
        if layout_value is None:
            d.pop("layout")
        else:
            d["layout"] = layout_value
        _write_raw(tmp_path, d)
        with pytest.raises(ManifestError, match=want):
            read_manifest(tmp_path)
    d = _manifest().to_dict()  # an SM100 row may not claim the SM90 layout, nor DeepGEMM's packed-FP4 one
    for other in ("sm90-block-fp8/1", "sm100-packed-fp4"):
        d["layout"] = other
        _write_raw(tmp_path, d)
        with pytest.raises(ManifestError, match=f"row 'mxfp4' in layout '{other}'.*only in layout "
                                                "'sm100-interleave8/1'"):
            read_manifest(tmp_path)


def test_every_row_names_its_layout_flavour_and_older_folders_read_as_written(tmp_path):
    """Every row's manifest names its DeepGEMM layout flavour (docs/LAYOUT.md#layout-flavours); a manifest of an
    SM100 row written before the key existed reads as the flavour it was written in, interleave8."""
    from megamoe_runtime.format.formats import LAYOUT_SM100, LAYOUT_SM90_BLOCK_FP8, ROWS

    assert {n: r.layout for n, r in ROWS.items()} == {"mxfp4": LAYOUT_SM100, "mxfp8": LAYOUT_SM100,
                                                       "nvfp4": LAYOUT_SM100, "bf16": LAYOUT_SM100,
                                                       "fp8_block": LAYOUT_SM90_BLOCK_FP8}
    old = _manifest()  # built without the key, as megamoe wrote an mxfp4 folder before it
    assert "layout" not in old.to_dict()
    write_manifest(tmp_path, old)
    back = read_manifest(tmp_path)
    assert back.layout is None and back.layout_flavour == LAYOUT_SM100 and "layout" not in back.to_dict()
    import dataclasses

    new = dataclasses.replace(old, layout=LAYOUT_SM100)
    write_manifest(tmp_path, new)
    back = read_manifest(tmp_path)
    assert back.layout == back.layout_flavour == LAYOUT_SM100 and back.to_dict()["layout"] == LAYOUT_SM100
