"""End to end: synthetic checkpoints -> convert -> the bytes the kernels read.

* every row: the converted tensors, viewed through the manifest and decoded
  by the layout inverse, equal the reader's canonical bytes (and the NVFP4
  scalars / a2 equal the source's), pass-through tensors are byte-identical,
  shards respect --max-shard-size, EP ranks hold only their experts;
* the output is byte-identical across runs;
* `verify` catches a flipped byte in every shard, a missing file, a bad size;
* the bad-input catalogue (issue 3 item 6): each refused with exit 2 and a
  message naming the file / tensor / values, and nothing under OUT;
* an interrupted run (killed mid-write) leaves no OUT, and --resume
  completes it to byte-identical output.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from megamoe_convert.testing import synth
from megamoe_convert.cli.main import main
from megamoe_convert.pipeline.convert import convert
from megamoe_convert.output.output_dir import temp_dir_for
from megamoe_convert.readers import detect_reader
from megamoe_convert.output.shard_writer import parse_size
from megamoe_convert.pipeline.shared import shared_to_precision
from megamoe_convert.readers.source import open_source
from megamoe_runtime.format import layout
from megamoe_runtime.format.layout import KernelTensors
from megamoe_runtime.format.manifest import MANIFEST_NAME, kernel_view, read_manifest

SMALL = dict(num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)



def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def tree_bytes(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# --------------------------------------------------------------------------- round trip per row

CASES = [
    ("modelopt-nvfp4", dict(shared=1), 2),
    ("quark-mxfp4", {}, 2),
    ("ct-nvfp4", {}, 1),
    ("ct-mxfp8", {}, 1),
    ("bf16", dict(shared=2), 1),
    ("deepseek-v4", dict(shared=1), 2),
]


@pytest.mark.parametrize("fmt, extra, ep", CASES, ids=[c[0] for c in CASES])
def test_converted_bytes_equal_source(tmp_path, fmt, extra, ep):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", fmt, **SMALL, **extra, seed=1,
                                           max_shard_bytes=400_000)
    out = tmp_path / "out"
    max_shard = 150_000
    s = convert(src, out, ep_size=ep, max_shard_size=max_shard)
    assert s.layers == 2 and s.experts == 8 and s.ep_size == ep
    m = read_manifest(out)
    source = open_source(src)
    reader = detect_reader(source)
    row = reader.row
    assert m.row == row and m.ep_size == ep and m.source.format == reader.format_name
    E_l = 4 // ep
    for info in reader.moe_layers():
        le = m.layer(info.index)
        downs = []
        for r in range(ep):
            ents = m.tensors_of(info.index, r)
            kts = {}
            for role, te in ents.items():
                assert te.file.startswith(f"megamoe-experts-rank{r:03d}-of-{ep:03d}-")
                with safe_open(out / te.file, "pt") as f:
                    kts[role] = kernel_view(f.get_tensor(te.name), te)
                    assert f.metadata() == {"format": "pt", "megamoe.file": te.file, "megamoe.ep_rank": str(r)}
            kt = KernelTensors(kts["l1_weight"], kts.get("l1_scale"), kts["l2_weight"], kts.get("l2_scale"))
            back = layout.unpack_expert_stack(row, kt)
            assert len(back) == E_l
            for j, got in enumerate(back):
                e = r * E_l + j
                assert ents["l1_weight"].experts == (r * E_l, (r + 1) * E_l)
                want = reader.read_expert(info.index, e)
                for (role, pw), (_, pg) in zip(want.projections(), got.projections()):
                    assert torch.equal(pw.weight.view(torch.uint8), pg.weight.view(torch.uint8)), (e, role)
                    if pw.scale is not None:
                        assert torch.equal(pw.scale.view(torch.uint8), pg.scale.view(torch.uint8)), (e, role)
                if want.down.global_scale is not None:
                    assert kts["l1_alpha"][j].tolist() == [want.gate.global_scale, want.up.global_scale]
                    assert kts["l2_global_scale"][j].item() == want.down.global_scale
                    downs.append(want.down.input_scale)
            if info.shared is not None:
                sh = reader.read_shared(info.index)
                prec = le.shared["precision"]
                conv, _ = shared_to_precision(sh, info.shared.encoding, prec)
                skt = KernelTensors(kts["shared_l1_weight"], kts.get("shared_l1_scale"), kts["shared_l2_weight"],
                                    kts.get("shared_l2_scale"))
                got = layout.unpack_shared(prec, skt)[0]
                want = layout.fold_shared(prec, conv)
                for (_, pw), (_, pg) in zip(want.projections(), got.projections()):
                    assert torch.equal(pw.weight.view(torch.uint8), pg.weight.view(torch.uint8))
                assert le.shared["fused_capable"]
        if downs:
            assert le.scalars["l2_activation_scale"] == max(downs)
        assert le.layer_spec(ep - 1, ep).local_experts == range((ep - 1) * E_l, ep * E_l)
    # pass-through tensors unchanged, index covers them, config annotated
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for key, te in m.tensors.items():
        if te.role == "passthrough":
            with safe_open(out / te.file, "pt") as f:
                assert torch.equal(f.get_tensor(te.name).view(-1).view(torch.uint8),
                                   source.get_tensor(te.name).reshape(-1).view(torch.uint8))
            assert index["weight_map"][te.name] == te.file
    assert set(source.tensor_names()) - reader.consumed_tensor_names() == \
        {t.name for t in m.tensors.values() if t.role == "passthrough"}
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "format_version", "row", "manifest")} == \
        {"quant_method": "megamoe", "format_version": 1, "row": row, "manifest": MANIFEST_NAME}
    assert qc["source_quantization_config"] == source.config.get("quantization_config")
    for name, fe in m.files.items():
        assert (out / name).stat().st_size == fe.size
        if name.endswith(".safetensors"):
            n_tensors = sum(t.file == name for t in m.tensors.values())
            assert fe.size <= max_shard + 4096 or n_tensors == 1, name
    assert {p.name for p in out.iterdir()} == set(m.files) | {MANIFEST_NAME}
    assert not temp_dir_for(out).exists()
    source.close()


@pytest.mark.parametrize("checksum", ["sha256", "blake3"])
def test_deterministic_and_verify_catches_every_flipped_byte(tmp_path, checksum):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL, seed=2)
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        r = run_cli("convert", src, out, "--max-shard-size", "100KB", "--ep-size", "2", "--json",
                    "--checksum", checksum)
        assert r.exit_code == 0, r.output
    assert tree_bytes(a) == tree_bytes(b)
    summary = json.loads(r.stdout)
    assert summary["layers"] == 2 and summary["experts"] == 8 and summary["gb_per_s"] >= 0

    r = run_cli("verify", a, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"]
    shards = sorted(p for p in a.iterdir() if p.suffix == ".safetensors")
    assert len(shards) >= 3
    m = read_manifest(a)
    assert m.checksum == checksum and all(t.checksum_kind == checksum for t in m.tensors.values())
    assert {fe.digest for n, fe in m.files.items() if not n.endswith(".safetensors")} == {checksum}
    for shard in shards:
        # expert and pass-through shards: file digest over header + tensor digests
        assert m.files[shard.name].digest == f"{checksum}-of-header-and-tensor-digests"
        raw = bytearray(shard.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        starts = sorted(8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
        # the length prefix, inside the header JSON, the header's last (padding) byte, the first data
        # byte, every tensor's first byte, the last byte before each tensor, the middle and the last byte
        data_positions = {8 + n, (8 + n + len(raw)) // 2, len(raw) - 1}
        data_positions |= {p for b in starts for p in (b, b - 1) if 8 + n <= p < len(raw)}
        for pos in sorted({0, 3, 20, 8 + n - 1} | data_positions):
            raw[pos] ^= 0x01
            shard.write_bytes(bytes(raw))
            r = run_cli("verify", a)
            assert r.exit_code == 1, (shard.name, pos, r.output)
            assert "FAILED" in r.output and shard.name in r.output
            if pos in data_positions:  # the damaged tensor is named too
                assert checksum in r.output and "tensor '" in r.output, r.output
            raw[pos] ^= 0x01
            shard.write_bytes(bytes(raw))
    assert run_cli("verify", a).exit_code == 0
    # missing file, wrong size, newer manifest
    (a / shards[0].name).rename(tmp_path / "moved")
    r = run_cli("verify", a, "--json")
    assert r.exit_code == 1 and "missing" in json.loads(r.stdout)["problems"][0]
    (tmp_path / "moved").rename(a / shards[0].name)
    with open(a / "tokenizer.json", "ab") as f:
        f.write(b" ")
    r = run_cli("verify", a)
    assert r.exit_code == 1 and "tokenizer.json: size" in r.output
    d = json.loads((a / MANIFEST_NAME).read_text())
    d["format_version"] = 2
    (a / MANIFEST_NAME).write_text(json.dumps(d))
    r = run_cli("verify", a)
    assert r.exit_code == 1 and "newer megamoe" in r.output
    d["format_version"] = 1
    d["layers"][0]["scalars"]["l2_activation_scale"] *= 1.0001  # still a valid manifest, but not the written one
    (a / MANIFEST_NAME).write_text(json.dumps(d))
    r = run_cli("verify", a)
    assert r.exit_code == 1 and "manifest_sha256" in r.output and "modified or corrupted" in r.output
    r = run_cli("verify", tmp_path / "nope")
    assert r.exit_code == 2


# --------------------------------------------------------------------------- bad input catalogue


def _truncate(src: Path):
    shard = sorted(src.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    return [shard.name, "truncated"]


def _garbage_header(src: Path):
    shard = sorted(src.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:20] = b"\x00garbage!!\xff\xfe"
    shard.write_bytes(bytes(data))
    return [shard.name, "not valid UTF-8 JSON"]


def _index_missing_file(src: Path):
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    shard.unlink()
    return ["model.safetensors.index.json", shard.name, "missing"]


def _unsupported(src: Path):
    hq = json.loads((src / "hf_quant_config.json").read_text())
    hq["quantization"]["quant_algo"] = "W4A8_AWQ"
    (src / "hf_quant_config.json").write_text(json.dumps(hq))
    return ["W4A8_AWQ"]


BAD = [
    ("truncated shard", "modelopt-nvfp4", {}, _truncate, []),
    ("garbage header", "modelopt-nvfp4", {}, _garbage_header, []),
    ("index names missing file", "modelopt-nvfp4", {}, _index_missing_file, []),
    ("missing expert", "quark-mxfp4", dict(missing_expert=(1, 2)), None,
     ["layer 1 is missing expert(s) [2]", "model.layers.1.mlp.experts.2"]),
    ("nan global scale", "modelopt-nvfp4", dict(nan_scale=(0, 1, "up")), None,
     ["layer 0", "expert 1", "up", "nan"]),
    ("zero global scale", "ct-nvfp4", dict(zero_scale=(1, 3, "down")), None, ["layer 1", "expert 3", "down"]),
    ("nan E8M0 scale", "quark-mxfp4", dict(nan_scale=(0, 2, "gate")), None,
     ["layer 0", "expert 2", "gate", "0xFF", "first at [row, group] = [0, 0]"]),
    ("zero E8M0 scale", "modelopt-mxfp8", dict(zero_scale=(1, 0, "down")), None,
     ["layer 1", "expert 0", "down", "zero while their block has nonzero elements", "[0, 0]"]),
    ("0xFF scale", "ct-mxfp4", dict(ff_scale=(1, 1, "up")), None,
     ["MoE layer 1", "expert 1", "up scale", "1 of", "0xFF", "model.layers.1.mlp.experts.1.up_proj.weight_scale"]),
    ("w1/w3 mismatch", "modelopt-nvfp4", dict(scale_mismatch=(1, 2)), None,
     ["MoE layer 1", "expert 2", "w1 (gate) weight_scale_2 =", "w3 (up) weight_scale_2 =",
      "--on-scale-mismatch requantize"]),
    ("wrong shape", "modelopt-mxfp4", dict(wrong_shape=(0, 3, "down")), None,
     ["layer 0 expert 3 down", "model.layers.0.mlp.experts.3.down_proj.weight", "255"]),
    ("unsupported format", "modelopt-nvfp4", {}, _unsupported, []),
    # block FP8 (the experts the converter reads in place): the same refusals before anything is written
    ("truncated fp8-block shard", "fp8-block", {}, _truncate, []),
    ("missing fp8-block expert", "fp8-block", dict(missing_expert=(1, 3)), None,
     ["layer 1 is missing expert(s) [3] of 4", "model.layers.1.mlp.experts.3"]),
    ("missing ct-fp8-block expert", "ct-fp8-block", dict(missing_expert=(0, 0)), None,
     ["layer 0 is missing expert(s) [0] of 4", "model.layers.0.mlp.experts.0"]),
    ("row-incompatible size", "modelopt-nvfp4", dict(hidden=192), None,
     ["MoE layer 0", "hidden=192 is not a multiple of 128", "128 or 256"]),
]


@pytest.mark.parametrize("name, fmt, defect, mutate, needles", BAD, ids=[b[0] for b in BAD])
def test_bad_input_refused(tmp_path, name, fmt, defect, mutate, needles):
    sizes = {**SMALL, **{k: v for k, v in defect.items() if k in SMALL}}
    defect = {k: v for k, v in defect.items() if k not in SMALL}
    src = synth.build_synthetic_checkpoint(tmp_path / "src", fmt, **sizes, **defect, seed=3,
                                           max_shard_bytes=300_000)
    if mutate is not None:
        needles = needles + mutate(src)
    out = tmp_path / "out"
    r = run_cli("convert", src, out)
    assert r.exit_code == 2, r.output
    err = r.stderr
    assert err.startswith("error: "), err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    assert not out.exists() and not temp_dir_for(out).exists()
    assert "Traceback" not in r.output


def test_out_exists_refused_then_overwrite(tmp_path):
    """OUT exists: refused without --overwrite; with it, only a megamoe output
    is replaced (a foreign folder: see tests/convert/output/test_output_dir.py)."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "ct-mxfp4", **SMALL, seed=4)
    out = tmp_path / "out"
    assert run_cli("convert", src, out).exit_code == 0
    before = tree_bytes(out)
    r = run_cli("convert", src, out)
    assert r.exit_code == 2 and f"output folder {out} already exists; pass --overwrite" in r.stderr
    assert tree_bytes(out) == before
    r = run_cli("convert", src, out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert tree_bytes(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_requantize_policy_end_to_end(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL, seed=5,
                                           scale_mismatch=[(0, 1), (1, 3)])
    r = run_cli("convert", src, tmp_path / "out", "--on-scale-mismatch", "requantize", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["repaired_experts"] == 2
    assert "2 expert(s)" not in r.stderr and "will be requantized" in r.stderr
    m = read_manifest(tmp_path / "out")
    rep = m.layer(0).repairs[0]
    assert rep["expert"] == 1 and rep["weight_scale_2"] == max(rep["gate_weight_scale_2"], rep["up_weight_scale_2"])
    assert rep["max_abs_change"] > 0 and rep["max_rel_change"] < 0.1
    te = m.entry("model.layers.0.mlp.megamoe.l1_alpha")
    with safe_open(tmp_path / "out" / te.file, "pt") as f:
        alpha = f.get_tensor(te.name)
    assert alpha[1, 0] == alpha[1, 1] == rep["weight_scale_2"]
    assert run_cli("verify", tmp_path / "out").exit_code == 0


# --------------------------------------------------------------------------- interrupted run


def test_interrupted_run_resumes_to_identical_output(tmp_path, crashing_run):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "quark-mxfp4", **SMALL, seed=6)
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["--max-shard-size", "60KB", "--ep-size", "2"]
    assert run_cli("convert", src, ref, *args).exit_code == 0
    n_tensors = len(read_manifest(ref).tensors)
    # the shard writers run beside the producer: stopped at the 9th tensor, the run is killed (SIGKILL) only
    # once the journal records a finished shard, so a busy machine cannot leave none to damage below
    tmp = temp_dir_for(out)
    p = crashing_run("tensor", "9:120", "convert", src, out, *args, wait=False)
    journal_file, deadline = tmp / "megamoe-journal.jsonl", time.monotonic() + 90
    while time.monotonic() < deadline and p.poll() is None:
        if journal_file.exists() and any(json.loads(line)["kind"] == "file"
                                         for line in journal_file.read_text().splitlines() if line.endswith("}")):
            break
        time.sleep(0.05)
    p.kill()
    p.communicate()
    assert p.returncode == -signal.SIGKILL, p.returncode
    assert not out.exists() and tmp.is_dir()
    assert 9 < n_tensors
    # plain re-run refuses and says how to continue
    r = run_cli("convert", src, out, *args)
    assert r.exit_code == 2 and "--resume" in r.stderr
    # resuming with other options is refused
    r = run_cli("convert", src, out, "--max-shard-size", "1MB", "--resume")
    assert r.exit_code == 2 and "different inputs or options" in r.stderr
    # a finished shard damaged while interrupted is re-checked and rewritten
    journal = [json.loads(line) for line in (tmp / "megamoe-journal.jsonl").read_text().splitlines()]
    done = [j["name"] for j in journal if j["kind"] == "file"]
    assert done, "the crash point should leave at least one finished shard"
    with open(tmp / done[0], "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x5a")
    r = run_cli("convert", src, out, *args, "--resume", "--json")
    assert r.exit_code == 0, r.output
    assert f"{done[0]} failed its checksum re-check" in r.stderr
    assert json.loads(r.stdout)["resumed_files"] == len(done) - 1
    assert not tmp.exists()
    assert tree_bytes(out) == tree_bytes(ref)
    assert run_cli("verify", out).exit_code == 0


def test_parse_size_used_by_cli(tmp_path):
    r = run_cli("convert", tmp_path, tmp_path / "o", "--max-shard-size", "lots")
    assert r.exit_code == 2 and "--max-shard-size" in r.output
    assert parse_size("5GB") == 5_000_000_000


@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "quark-mxfp4"])
def test_fast_codecs_write_the_same_bytes(tmp_path, monkeypatch, fmt):
    """The table and fused codecs (NVFP4 -> MXFP8 and MXFP4 -> MXFP8 shared experts,
    table decodes) write exactly the bytes the composed arithmetic codecs wrote
    before them: the whole output folder, manifest included, is compared."""
    from megamoe_runtime.format import codecs as C

    src = synth.build_synthetic_checkpoint(tmp_path / "src", fmt, **SMALL, shared=1, seed=5)
    convert(src, tmp_path / "fast")

    def composed_nvfp4_to_mxfp8(packed, sf, g):
        x = C.dequantize_nvfp4(packed, sf, g)
        q, e = C.quantize_mxfp8(x)
        return q, e, (C.dequantize_mx(q, e, "e4m3") - x).abs().max()

    monkeypatch.setattr(C, "_use_tables", lambda t: False)  # every decode on the arithmetic path
    monkeypatch.setattr(C, "nvfp4_to_mxfp8", composed_nvfp4_to_mxfp8)
    monkeypatch.setattr(C, "e2m1_packed_to_e4m3", lambda p: C.e4m3_encode(C.e2m1_decode(C.unpack_e2m1(p))))
    convert(src, tmp_path / "slow")
    fast, slow = tree_bytes(tmp_path / "fast"), tree_bytes(tmp_path / "slow")
    assert fast.keys() == slow.keys() and all(fast[k] == slow[k] for k in fast), \
        [k for k in fast if fast[k] != slow.get(k)]
    conversions = {le.shared["conversion"] for le in read_manifest(tmp_path / "fast").layers}
    assert conversions == {"nvfp4->mxfp8 (dequantize, re-encode)" if fmt == "modelopt-nvfp4"
                           else "mxfp4->mxfp8 (exact)"}


def test_killed_during_final_sync_still_resumes(tmp_path, monkeypatch):
    """A kill after every shard is written but before the final rename (the
    fsync of every output file can take minutes on a large model) must leave a
    temp folder that --resume can finish: the journal goes only after the sync."""
    import megamoe_convert.output.temp_folder as temp_folder_mod

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "quark-mxfp4", **SMALL, seed=8)
    ref, out = tmp_path / "ref", tmp_path / "out"
    convert(src, ref)

    def killed(path):
        raise KeyboardInterrupt("killed during the final fsync")

    monkeypatch.setattr(temp_folder_mod, "fsync_dir", killed)
    with pytest.raises(KeyboardInterrupt):
        convert(src, out)
    monkeypatch.undo()
    assert not out.exists() and temp_dir_for(out).is_dir()
    s = convert(src, out, resume=True)
    assert s.resumed_files > 0
    assert tree_bytes(out) == tree_bytes(ref)


def test_output_target_checked_before_the_source_is_opened(tmp_path, monkeypatch):
    """An interrupted run's temp folder without --resume is refused before the
    source is opened (a hub source would be downloaded and every scale read
    first otherwise); OUT's missing parents are created, and removed again
    when the run fails."""
    import megamoe_convert.pipeline.convert as convert_mod
    from megamoe_convert.output.output_dir import OutputError, write_temp_marker

    class Opened(Exception):
        pass

    def no_open(*a, **k):
        raise Opened("the source is opened only now")

    monkeypatch.setattr(convert_mod, "open_source", no_open)
    with pytest.raises(Opened):  # every output check passed, parents created ...
        convert("org/some-model", tmp_path / "nope" / "deeper" / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # ... and removed again with the lock
    out = tmp_path / "out"
    temp_dir_for(out).mkdir()
    with pytest.raises(OutputError, match="not made by megamoe-convert"):  # no marker: not ours
        convert("org/some-model", out, overwrite=True)
    write_temp_marker(temp_dir_for(out), out)
    with pytest.raises(OutputError, match=r"interrupted \(no process holds its lock.*\); pass --resume"):
        convert("org/some-model", out)
    with pytest.raises(OutputError, match="no progress journal"):
        convert("org/some-model", out, resume=True)
    assert not out.exists() and temp_dir_for(out).is_dir()  # nothing created or removed


def test_quantize_nvfp4_needs_and_takes_an_explicit_a2(tmp_path):
    """--quantize nvfp4 has no calibration data: a2 must be given, and is then
    used as is; a calibrated checkpoint refuses an override."""
    import megamoe_runtime as mr
    from megamoe_convert.pipeline.convert import convert as do_convert
    from megamoe_convert.testing.synth import build_synthetic_checkpoint
    from megamoe_runtime.errors import ScaleError

    src = build_synthetic_checkpoint(tmp_path / "bf16", "bf16", num_layers=1, hidden=128, intermediate=128,
                                     num_experts=4, top_k=2)
    with pytest.raises(ScaleError, match="--l2-activation-scale"):
        do_convert(src, tmp_path / "a", quantize="nvfp4")
    assert not (tmp_path / "a").exists()
    do_convert(src, tmp_path / "b", quantize="nvfp4", l2_activation_scale=0.003)
    ck = mr.open_checkpoint(tmp_path / "b")
    assert ck.layers[0].scalars["l2_activation_scale"] == 0.003
    layer = ck.build_layer(ck.layers[0].index, backend="reference")
    assert float(layer.l2_activation_scale) == pytest.approx(0.003)
    x = torch.randn(5, 128).to(torch.bfloat16)
    y = layer(x, torch.rand(5, 2), torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [-1, 2]]))
    assert bool(torch.isfinite(y.float()).all())

    nv = build_synthetic_checkpoint(tmp_path / "nv", "modelopt-nvfp4", num_layers=1, hidden=128, intermediate=128,
                                    num_experts=4, top_k=2)
    with pytest.raises(ScaleError, match="determine a2"):
        do_convert(nv, tmp_path / "c", l2_activation_scale=0.003)


def test_quantization_configs_say_megamoe(tmp_path):
    """Both files an engine reads for the quantization scheme name the megamoe layout."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", num_layers=1, hidden=128,
                                           intermediate=128, num_experts=4, top_k=2)
    assert (src / "hf_quant_config.json").exists()
    convert(src, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    hq = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "megamoe" and qc["row"] == "nvfp4" and qc["manifest"] == "megamoe.json"
    assert qc["source_quantization_config"] == json.loads((src / "config.json").read_text())["quantization_config"]
    assert hq["megamoe"] == {"format_version": 1, "row": "nvfp4", "manifest": "megamoe.json"}
    assert hq["quantization"] == json.loads((src / "hf_quant_config.json").read_text())["quantization"]


# --------------------------------------------------------------------------- direct weight reads


def _byte_outside_samples(source, name: str) -> tuple[Path, int]:
    """An absolute offset inside tensor `name`'s data that no content_hash sample window covers."""
    from megamoe_convert.readers.source import _SAMPLE_BYTES, _SAMPLES

    path, pos, n = source.tensor_data_range(name)
    fh = source.file_header(path)
    data0 = 8 + fh.header_len
    windows = [(data0 + (fh.file_size - data0) * i // _SAMPLES,) for i in range(_SAMPLES)]
    for off in range(pos + n // 2, pos + n):
        if all(not (w <= off < w + _SAMPLE_BYTES) for (w,) in windows):
            return path, off
    raise AssertionError("no byte outside the sample windows")  # pragma: no cover


@pytest.mark.parametrize("what", ["expert", "passthrough"])
def test_resume_refuses_a_changed_source(tmp_path, what, stopped_convert):
    """One source byte changed while the run was interrupted: outside every
    content_hash sample window, same size, mtime put back with os.utime. The
    tensors of the finished files are re-derived from the source on resume
    and compared with what was written: refused, naming the tensor and file;
    the temp folder is kept. Negative control: put the byte back and the same
    resume completes to the reference bytes."""
    from megamoe_convert.pipeline.plan import SourceChangedError

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "quark-mxfp4", **SMALL, seed=6)
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = dict(max_shard_size="60KB")
    convert(src, ref, **args)
    m = read_manifest(ref)
    # stop once the first expert file (layer 0) is finished, or for pass-through, at the last tensor
    n = len(m.tensors) - 1 if what == "passthrough" else 9
    stopped_convert(src, out, n, **args)
    tmp = temp_dir_for(out)
    journal = [json.loads(line) for line in (tmp / "megamoe-journal.jsonl").read_text().splitlines()]
    done = {t["name"] for j in journal if j["kind"] == "file" for t in j["tensors"].values()}
    source = open_source(src)
    if what == "expert":
        name = "model.layers.0.mlp.experts.1.down_proj.weight"
        assert "model.layers.0.mlp.megamoe.l2_weight" in done
    else:
        name = next(t for t in sorted(done) if "megamoe" not in t and "embed" in t)
    path, off = _byte_outside_samples(source, name)
    fingerprint_before = source.content_hash()
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(off)
        orig = f.read(1)
        f.seek(off)
        f.write(bytes([orig[0] ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert open_source(src).content_hash() == fingerprint_before  # the sampled identity cannot see it
    with pytest.raises(SourceChangedError, match=rf"tensor .* of the finished file .* would now be blake3 .*"
                                                 rf"the interrupted run wrote .*Pass --overwrite"):
        convert(src, out, resume=True, **args)
    assert tmp.is_dir() and not out.exists()
    r = run_cli("convert", src, out, "--max-shard-size", "60KB", "--resume")
    assert r.exit_code == 2 and "--resume refused: the source changed" in r.stderr
    # the mtime not put back: the journaled identity names the file at once
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(orig)
    with pytest.raises(SourceChangedError, match=rf"{path.name}: mtime {st.st_mtime_ns} -> "):
        convert(src, out, resume=True, **args)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    s = convert(src, out, resume=True, **args)  # the byte back: resumes
    assert s.resumed_files > 0 and tree_bytes(out) == tree_bytes(ref)


# --------------------------------------------------------------------------- the frozen heap


def test_convert_freezes_the_heap_only_while_it_runs(tmp_path, monkeypatch):
    """The objects alive at the start are kept out of the collector's passes
    during the run (gc.freeze) and given back after it, also after a failure."""
    import gc

    import megamoe_convert.pipeline.convert as mc

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "quark-mxfp4", **SMALL, seed=3)
    seen = []
    real = mc._convert_locked
    monkeypatch.setattr(mc, "_convert_locked", lambda *a, **k: seen.append(gc.get_freeze_count()) or real(*a, **k))
    assert gc.get_freeze_count() == 0
    convert(src, tmp_path / "out")
    assert seen[0] > 0 and gc.get_freeze_count() == 0

    def boom(*a, **k):
        raise RuntimeError("planted")

    monkeypatch.setattr(mc, "_convert_locked", boom)
    with pytest.raises(RuntimeError, match="planted"):
        convert(src, tmp_path / "out2")
    assert gc.get_freeze_count() == 0


def test_convert_leaves_a_callers_frozen_heap_alone(tmp_path, monkeypatch):
    """Negative: a caller that froze objects itself keeps its freeze (not undone, not re-frozen). Checked by
    the calls convert makes, not by the frozen count, which drops whenever a frozen object is freed."""
    import gc

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "quark-mxfp4", **SMALL, seed=3)
    real_freeze, real_unfreeze, calls = gc.freeze, gc.unfreeze, []
    real_freeze()
    try:
        monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
        monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
        convert(src, tmp_path / "out")
        assert calls == [] and gc.get_freeze_count() > 0
    finally:
        monkeypatch.undo()
        real_unfreeze()


def test_convert_shortens_the_switch_interval_only_while_streaming(tmp_path, monkeypatch):
    """The streaming pass runs with `SWITCH_INTERVAL` (the writer threads wait
    less for the GIL); the caller's interval is back afterwards, also after a
    failure, and a caller's shorter one is kept."""
    import megamoe_convert.pipeline.convert as mc
    import megamoe_convert.pipeline.run as mr

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "quark-mxfp4", **SMALL, seed=3)
    seen = []
    real = mr.run_conversion

    def spy(*a, **k):
        seen.append(sys.getswitchinterval())
        return real(*a, **k)

    monkeypatch.setattr(mc, "run_conversion", spy)
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        convert(src, tmp_path / "out")
        # (the interpreter keeps whole microseconds: compare loosely)
        assert seen == [pytest.approx(mc.SWITCH_INTERVAL, rel=0.05)]
        assert sys.getswitchinterval() == pytest.approx(0.004, rel=0.05)
        sys.setswitchinterval(0.0001)  # shorter already: kept
        convert(src, tmp_path / "out2")
        assert seen[-1] == pytest.approx(0.0001, rel=0.05)
        assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)

        def boom(*a, **k):
            seen.append(sys.getswitchinterval())
            raise RuntimeError("planted")

        monkeypatch.setattr(mc, "run_conversion", boom)
        sys.setswitchinterval(0.004)
        with pytest.raises(RuntimeError, match="planted"):
            convert(src, tmp_path / "out3")
        assert seen[-1] == pytest.approx(mc.SWITCH_INTERVAL, rel=0.05)
        assert sys.getswitchinterval() == pytest.approx(0.004, rel=0.05)
    finally:
        sys.setswitchinterval(before)


# --------------------------------------------------------------------------- O_DIRECT switch


def test_direct_writes_can_be_turned_off_with_the_same_bytes(tmp_path, monkeypatch):
    """``MEGAMOE_CONVERT_DIRECT=0``: no O_DIRECT descriptor is opened and the
    output is byte for byte the default (O_DIRECT where the file system takes it)."""
    import megamoe_convert.output.shard_writer as sw

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL, seed=5)
    opened = []
    real = sw._open_direct
    monkeypatch.setattr(sw, "_open_direct", lambda p: opened.append(p) or real(p))
    convert(src, tmp_path / "on")
    assert opened, "the default run never asked for an O_DIRECT descriptor"
    opened.clear()
    monkeypatch.setenv("MEGAMOE_CONVERT_DIRECT", "0")
    convert(src, tmp_path / "off")
    assert opened == []
    assert tree_bytes(tmp_path / "off") == tree_bytes(tmp_path / "on")
