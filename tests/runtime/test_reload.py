"""verify_reload: meta-tensor dry runs of a reload, positive and negative."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import megamoe_runtime as mr
from megamoe_runtime.errors import ReloadError
from megamoe_runtime.files.file_io import SafetensorsFile
from megamoe_runtime.format.manifest import with_self_digest
from megamoe_runtime.layer.experts import DeepGemmMegaMoEExperts
from megamoe_runtime.load.reload import byte_runs


def _model(ck: mr.Checkpoint, **kw) -> nn.ModuleDict:
    return nn.ModuleDict({f"layer{li.index}": ck.build_layer(li.index, backend="reference", **kw) for li in ck.layers})


def _raw_model(ck: mr.Checkpoint) -> nn.ModuleDict:
    return nn.ModuleDict({f"layer{li.index}": DeepGemmMegaMoEExperts(ck.layer_spec(li.index), backend="reference",
                                                                      prefix=li.prefix, layer_index=li.index)
                          for li in ck.layers})


def test_byte_runs_of_strided_views():
    t = torch.zeros(4, 6, dtype=torch.int32)
    s, r = byte_runs(t[1:3])
    assert s.tolist() == [24] and r == 48
    s, r = byte_runs(t.t()[2])  # column 2: four 4-byte runs
    assert s.tolist() == [8, 32, 56, 80] and r == 4
    s, r = byte_runs(t[:, 2:4])
    assert s.tolist() == [8, 32, 56, 80] and r == 8


@pytest.mark.parametrize("fmt,kw", [("modelopt-nvfp4", {"shared_format": "bf16"}), ("modelopt-mxfp8", {})])
def test_good_checkpoints_have_full_coverage_and_nothing_changes(ckpts, layer_bytes, fmt, kw):
    src, out = ckpts.converted(fmt, shared=1, **kw)
    ck = mr.open_checkpoint(out)
    model = _model(ck)
    before = {k: layer_bytes(m) for k, m in model.items()}
    snaps = {k: m.storage_snapshot() for k, m in model.items()}
    rep = mr.verify_reload(model, out)
    assert rep.ok, rep.summary()
    assert rep.mode == "prelaid" and len(rep.layers) == 2
    assert all(p.written_bytes == p.nbytes and p.writes >= 1 for p in rep.params.values())
    assert any(lbl.endswith("shared_l1_weight") for lbl in rep.params)
    assert "OK" in rep.summary()
    rep_raw = mr.verify_reload(model, src)
    assert rep_raw.ok, rep_raw.summary()
    assert rep_raw.mode == "raw" and rep_raw.writes > rep.writes
    for k, m in model.items():  # the dry runs touched no live byte and no binding
        after = layer_bytes(m)
        assert all(torch.equal(before[k][n], after[n]) for n in after)
        assert m.storage_snapshot() == snaps[k]


def test_dry_run_of_one_ep_rank(ckpts):
    _, out = ckpts.converted("modelopt-nvfp4", ep_size=2)
    ck = mr.open_checkpoint(out)
    layer = ck.build_layer(1, backend="reference", ep_rank=1, ep_size=2)
    rep = mr.verify_reload(layer, out)
    assert rep.ok, rep.summary()
    assert set(rep.plan) and all("rank" not in src or True for src, _, _ in rep.plan)


def test_missing_expert_raw_is_reported(ckpts):
    src = ckpts.source("modelopt-mxfp4", missing_expert=(1, 5))
    _, out = ckpts.converted("modelopt-mxfp4")
    model = _raw_model(mr.open_checkpoint(out))
    rep = mr.verify_reload(model, src)
    assert not rep.ok
    missing = rep.missing
    assert set(missing) == {f"model.layers.1.mlp.{r}" for r in ("l1_weight", "l1_scale", "l2_weight", "l2_scale")}
    assert all(p.missing_experts == [5] for p in missing.values())
    assert "model.layers.1.mlp.l1_weight: 32768 of 262144 bytes never written (experts 5)" in rep.summary()
    with pytest.raises(ReloadError, match="never written"):
        rep.raise_if_failed()


def _rewrite_tensor(out, name, fn, *, new_name=None, new_file=None, experts=None):
    """Replace (or add, with new_name/new_file) a stored tensor and patch megamoe.json."""
    mpath = out / "megamoe.json"
    m = json.loads(mpath.read_text())
    te = dict(m["tensors"][name])
    with SafetensorsFile(out / te["file"]) as f:
        data = {k: f.tensor(k).clone() for k in f.keys()}
    t = fn(data[name])
    if new_name is None:
        data[name] = t
        target_file, tensors = te["file"], data
    else:
        target_file, tensors = new_file, {new_name: t}
    save_file(tensors, str(out / target_file))
    te.update(name=new_name or name, file=target_file, stored_shape=list(t.shape),
              kernel_shape=list(t.shape), kernel_strides=list(torch.empty(t.shape, device="meta").stride()))
    if experts is not None:
        te["experts"] = list(experts)
    m["tensors"][new_name or name] = te
    body = (out / target_file).read_bytes()
    m["files"][target_file] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    mpath.write_text(json.dumps(with_self_digest(m)))  # as a (buggy) writer would have written it


def test_missing_expert_prelaid_is_reported(ckpts, tmp_path):
    _, out = ckpts.fresh_converted("bf16", tmp_path / "out")
    _rewrite_tensor(out, "model.layers.0.mlp.megamoe.l2_weight", lambda t: t[:7].contiguous(), experts=(0, 7))
    ck = mr.open_checkpoint(out)
    layer = DeepGemmMegaMoEExperts(ck.layer_spec(0), backend="reference", prefix="model.layers.0.mlp", layer_index=0)
    rep = mr.verify_reload(layer, out)
    assert not rep.ok and list(rep.missing) == ["model.layers.0.mlp.l2_weight"]
    assert rep.missing["model.layers.0.mlp.l2_weight"].missing_experts == [7]


def test_duplicated_shard_raw_is_reported(ckpts, tmp_path):
    src = ckpts.source("modelopt-nvfp4")
    dup = tmp_path / "src"
    dup.mkdir()
    for p in src.iterdir():
        (dup / p.name).symlink_to(p)
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    with SafetensorsFile(next(src.glob("*.safetensors"))) as f:
        t = f.tensor(name).clone()
    save_file({name: t, "model.layers.0.mlp.experts.2.up_proj.bias": torch.zeros(128)},
              str(dup / "zz-extra.safetensors"))
    _, out = ckpts.converted("modelopt-nvfp4")
    model = _raw_model(mr.open_checkpoint(out))
    rep = mr.verify_reload(model, dup)
    assert not rep.ok
    cov = rep.duplicated["model.layers.0.mlp.l1_weight"]
    assert cov.duplicated_experts == [2] and set(cov.duplicated_by) == {name}
    assert any(name in d and "zz-extra.safetensors" in d for d in rep.duplicate_names)
    assert any("up_proj.bias" in u for u in rep.unknown_names)


def test_duplicated_shard_prelaid_is_reported(ckpts, tmp_path):
    _, out = ckpts.fresh_converted("modelopt-mxfp4", tmp_path / "out")
    model = _model(mr.open_checkpoint(out))
    _rewrite_tensor(out, "model.layers.1.mlp.megamoe.l1_weight", lambda t: t[2:4].contiguous(),
                    new_name="model.layers.1.mlp.megamoe.l1_weight.patch", new_file="patch.safetensors",
                    experts=(2, 4))
    rep = mr.verify_reload(model, out)
    cov = rep.duplicated["model.layers.1.mlp.l1_weight"]
    assert cov.duplicated_experts == [2, 3]
    assert set(cov.duplicated_by) == {"model.layers.1.mlp.megamoe.l1_weight",
                                      "model.layers.1.mlp.megamoe.l1_weight.patch"}
    assert "written more than once (experts 2, 3)" in rep.summary()
    with pytest.raises(mr.errors.CheckpointError, match=r"l1_weight for experts \[2, 4\) is stored more than once"):
        mr.open_checkpoint(out).load_layer(model["layer1"])


def test_unknown_name_in_a_rank_file_is_reported(ckpts, tmp_path):
    _, out = ckpts.fresh_converted("bf16", tmp_path / "out")
    m = json.loads((out / "megamoe.json").read_text())
    f = m["tensors"]["model.layers.0.mlp.megamoe.l1_weight"]["file"]
    with SafetensorsFile(out / f) as sf:
        data = {k: sf.tensor(k).clone() for k in sf.keys()}
    data["model.layers.0.mlp.megamoe.stray"] = torch.zeros(4)
    save_file(data, str(out / f))
    rep = mr.verify_reload(_model(mr.open_checkpoint(out)), out)
    assert rep.unknown_names == [f"model.layers.0.mlp.megamoe.stray ({f}): not listed in megamoe.json"]
    assert all(p.ok for p in rep.params.values())


@pytest.mark.parametrize("how", ["rebind", "data_swap", "set_", "item"])
def test_a_misbehaving_loader_is_reported_and_the_model_restored(ckpts, layer_bytes, how):
    _, out = ckpts.converted("modelopt-nvfp4")
    ck = mr.open_checkpoint(out)
    layer = ck.build_layer(0, backend="reference")
    original = layer.l1_weight
    before = layer_bytes(layer)
    good = layer.load_stored
    spare = torch.empty_like(layer.l1_weight)  # a live tensor made before the dry run

    def bad(role, tensor, **kw):
        if role == "l1_weight":
            if how == "rebind":
                layer.l1_weight = nn.Parameter(torch.empty_like(tensor), requires_grad=False)
            elif how == "data_swap":
                layer.l1_weight.data = spare
            elif how == "set_":
                layer.l1_weight.set_(tensor)
            elif how == "item":
                float(layer.l1_alpha[0, 0])  # host-side state on a dry run
            return
        good(role, tensor, **kw)

    layer.load_stored = bad
    rep = mr.verify_reload(layer, out)
    assert not rep.ok
    if how == "item":
        assert rep.live_reads and "_local_scalar_dense" in rep.live_reads[0]
    else:
        assert any("l1_weight" in r for r in rep.rebinds), rep.summary()
        assert "l1_weight" in rep.summary()
    assert "model.layers.0.mlp.l1_weight" in rep.missing
    del layer.load_stored
    assert layer.l1_weight is original and layer.l1_weight.device.type == "cpu"
    after = layer_bytes(layer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_raw_dry_run_skips_host_scale_state(ckpts):
    """A raw NVFP4 dry run writes the per-expert scalars (recorded) but never
    touches pending pairs, a2 or any .item(): no live read, nothing pending."""
    src, out = ckpts.converted("ct-nvfp4")
    ck = mr.open_checkpoint(out)
    layer = ck.build_layer(0, backend="reference")
    a2 = float(layer.l2_activation_scale)
    rep = mr.verify_reload(layer, src)
    assert rep.ok, rep.summary()
    assert rep.params["model.layers.0.mlp.l1_alpha"].writes == 16
    assert layer.load_state() is None and float(layer.l2_activation_scale) == a2


def test_dry_run_checkpoint_uses_meta_layers_per_rank(ckpts, tmp_path):
    """What `megamoe-convert verify OUT --reload-dry-run` runs: meta-device layers
    of every EP rank (no memory, no data), one report per rank."""
    _, out = ckpts.converted("modelopt-nvfp4", ep_size=2)
    reps = mr.dry_run_checkpoint(out)
    assert [r.ep_rank for r in reps] == [0, 1] and all(r.ok for r in reps), [r.summary() for r in reps]
    assert "rank 1" in reps[1].summary()
    assert all(p.written_bytes == p.nbytes for r in reps for p in r.params.values())
    _, bad = ckpts.fresh_converted("bf16", tmp_path / "bad")
    _rewrite_tensor(bad, "model.layers.1.mlp.megamoe.l1_weight", lambda t: t[:6].contiguous(), experts=(0, 6))
    (rep,) = mr.dry_run_checkpoint(bad)
    assert not rep.ok and rep.missing["model.layers.1.mlp.l1_weight"].missing_experts == [6, 7]
    assert rep.to_dict()["problems"][0].startswith("model.layers.1.mlp.l1_weight: ")


def test_coverage_of_many_experts_names_each_gap_and_overlap():
    """The coverage report collects experts in sets (a list scan made 800k experts run for > 10 min): at the
    report's cap of 4096 gaps, every other expert missing and one written twice are all named, in order."""
    from megamoe_runtime.load.reload import _coverage, _Tracked, _Write

    MAX_EXPERTS = 2 * 4096
    per = 4
    tr = _Tracked(key=1, label="l.l1_weight", layer="l", role="l1_weight", nbytes=MAX_EXPERTS * per, is_param=True,
                  experts=(0, MAX_EXPERTS))
    starts = torch.arange(0, MAX_EXPERTS, 2, dtype=torch.int64) * per
    writes = [_Write(1, starts, per, "even", "copy_"), _Write(1, torch.tensor([6 * per]), per, "again", "copy_")]
    cov = _coverage(tr, writes)
    assert cov.missing_experts == list(range(1, MAX_EXPERTS, 2))
    assert cov.duplicated_experts == [6] and set(cov.duplicated_by) == {"even", "again"}
