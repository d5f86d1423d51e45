"""CheckpointSource: local folders, sharded indexes, header validation, hub cache/offline."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from megamoe_runtime.errors import CheckpointError
from megamoe_convert.readers.source import (
    HUB_ALLOW_PATTERNS,
    is_hub_id,
    open_source,
    read_safetensors_header,
)


def _write_raw(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


# ------------------------------------------------------------------ local, single file


def test_local_single_file(synth_ckpt):
    p = synth_ckpt("bf16")
    src = open_source(str(p))
    assert src.kind == "local" and src.root == p.resolve() and src.revision is None
    assert src.config["model_type"] == "qwen3_moe"
    assert src.quant_config is None
    names = src.tensor_names()
    assert names == sorted(names)
    n = "model.layers.1.mlp.experts.3.gate_proj.weight"
    assert n in names and n in src
    assert src.header(n) == ("BF16", (128, 256))
    assert src.file_of(n).name == "model.safetensors"
    t = src.get_tensor(n)
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (128, 256)
    sl = src.get_slice(n)
    assert torch.equal(sl[2:4], t[2:4])
    assert src.nbytes(n) == 128 * 256 * 2
    extra = [f.name for f in src.extra_files()]
    assert "config.json" in extra and "tokenizer.json" in extra and "generation_config.json" in extra
    assert "model.safetensors" not in extra


def test_missing_tensor_names_the_tensor(synth_ckpt):
    src = open_source(synth_ckpt("bf16"))
    with pytest.raises(CheckpointError, match="no_such.weight"):
        src.get_tensor("no_such.weight")


def test_content_hash_stable_and_sensitive(make_ckpt):
    a = make_ckpt("bf16", seed=1)
    b = make_ckpt("bf16", seed=1)
    ha, hb = open_source(a).content_hash(), open_source(b).content_hash()
    assert ha == hb  # same bytes, different folders
    assert open_source(a).content_hash(full=True) == open_source(b).content_hash(full=True)
    cfg = json.loads((b / "config.json").read_text())
    cfg["routed_scaling_factor"] = 2.0
    (b / "config.json").write_text(json.dumps(cfg))
    assert open_source(b).content_hash() != ha
    c = make_ckpt("bf16", seed=2)
    assert open_source(c).content_hash() != ha


def test_f8_e8m0_tensors_read(synth_ckpt):
    src = open_source(synth_ckpt("deepseek-v4"))
    n = "layers.1.ffn.experts.0.w1.scale"
    assert src.header(n)[0] == "F8_E8M0"
    assert src.get_tensor(n).dtype == torch.float8_e8m0fnu
    assert src.header("layers.1.ffn.experts.0.w1.weight") == ("I8", (128, 128))


def test_revision_with_local_folder_refused(synth_ckpt):
    with pytest.raises(CheckpointError, match="hub repos only"):
        open_source(synth_ckpt("bf16"), revision="main")


def test_neither_folder_nor_repo_id(tmp_path):
    with pytest.raises(CheckpointError, match="neither an existing folder nor a hub repo id"):
        open_source(str(tmp_path / "does" / "not" / "exist"))
    f = tmp_path / "file.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        open_source(str(f))


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        open_source(tmp_path)


def test_hub_id_syntax():
    assert is_hub_id("org/name") and is_hub_id("deepseek-ai/DeepSeek-V3.1")
    assert not is_hub_id("/abs/path") and not is_hub_id("a/b/c") and not is_hub_id("name")


# ------------------------------------------------------------------ sharded


def test_tensor_header_is_the_files_entry_and_unknown_names_still_fail(synth_ckpt):
    """`tensor_header` remembers entries by name: the same object as its file's
    header entry, every time, in every shard; a name not in the checkpoint
    still raises (twice: a miss is not remembered)."""
    p = synth_ckpt("modelopt-nvfp4", max_shard_bytes=150_000)
    src = open_source(p)
    for name in src.tensor_names()[::13]:
        th = src.tensor_header(name)
        assert th is src.file_header(src.file_of(name)).tensors[name] is src.tensor_header(name)
    for _ in range(2):
        with pytest.raises(CheckpointError, match="no tensor 'no_such.weight'"):
            src.tensor_header("no_such.weight")


def test_sharded_index(synth_ckpt):
    p = synth_ckpt("modelopt-nvfp4", max_shard_bytes=150_000)
    shards = sorted(p.glob("model-*.safetensors"))
    assert len(shards) > 2
    src = open_source(p)
    assert src.files() == shards
    index = json.loads((p / "model.safetensors.index.json").read_text())
    assert set(src.tensor_names()) == set(index["weight_map"])
    for name, f in list(index["weight_map"].items())[::17]:
        assert src.file_of(name).name == f
        src.get_tensor(name)
    assert "model.safetensors.index.json" not in [f.name for f in src.extra_files()]
    assert "hf_quant_config.json" in [f.name for f in src.extra_files()]


def test_index_names_missing_shard(make_ckpt):
    p = make_ckpt("bf16", max_shard_bytes=150_000)
    victim = sorted(p.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name) as ei:
        open_source(p)
    assert "model.safetensors.index.json" in str(ei.value)


def test_index_maps_tensor_to_wrong_file(make_ckpt):
    p = make_ckpt("bf16", max_shard_bytes=150_000)
    ip = p / "model.safetensors.index.json"
    index = json.loads(ip.read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    ip.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{name}.*{files[1]}|no such tensor"):
        open_source(p)


def test_shard_tensor_missing_from_index(make_ckpt):
    p = make_ckpt("bf16", max_shard_bytes=150_000)
    ip = p / "model.safetensors.index.json"
    index = json.loads(ip.read_text())
    wm = index["weight_map"]
    name = next(n for n in sorted(wm) if sum(f == wm[n] for f in wm.values()) > 1)
    del wm[name]
    ip.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not list"):
        open_source(p)


def test_duplicate_tensor_without_index(make_ckpt):
    p = make_ckpt("bf16")
    shutil.copy(p / "model.safetensors", p / "model-copy.safetensors")
    with pytest.raises(CheckpointError, match="in both"):
        open_source(p)


# ------------------------------------------------------------------ header validation


def test_truncated_shard_names_file(make_ckpt):
    p = make_ckpt("bf16", max_shard_bytes=150_000)
    victim = sorted(p.glob("model-*.safetensors"))[2]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=f"{victim.name}.*truncated"):
        open_source(p)


def test_truncated_inside_header(tmp_path):
    f = tmp_path / "model.safetensors"
    _write_raw(f, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    f.write_bytes(f.read_bytes()[:20])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        read_safetensors_header(f)
    f.write_bytes(b"\1\2\3")
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors_header(f)


def test_garbage_header_names_file(make_ckpt):
    p = make_ckpt("bf16")
    f = p / "model.safetensors"
    data = bytearray(f.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    data[8 : 8 + 16] = b"\xff\xfe garbage!!!!!\x00"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors.*not valid UTF-8 JSON"):
        open_source(p)
    assert n > 16


def test_random_bytes_file(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(4096))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        open_source(tmp_path)


def test_header_length_limit(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", 100_000_001) + b"{}")
    with pytest.raises(CheckpointError, match="x.safetensors.*exceeds"):
        read_safetensors_header(f)


def test_header_not_an_object(tmp_path):
    f = tmp_path / "x.safetensors"
    raw = b"[1, 2]"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        read_safetensors_header(f)


@pytest.mark.parametrize(
    "header, data, match",
    [
        # gap between tensors
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}},
            b"\0" * 16,
            "gap before tensor 'b'",
        ),
        # overlap
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
            b"\0" * 12,
            "overlap",
        ),
        # end - begin != numel * bytes
        ({"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 6"),
        # not starting at 0
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}, b"\0" * 8, "gap"),
        # trailing bytes
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 9, "trailing bytes"),
        # unknown dtype
        ({"a": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, "unknown dtype 'Q7'"),
        # bad shape
        ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "invalid shape"),
        # missing keys
        ({"a": {"dtype": "U8", "shape": [4]}}, b"\0" * 4, "lacks"),
    ],
)
def test_header_tiling_rules(tmp_path, header, data, match):
    f = tmp_path / "bad.safetensors"
    _write_raw(f, header, data)
    with pytest.raises(CheckpointError, match=match) as ei:
        read_safetensors_header(f)
    assert "bad.safetensors" in str(ei.value)


def test_valid_handmade_header(tmp_path):
    f = tmp_path / "ok.safetensors"
    _write_raw(
        f,
        {"__metadata__": {"format": "pt"},
         "b": {"dtype": "F8_E8M0", "shape": [2, 2], "data_offsets": [8, 12]},
         "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
        b"\0" * 12,
    )
    fh = read_safetensors_header(f)
    assert fh.metadata == {"format": "pt"}
    assert fh.tensors["b"].dtype == "F8_E8M0" and fh.tensors["b"].shape == (2, 2)
    assert fh.tensors["a"].nbytes == 8


def _scalar_file(tmp_path, values: dict[str, torch.Tensor]) -> Path:
    """A one-file checkpoint folder holding `values` (name -> tensor)."""
    header, data = {}, b""
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int32: "I32"}
    for name, t in values.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    d = tmp_path / "ckpt"
    d.mkdir()
    _write_raw(d / "model.safetensors", header, data)
    (d / "config.json").write_text("{}")
    return d


def test_first_value_equals_the_tensor_path_bit_for_bit(tmp_path):
    """`first_value` (struct decode for F32/F16/BF16, get_tensor otherwise) gives
    what ``float(get_tensor(n).float().reshape(-1)[0])`` gives, specials included."""
    specials = [0.0, -0.0, 1.0, 3.0e-3, 448.0, 1e-45, 3.4e38, float("inf"), float("-inf"), float("nan"), -2.5]
    values = {}
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32):
        for i, v in enumerate(specials):
            if dt == torch.int32 and not (abs(v) < 1e9 and v == v):
                continue
            values[f"{dt}.{i}.scalar"] = torch.tensor(v).to(dt)
            values[f"{dt}.{i}.vector"] = torch.tensor([v, 7.0]).to(dt)
    src = open_source(str(_scalar_file(tmp_path, values)))
    wants = {name: float(src.get_tensor(name).float().reshape(-1)[0]) for name in values}
    real = src.get_tensor

    def guarded(name):  # the struct path must not make a tensor
        assert not name.startswith(("torch.float32", "torch.float16", "torch.bfloat16")), name
        return real(name)

    src.get_tensor = guarded
    for name, want in wants.items():
        got = src.first_value(name)
        assert type(got) is float
        assert struct.pack("<d", got) == struct.pack("<d", want) or (got != got and want != want), name


def test_first_value_of_a_truncated_file_is_an_error(tmp_path):
    """Negative: a scalar whose bytes lie past the end of a file that shrank after
    its header was read is refused (a short read falls back to get_tensor's error),
    and an empty tensor has no first value."""
    d = _scalar_file(tmp_path, {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0), "e": torch.zeros(0)})
    src = open_source(str(d))
    assert src.first_value("b") == 3.0
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4])  # "b" is gone
    with pytest.raises(CheckpointError, match="unexpected end of file"):
        src.first_value("b")
    with pytest.raises(IndexError):
        src.first_value("e")


# ------------------------------------------------------------------ hub


def _offline(monkeypatch, cache: Path) -> None:
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))


def test_hub_offline_not_cached(tmp_path, monkeypatch):
    _offline(monkeypatch, tmp_path / "hub-cache")
    with pytest.raises(CheckpointError) as ei:
        open_source("some-org/some-model")
    msg = str(ei.value)
    assert "some-org/some-model" in msg and "offline" in msg and "HF_HUB_OFFLINE" in msg
    assert "main" in msg


def test_hub_local_files_only_not_cached(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(CheckpointError, match="some-org/other.*local_files_only"):
        open_source("some-org/other", cache_dir=tmp_path / "c", local_files_only=True)


def _fake_snapshot(cache: Path, repo: str, ckpt: Path, commit: str = "a" * 40, symlinks: bool = True) -> Path:
    """Lay out ckpt as a hub-cache snapshot: blobs/<sha256> + snapshots/<commit>/ links + refs/main."""
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "blobs").mkdir()
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for f in ckpt.iterdir():
        data = f.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        blob = root / "blobs" / sha
        blob.write_bytes(data)
        if symlinks:
            os.symlink(os.path.relpath(blob, snap), snap / f.name)
        else:
            shutil.copy(blob, snap / f.name)
    return snap


def test_hub_cached_snapshot_offline(tmp_path, monkeypatch, synth_ckpt):
    ckpt = synth_ckpt("modelopt-nvfp4", max_shard_bytes=200_000)
    cache = tmp_path / "hub"
    snap = _fake_snapshot(cache, "acme/tiny-moe", ckpt)
    _offline(monkeypatch, cache)
    src = open_source("acme/tiny-moe")
    assert src.kind == "hub" and src.id == "acme/tiny-moe"
    assert src.revision == "main" and src.commit == "a" * 40
    assert Path(src.root).resolve() == snap.resolve()
    assert src.quant_config["quantization"]["quant_algo"] == "NVFP4"
    local = open_source(ckpt)
    assert src.tensor_names() == local.tensor_names()
    n = "model.layers.0.mlp.experts.1.down_proj.weight"
    assert torch.equal(src.get_tensor(n), local.get_tensor(n))
    # blob names are the LFS sha256: content_hash uses them, no re-hashing
    assert src.content_hash() == open_source("acme/tiny-moe").content_hash()
    # revision given as the commit hash
    assert open_source("acme/tiny-moe", revision="a" * 40).commit == "a" * 40


def test_hub_cached_snapshot_local_files_only(tmp_path, monkeypatch, synth_ckpt):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    ckpt = synth_ckpt("bf16")
    cache = tmp_path / "hub"
    _fake_snapshot(cache, "acme/plain", ckpt, commit="b" * 40, symlinks=False)
    src = open_source("acme/plain", cache_dir=cache, local_files_only=True)
    assert src.kind == "hub" and src.commit == "b" * 40
    assert len(src.tensor_names()) == len(open_source(ckpt).tensor_names())


def test_hub_cached_snapshot_missing_shard(tmp_path, monkeypatch, synth_ckpt):
    ckpt = synth_ckpt("bf16", max_shard_bytes=150_000)
    cache = tmp_path / "hub"
    snap = _fake_snapshot(cache, "acme/partial", ckpt, commit="c" * 40)
    victim = sorted(snap.glob("model-*.safetensors"))[0]
    victim.unlink()
    _offline(monkeypatch, cache)
    with pytest.raises(CheckpointError, match=f"{victim.name}.*incomplete download"):
        open_source("acme/partial")


def test_hub_unknown_revision_offline(tmp_path, monkeypatch, synth_ckpt):
    cache = tmp_path / "hub"
    _fake_snapshot(cache, "acme/tiny", synth_ckpt("bf16"))
    _offline(monkeypatch, cache)
    with pytest.raises(CheckpointError, match="acme/tiny.*'v2'"):
        open_source("acme/tiny", revision="v2")


def test_hub_allow_patterns_cover_needed_files():
    import fnmatch

    for f in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json",
              "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json",
              "hf_quant_config.json", "merges.txt", "vocab.txt", "chat_template.jinja"):
        assert any(fnmatch.fnmatchcase(f, p) for p in HUB_ALLOW_PATTERNS), f
    for f in ("pytorch_model.bin", "model.gguf", "consolidated.pth"):
        assert not any(fnmatch.fnmatchcase(f, p) for p in HUB_ALLOW_PATTERNS), f


# ------------------------------------------------------------------ reads


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("fmt", ["deepseek-v4", "ct-nvfp4", "fp32", "bf16-fused"])
def test_reads_equal_safe_open(synth_ckpt, fmt):
    from safetensors import safe_open

    src = open_source(synth_ckpt(fmt, shared=0 if fmt == "bf16-fused" else 1, max_shard_bytes=100_000))
    for n in src.tensor_names():
        with safe_open(str(src.file_of(n)), framework="pt") as f:
            want = f.get_tensor(n)
        got = src.get_tensor(n)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(_bytes(got), _bytes(want)), n
        sl = src.get_slice(n)
        assert sl.get_shape() == list(want.shape) and sl.get_dtype() == src.header(n)[0]
        if want.dim() >= 1 and want.shape[0] > 2:
            assert torch.equal(_bytes(sl[1:3]), _bytes(want[1:3]))
            assert torch.equal(_bytes(sl[-1]), _bytes(want[-1]))
            if want.dim() == 3:
                assert torch.equal(_bytes(sl[2, 3:5]), _bytes(want[2, 3:5]))


def test_reads_do_not_mmap(synth_ckpt):
    """A mapping keeps touched pages resident: RSS would grow with the model."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc")
    p = synth_ckpt("modelopt-mxfp8", max_shard_bytes=100_000)
    src = open_source(p)
    for n in src.tensor_names():
        src.get_tensor(n)
    src.get_slice(src.tensor_names()[0])[0]
    assert str(p.resolve()) not in maps.read_text()
    src.close()


def test_file_changed_after_open(make_ckpt):
    p = make_ckpt("bf16")
    src = open_source(p)
    n = "lm_head.weight"
    f = src.file_of(n)
    end = src.tensor_header(n).end + 8 + src.file_header(f).header_len
    with open(f, "r+b") as fh:
        fh.truncate(end - 10)
    with pytest.raises(CheckpointError, match="unexpected end of file"):
        src.get_tensor(n)


def test_hub_fetches_only_the_shards_the_index_names(tmp_path, monkeypatch, synth_ckpt):
    """Configs and the index first, then exactly the indexed shards: a second copy
    of the weights beside them (consolidated.safetensors) is never downloaded."""
    import huggingface_hub

    src = synth_ckpt("modelopt-nvfp4", max_shard_bytes=200_000)
    shards = sorted(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(set(shards)) > 1
    snap = tmp_path / "snapshots" / "abc123"
    calls = []

    def fake_snapshot_download(repo_id, *, revision, cache_dir, allow_patterns, ignore_patterns,
                               local_files_only, token=None):
        calls.append(list(allow_patterns))
        snap.mkdir(parents=True, exist_ok=True)
        for p in src.iterdir():
            if any(fnmatch.fnmatchcase(p.name, pat) for pat in allow_patterns):
                shutil.copyfile(p, snap / p.name)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    s = open_source("org/model")
    assert s.kind == "hub" and s.commit == "abc123"
    assert len(calls) == 2
    assert "*.json" in calls[0] and not any(p.endswith(".safetensors") for p in calls[0])
    assert calls[1] == sorted(set(shards))
    assert sorted(p.name for p in snap.glob("*.safetensors")) == sorted(set(shards))
    s.close()


# ------------------------------------------------------------------ containment (local sources, like hub ones)


def _sharded(make_ckpt) -> tuple[Path, dict]:
    src = make_ckpt("quark-mxfp4", num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2,
                    max_shard_bytes=200_000)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    return src, index


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABS", "sub/x.safetensors", ".hidden.safetensors"])
def test_local_index_entry_outside_the_folder_refused(make_ckpt, entry):
    src, index = _sharded(make_ckpt)
    first = sorted(set(index["weight_map"].values()))[0]
    target = src.parent / "outside.safetensors"
    shutil.copyfile(src / first, target)  # a real, valid file: only its place is wrong
    if entry == "ABS":
        entry = str(target)
    index["weight_map"] = {k: (entry if v == first else v) for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="names shard files outside the checkpoint folder: "
                                              rf"'{entry}'.*file names in the folder itself"):
        open_source(src)


def test_symlinked_shard_outside_refused_and_inside_allowed(make_ckpt, tmp_path):
    src = make_ckpt("ct-mxfp8", num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)
    shard = next(src.glob("*.safetensors"))
    elsewhere = tmp_path / "elsewhere.bin"
    shutil.move(shard, elsewhere)
    shard.symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=rf"{shard.name} resolves to {elsewhere}, outside the source folder"):
        open_source(src)
    inner = src / "store"
    inner.mkdir()
    shutil.move(elsewhere, inner / "w.bin")
    shard.unlink()
    shard.symlink_to(inner / "w.bin")  # inside the folder: fine
    assert open_source(src).tensor_names()


def test_symlinked_extra_file_outside_skipped_with_warning(make_ckpt, tmp_path):
    from megamoe_convert.pipeline.convert import convert

    src = make_ckpt("ct-mxfp8", num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the model")
    (src / "notes.txt").symlink_to(secret)
    s = open_source(src)
    assert "notes.txt" not in [p.name for p in s.extra_files()]
    assert any("notes.txt is a symlink to" in w and "not copied" in w for w in s.warnings)
    logs = []
    summary = convert(src, tmp_path / "out", log=logs.append)
    assert not (tmp_path / "out" / "notes.txt").exists()
    assert any("warning: notes.txt is a symlink" in m for m in logs)
    assert any("notes.txt" in w for w in summary.warnings)


def test_hub_cache_snapshot_given_as_a_local_folder(synth_ckpt, tmp_path):
    """A snapshot folder of the hub cache links its files into ../../blobs: inside the repo's cache folder."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for p in synth_ckpt("ct-mxfp8").iterdir():
        blob = repo / "blobs" / hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copyfile(p, blob)
        (snap / p.name).symlink_to(os.path.relpath(blob, snap))
    s = open_source(snap)
    assert s.base == repo.resolve() and s.tensor_names() and s.warnings == []
    assert {p.name for p in s.extra_files()} >= {"config.json"}


def test_org_name_that_is_neither_names_both_readings(tmp_path, monkeypatch):
    """`convert org/name ...` with no such folder and no cached repo: the
    message names the local reading and the hub reading (the cache path and
    the download command with the revision)."""
    cache = tmp_path / "hub-cache"
    _offline(monkeypatch, cache)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as ei:
        open_source("some-org/some-model", revision="v2")
    msg = str(ei.value)
    assert msg.startswith(f"some-org/some-model: no such local folder ({tmp_path / 'some-org' / 'some-model'}); "
                          "as a hub repo id: "), msg
    assert f"not in the hub cache at {cache}" in msg and "`hf download some-org/some-model --revision v2`" in msg


# ------------------------------------------------------------------ scatter reads


def _scatter(src, name: str, sizes: list[int]):
    """`read_into` the first sum(sizes) bytes of tensor `name` into views of those sizes."""
    path, pos, n = src.tensor_data_range(name)
    total = sum(sizes)
    assert total <= n
    buf = bytearray(total)
    views, off = [], 0
    for k in sizes:
        views.append(memoryview(buf)[off:off + k])
        off += k
    src.read_into(path, pos, views)
    with open(path, "rb") as f:
        f.seek(pos)
        return bytes(buf), f.read(total)


def test_read_into_many_views_and_short_reads(synth_ckpt, monkeypatch):
    """More views than one preadv takes (IOV_MAX), and a kernel that returns
    short reads (ending inside a view, or exactly at a view's end): the views
    still get the file's bytes in order."""
    import megamoe_convert.readers.source as source_mod

    src = open_source(synth_ckpt("bf16"))
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"  # 64 KiB
    got, want = _scatter(src, name, [7, 1, 64] * 400)  # 1200 views > IOV_MAX (1024)
    assert got == want
    real = os.preadv
    for cap in (100, 72, 5):  # 72: short reads that end exactly at view ends

        def short(fd, views, pos, cap=cap):
            return real(fd, [memoryview(views[0])[:cap]], pos) if len(views[0]) > cap else real(fd, views[:1], pos)

        monkeypatch.setattr(source_mod.os, "preadv", short)
        got, want = _scatter(src, name, [50, 22, 300, 1, 999])
        assert got == want
    monkeypatch.undo()


def test_read_into_past_the_end_fails(synth_ckpt):
    """Negative: views longer than what is left in the file raise, naming the file."""
    src = open_source(synth_ckpt("bf16"))
    path = src.files()[-1]
    size = path.stat().st_size
    with pytest.raises(CheckpointError, match="unexpected end of file"):
        src.read_into(path, size - 10, [memoryview(bytearray(8)), memoryview(bytearray(8))])


# ------------------------------------------------------------------ non-regular files, oversized headers


@pytest.mark.parametrize("indexed", [False, True])
def test_a_fifo_shard_is_named_for_what_it_is_and_never_opened(make_ckpt, indexed):
    """A FIFO where a shard should be: refused saying it is a FIFO (it read as "no *.safetensors files", or
    with an index as "names shard(s) missing" though it exists), and never opened (a read would block:
    nobody writes to it, so this test would hang)."""
    from click.testing import CliRunner

    from megamoe_convert.cli.main import main

    p = make_ckpt("bf16", **({"max_shard_bytes": 150_000} if indexed else {}))
    victim = sorted(p.glob("model*.safetensors"))[-1]
    victim.unlink()
    os.mkfifo(victim)
    with pytest.raises(CheckpointError, match=rf"{victim} is a FIFO \(named pipe\), not a regular file"):
        open_source(p)
    with pytest.raises(CheckpointError, match=r"is a FIFO \(named pipe\), not a regular file"):
        read_safetensors_header(victim)
    for args in (["inspect", p], ["convert", p, p.parent / "out"]):
        r = CliRunner().invoke(main, [str(a) for a in args])
        assert r.exit_code == 2 and "is a FIFO (named pipe)" in r.stderr, r.output
    assert not (p.parent / "out").exists()


def test_a_header_listing_too_many_tensors_is_refused_before_it_is_parsed(make_ckpt, monkeypatch):
    """A source header listing more tensors than megamoe's limit (a 91 MB header of 1.3 M entries ran convert
    4 min at 10 GB before failing on the manifest's size, naming no file): refused at the header, naming the
    file, from a count of the raw bytes, before the JSON is parsed (with the limit lowered here, so the
    header stays small)."""
    from click.testing import CliRunner

    from megamoe_convert.cli.main import main
    from megamoe_runtime.files import limits, safetensors_header

    p = make_ckpt("bf16")
    shard = p / "model.safetensors"
    n = len(read_safetensors_header(shard).tensors)
    monkeypatch.setitem(limits.LIMITS, "header_tensors", n - 1)
    parsed = []
    real = safetensors_header.parse_json
    monkeypatch.setattr(safetensors_header, "parse_json", lambda *a, **k: parsed.append(1) or real(*a, **k))
    with pytest.raises(CheckpointError, match=rf"{shard}: tensors listed in its safetensors header = {n} "
                                              rf"exceeds megamoe's limit of {n - 1}"):
        read_safetensors_header(shard)
    for args in (["inspect", p], ["convert", p, p.parent / "out"]):
        r = CliRunner().invoke(main, [str(a) for a in args])
        assert r.exit_code == 2 and f"{shard}: tensors listed in its safetensors header" in r.stderr, r.output
    assert not parsed and not (p.parent / "out").exists()
    monkeypatch.setitem(limits.LIMITS, "header_tensors", n)  # at the limit: read
    assert len(read_safetensors_header(shard).tensors) == n and parsed
