"""All-or-nothing loads (megamoe_runtime.load.load_checks): every check before the first byte, shared by the real
reload and the dry run; a layer marked unusable when a read still fails midway; semantics refused or adopted;
a replaced folder noticed; checksums on request; symlinks out of the folder refused."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

import megamoe_runtime as mr
from megamoe_runtime.errors import CheckpointError, LayerUnusableError, LoadCheckError, ManifestError
from megamoe_runtime.files import file_io
from megamoe_runtime.files.safetensors_header import parse_safetensors_header
from megamoe_runtime.format.manifest import MANIFEST_NAME, with_self_digest


def _inputs(spec, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, spec.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[:spec.top_k] for _ in range(T)])
    w = torch.rand(T, spec.top_k, generator=g)
    return x, w, ids


def _rank_files(out):
    return sorted(p for p in out.iterdir() if p.name.startswith("megamoe-experts-rank"))


def _edit_manifest(out, fn):
    d = json.loads((out / MANIFEST_NAME).read_text())
    fn(d)
    (out / MANIFEST_NAME).write_text(json.dumps(with_self_digest(d)))


# --------------------------------------------------------------------------- torn layer


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_reload_from_a_damaged_later_shard_leaves_the_layer_exactly_as_it_was(ckpts, tmp_path, layer_bytes, damage):
    """The issue's torn layer: the EP-2 folder loaded as one EP-1 layer reads two files; the second is damaged.
    The reload is refused before its first byte: every byte and pointer unchanged, the forward still runs."""
    _, out_a = ckpts.converted("modelopt-nvfp4", ep_size=2, seed=0)
    _, out_b = ckpts.fresh_converted("modelopt-nvfp4", tmp_path / "b", ep_size=2, seed=5)
    layer = mr.open_checkpoint(out_a).build_layer(0, backend="reference")
    before, snap = layer_bytes(layer), layer.storage_snapshot()
    x, w, ids = _inputs(layer.spec)
    y_before = layer(x, w, ids)
    last = _rank_files(out_b)[-1]
    if damage == "truncate":
        os.truncate(last, last.stat().st_size - 100)
    else:
        last.unlink()
    with pytest.raises(LoadCheckError, match="load refused before writing any byte") as e:
        mr.open_checkpoint(out_b).load_layer(layer)
    assert last.name in str(e.value) and ("truncated" in str(e.value) or "missing" in str(e.value))
    after = layer_bytes(layer)
    assert all(torch.equal(before[k], after[k]) for k in before) and layer.storage_snapshot() == snap
    assert layer.unusable_reason is None and torch.equal(layer(x, w, ids), y_before)
    # the dry run says the same, from the same checks
    rep = mr.verify_reload(layer, out_b)
    assert not rep.ok and any(last.name in p for p in rep.errors)


def test_a_read_failing_midway_marks_the_layer_unusable_until_a_load_succeeds(ckpts, tmp_path, monkeypatch):
    """Negative control of the above: with verify="none" the damaged second file is only found after the first
    file's bytes are in, and a read error injected after the checks (a file changed under the load) does the
    same with the default level. Either way the layer refuses to run, naming the failed load; a good load
    makes it usable again and equal to a fresh build."""
    _, out_a = ckpts.converted("modelopt-nvfp4", ep_size=2, seed=0)
    _, out_b = ckpts.fresh_converted("modelopt-nvfp4", tmp_path / "b", ep_size=2, seed=5)
    layer = mr.open_checkpoint(out_a).build_layer(0, backend="reference")
    x, w, ids = _inputs(layer.spec)
    last = _rank_files(out_b)[-1]
    good = last.read_bytes()
    os.truncate(last, last.stat().st_size - 100)
    with pytest.raises(LayerUnusableError, match="after .* bytes were written"):
        mr.open_checkpoint(out_b, verify="none").load_layer(layer)
    with pytest.raises(LayerUnusableError, match=f"unusable: the load of layer 0 from {out_b}"):
        layer(x, w, ids)
    last.write_bytes(good)

    calls = {"n": 0}
    real = file_io.read_file_into

    def flaky(path, offset, nbytes, dst):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(5, "Input/output error")
        return real(path, offset, nbytes, dst)

    layer2 = mr.open_checkpoint(out_a).build_layer(0, backend="reference")
    monkeypatch.setattr(file_io, "read_file_into", flaky)
    with pytest.raises(LayerUnusableError, match="Input/output error"):
        mr.open_checkpoint(out_b).load_layer(layer2)
    with pytest.raises(LayerUnusableError, match="model.layers.0.mlp.* failed at"):
        layer2(x, w, ids)
    monkeypatch.setattr(file_io, "read_file_into", real)
    for lay in (layer, layer2):
        mr.open_checkpoint(out_b).load_layer(lay)
        assert lay.unusable_reason is None
        fresh = mr.open_checkpoint(out_b).build_layer(0, backend="reference")
        assert torch.equal(lay(x, w, ids), fresh(x, w, ids))


def test_nvfp4_scales_are_checked_before_writing(ckpts, tmp_path, layer_bytes):
    """A non-finite per-expert global scale would make finish_load refuse after every byte was written: it is
    read (a few bytes) and refused first."""
    import struct

    _, out_a = ckpts.converted("modelopt-nvfp4", seed=0)
    _, out_b = ckpts.fresh_converted("modelopt-nvfp4", tmp_path / "b", seed=5)
    layer = mr.open_checkpoint(out_a).build_layer(1, backend="reference")
    before = layer_bytes(layer)
    m = mr.open_checkpoint(out_b).manifest
    te = m.entry("model.layers.1.mlp.megamoe.l2_global_scale")
    h = parse_safetensors_header(out_b / te.file)
    en = h.tensors[te.name]
    with open(out_b / te.file, "r+b") as f:
        f.seek(h.data_start + en.begin + 4 * 3)
        f.write(struct.pack("<f", float("nan")))
    with pytest.raises(LoadCheckError, match=r"l2_global_scale is not finite and > 0 for experts \[3\]"):
        mr.open_checkpoint(out_b).load_layer(layer)
    after = layer_bytes(layer)
    assert all(torch.equal(before[k], after[k]) for k in before)


# --------------------------------------------------------------------------- semantics


def test_semantics_refused_listing_fields_or_adopted_to_equal_a_fresh_build(ckpts, layer_bytes):
    _, out_a = ckpts.converted("quark-mxfp4", seed=0)
    _, out_b = ckpts.converted("quark-mxfp4", seed=7, routed_scaling_factor=2.5,
                               extra_config={"swiglu_limit": 3.0})
    ck_b = mr.open_checkpoint(out_b)
    layer = mr.open_checkpoint(out_a).build_layer(0, backend="reference")
    before = layer_bytes(layer)
    x, w, ids = _inputs(layer.spec)
    fresh = ck_b.build_layer(0, backend="reference")
    assert fresh.spec.routed_scaling_factor == 2.5 and fresh.spec.activation.clamp == 3.0
    with pytest.raises(LoadCheckError, match="other semantics") as e:
        ck_b.load_layer(layer)
    assert set(e.value.differences) == {"routed_scaling_factor", "activation.clamp"}
    assert "routed_scaling_factor: layer 1.0 vs checkpoint 2.5" in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in layer_bytes(layer).items())
    # the dry run refuses the same, and accepts what the real reload accepts
    assert not mr.verify_reload(layer, out_b).ok
    assert mr.verify_reload(layer, out_b, adopt_semantics=True).ok
    ck_b.load_layer(layer, adopt_semantics=True)
    assert layer.spec == fresh.spec
    assert torch.equal(layer(x, w, ids), fresh(x, w, ids))
    # negative control: the same bytes under the old semantics compute something else
    kept = mr.DeepGemmMegaMoEExperts(mr.open_checkpoint(out_a).layer_spec(0), backend="reference", layer_index=0,
                                     prefix=layer.prefix)
    kept_bytes = layer_bytes(layer)
    kept.begin_load()
    with torch.no_grad():
        for n, p in kept.named_parameters():
            p.copy_(kept_bytes[n].view(p.dtype).view(p.shape) if p.dim() else p)
    kept.finish_load()
    assert not torch.equal(kept(x, w, ids), fresh(x, w, ids))


def test_top_k_mismatch_refused_by_dry_run_and_reload_alike(ckpts):
    _, out_a = ckpts.converted("bf16")
    _, out_b = ckpts.converted("bf16", top_k=3)
    layer = mr.open_checkpoint(out_a).build_layer(0, backend="reference")
    rep = mr.verify_reload(layer, out_b)
    assert not rep.ok and any("top_k: layer 2 vs checkpoint 3" in p for p in rep.errors)
    with pytest.raises(LoadCheckError, match="top_k: layer 2 vs checkpoint 3"):
        mr.open_checkpoint(out_b).load_layer(layer)
    mr.open_checkpoint(out_b).load_layer(layer, adopt_semantics=True)
    assert layer.spec.top_k == 3


def test_storage_fields_are_never_adopted(ckpts):
    _, out = ckpts.converted("bf16")
    spec = mr.LayerSpec("bf16", hidden=128, intermediate=128, num_experts=8, top_k=2)
    with pytest.raises(CheckpointError, match="hidden=256 but the layer was built with hidden=128"):
        mr.open_checkpoint(out).load_layer(mr.DeepGemmMegaMoEExperts(spec, backend="reference", layer_index=0),
                                           adopt_semantics=True)


# --------------------------------------------------------------------------- replaced folder


def test_a_replaced_folder_is_noticed(ckpts, tmp_path, layer_bytes):
    """The issue's stale handle: a Checkpoint opened before the folder was re-converted must not load the new
    weights with the old manifest's l2_activation_scale."""
    from megamoe_convert.pipeline.convert import convert

    _, out = ckpts.fresh_converted("modelopt-nvfp4", tmp_path / "out", seed=0)
    ck = mr.open_checkpoint(out)
    layer = ck.build_layer(0, backend="reference")
    before = layer_bytes(layer)
    os.utime(out / MANIFEST_NAME)  # touched, same content: still the same checkpoint
    ck.load_layer(layer)
    convert(ckpts.source("modelopt-nvfp4", seed=9), out, overwrite=True)
    with pytest.raises(LoadCheckError, match="the folder was replaced since this checkpoint was opened"):
        ck.load_layer(layer)
    assert all(torch.equal(before[k], v) for k, v in layer_bytes(layer).items())
    mr.open_checkpoint(out).load_layer(layer)  # a fresh handle loads the new model
    assert not all(torch.equal(before[k], v) for k, v in layer_bytes(layer).items())


# --------------------------------------------------------------------------- checksums


def test_checksums_on_load_catch_a_flipped_byte(ckpts, tmp_path, layer_bytes):
    _, out_a = ckpts.converted("modelopt-mxfp8", seed=0)
    _, out_b = ckpts.fresh_converted("modelopt-mxfp8", tmp_path / "b", seed=4)
    layer = mr.open_checkpoint(out_a).build_layer(0, backend="reference")
    before = layer_bytes(layer)
    m = mr.open_checkpoint(out_b).manifest
    te = m.entry("model.layers.0.mlp.megamoe.l2_weight")
    h = parse_safetensors_header(out_b / te.file)
    pos = h.data_start + h.tensors[te.name].begin + 1234
    with open(out_b / te.file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(LoadCheckError, match=f"{te.name}: blake3 .* does not match"):
        mr.open_checkpoint(out_b, verify="checksums").load_layer(layer)
    assert all(torch.equal(before[k], v) for k, v in layer_bytes(layer).items())
    with pytest.raises(LoadCheckError, match="blake3 .* does not match"):
        mr.open_checkpoint(out_b).load_layer(layer, verify="checksums")  # per call, too
    # negative control: the header level cannot see data bytes, and loads it
    mr.open_checkpoint(out_b, verify="headers").load_layer(layer)
    with pytest.raises(mr.MegaMoEError, match="verify='sha1'; valid: none, headers, checksums"):
        mr.open_checkpoint(out_b, verify="sha1")


# --------------------------------------------------------------------------- symlinks


def test_symlinks_out_of_the_folder_are_refused(ckpts, tmp_path):
    from click.testing import CliRunner

    from megamoe_convert.cli.main import main

    _, src = ckpts.converted("bf16")
    out = tmp_path / "out"
    shutil.copytree(src, out)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = _rank_files(out)[0]
    shutil.move(shard, outside / shard.name)
    os.symlink(outside / shard.name, shard)
    with pytest.raises(CheckpointError, match="outside the folder"):
        mr.open_checkpoint(out).build_layer(0, backend="reference")
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "outside the folder" in r.output
    # a symlink that stays inside is fine
    os.unlink(shard)
    shutil.move(outside / shard.name, out / "real.bin")
    os.symlink(out / "real.bin", shard)
    mr.open_checkpoint(out).build_layer(0, backend="reference")
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
    # the manifest itself
    shutil.move(out / MANIFEST_NAME, outside / MANIFEST_NAME)
    os.symlink(outside / MANIFEST_NAME, out / MANIFEST_NAME)
    with pytest.raises(ManifestError, match="outside the folder"):
        mr.open_checkpoint(out)
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "outside the folder" in r.output


# --------------------------------------------------------------------------- self-digest, spec vs tensors


def test_a_manifest_without_its_digest_is_refused(ckpts, tmp_path):
    """The issue's case: digest removed, l2_activation_scale edited: verify passed and it was served."""
    from click.testing import CliRunner

    from megamoe_convert.cli.main import main

    _, src = ckpts.converted("modelopt-nvfp4")
    out = tmp_path / "out"
    shutil.copytree(src, out)
    d = json.loads((out / MANIFEST_NAME).read_text())
    del d["manifest_sha256"]
    d["layers"][0]["scalars"]["l2_activation_scale"] *= 2
    (out / MANIFEST_NAME).write_text(json.dumps(d))
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "no manifest_sha256" in r.output
    with pytest.raises(ManifestError, match="no manifest_sha256"):
        mr.open_checkpoint(out)


@pytest.mark.parametrize("field,value", [("num_experts", 16), ("hidden", 512), ("intermediate", 256)])
def test_verify_checks_each_layer_spec_against_its_tensors(ckpts, tmp_path, field, value):
    from click.testing import CliRunner

    from megamoe_convert.cli.main import main

    _, src = ckpts.converted("quark-mxfp4")
    out = tmp_path / "out"
    shutil.copytree(src, out)
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0  # control: the untouched folder passes

    def edit(d):
        d["layers"][1]["spec"][field] = value

    _edit_manifest(out, edit)
    r = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert r.exit_code == 1, r.output
    probs = json.loads(r.stdout)["problems"]
    assert any("layer 1" in p and "but its spec" in p and f"{field}={value}" in p for p in probs), probs
    assert not any("layer 0" in p for p in probs)


@pytest.mark.parametrize("experts, keep", [((0, 9), 9), ((0, 8), 9), ((1, 9), 8)])
def test_a_widened_or_shifted_expert_range_is_refused_by_verify_and_every_load(ckpts, tmp_path, experts, keep):
    """A layer whose manifest gives a routed tensor another expert range than the rank's (``[0, 9)`` on 8
    experts, the tensor holding 9), or a tensor holding more experts than its range says: verify, a build,
    a reload and the reload dry run refuse it by one rule (`manifest.expert_range_problem`); the loaders
    used to read the first 8 and serve them while verify failed."""
    import hashlib

    from safetensors.torch import save_file

    from megamoe_runtime.errors import MegaMoEError
    from megamoe_runtime.files.file_io import SafetensorsFile
    from megamoe_runtime.load.verify import verify_output

    _, out = ckpts.fresh_converted("bf16", tmp_path / "out")
    layer = mr.open_checkpoint(out).build_layer(0, backend="reference")
    name = "model.layers.0.mlp.megamoe.l2_weight"
    d = json.loads((out / MANIFEST_NAME).read_text())
    te = d["tensors"][name]
    with SafetensorsFile(out / te["file"]) as f:
        data = {k: f.tensor(k).clone() for k in f.keys()}
    t = data[name]
    data[name] = torch.cat([t, t[:1]])[:keep].contiguous()
    save_file(data, str(out / te["file"]), metadata=parse_safetensors_header(out / te["file"]).metadata)

    def edit(d):
        e = d["tensors"][name]
        e.update(experts=list(experts), stored_shape=list(data[name].shape), kernel_shape=list(data[name].shape))
        body = (out / e["file"]).read_bytes()
        d["files"][e["file"]] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}

    _edit_manifest(out, edit)
    rule = {(0, 9): "which is not inside the rank's experts", (0, 8): "holds 9 experts but its range [0, 8) says 8",
            (1, 9): "which is not inside the rank's experts"}[experts]
    rep = verify_output(out)
    assert any(rule in p for p in rep.problems), rep.problems
    with pytest.raises(MegaMoEError, match=re.escape(rule)):
        mr.open_checkpoint(out).build_layer(0, backend="reference")
    with pytest.raises(MegaMoEError, match=re.escape(rule)):
        mr.open_checkpoint(out).load_layer(layer)
    rep = mr.verify_reload(layer, out)
    assert not rep.ok and rule in rep.summary()


@pytest.mark.parametrize("ep_size", [1, 2])
def test_checksums_hash_the_bytes_the_load_copies(ckpts, tmp_path, monkeypatch, ep_size):
    """verify="checksums" with a file rewritten between the up-front check and the copy (a writer racing
    the reload, made deterministic: the hook flips a byte of l1_weight right after the up-front hash): the
    load raises instead of returning with other weights (it hashed one read and copied another), and the
    layer refuses to run until a load succeeds. ep_size 2: rank 0 of 2 takes a slice of each stored tensor,
    and the whole tensor is still hashed from the bytes read. Control: untouched, the load matches a clean
    build byte for byte."""
    from megamoe_runtime.load import load_checks

    _, out = ckpts.fresh_converted("bf16", tmp_path / "out")
    ck = mr.open_checkpoint(out, verify="checksums")
    layer = ck.build_layer(0, backend="reference", ep_rank=0, ep_size=ep_size)
    clean = {k: v.clone() for k, v in layer.state_dict().items()}
    assert ck.load_layer(layer) > 0  # control: no race, same bytes
    assert all(torch.equal(clean[k], v) for k, v in layer.state_dict().items())

    te = ck.manifest.tensors["model.layers.0.mlp.megamoe.l1_weight"]
    h = parse_safetensors_header(out / te.file)
    at = h.data_start + h.tensors[te.name].begin + 7  # in expert 0, which rank 0 of 2 loads too
    real = load_checks.check_checksums

    def racing(items, headers):
        found = real(items, headers)
        with open(out / te.file, "r+b") as f:  # the writer strikes after the check
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x40]))
        return found

    monkeypatch.setattr(load_checks, "check_checksums", racing)
    with pytest.raises(LayerUnusableError, match="the bytes loaded have .* the manifest says"):
        ck.load_layer(layer)
    x, w, ids = _inputs(layer.spec)
    with pytest.raises(LayerUnusableError):
        layer(x, w, ids)
