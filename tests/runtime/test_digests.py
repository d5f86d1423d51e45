"""megamoe_runtime.files.digests: checksum algorithms, file digest kinds, and a machine without blake3.

The composed digests are checked against hashes computed here straight from
hashlib / the blake3 package over the file's byte ranges; a missing blake3 is
simulated by hiding the module (``sys.modules['blake3'] = None``).
"""
from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch

from megamoe_runtime.errors import DigestUnavailableError, ManifestError, MegaMoEError
from megamoe_runtime.files import digests as D

blake3 = pytest.importorskip("blake3")


def _ref(alg: str, data: bytes) -> bytes:
    return hashlib.sha256(data).digest() if alg == "sha256" else blake3.blake3(data).digest()


def _write_safetensors(path, tensors: dict[str, torch.Tensor]) -> bytes:
    from megamoe_convert.testing.synth import save_file

    save_file(tensors, str(path))
    return path.read_bytes()


@pytest.mark.parametrize("alg", ["sha256", "blake3"])
def test_digests_equal_the_libraries(tmp_path, alg):
    data = bytes(range(256)) * 40000  # 10 MB: blake3's multi-threaded path is taken with threads > 1
    assert D.digest_bytes(alg, data) == _ref(alg, data)
    assert D.digest_bytes(alg, memoryview(data), threads=4) == _ref(alg, data)  # a tree hash: same value
    p = tmp_path / "f.bin"
    p.write_bytes(data[:12345])
    assert D.hash_file(p, alg) == _ref(alg, data[:12345]).hex()
    assert D.file_digest(p, D.whole_kind(alg)) == _ref(alg, data[:12345]).hex()


@pytest.mark.parametrize("alg", ["sha256", "blake3"])
def test_header_and_tensor_digest_from_byte_ranges(tmp_path, alg):
    p = tmp_path / "t.safetensors"
    raw = _write_safetensors(p, {"b": torch.arange(10, dtype=torch.float32), "a": torch.ones(3, 5, dtype=torch.bfloat16),
                                 "e": torch.zeros(0, dtype=torch.int8)})
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in head.items() if k != "__metadata__")
    want = _ref(alg, raw[:8 + n] + b"".join(_ref(alg, raw[8 + n + b:8 + n + e]) for b, e, _ in spans)).hex()
    composite, tensors, whole = D.safetensors_digests(p, algorithm=alg, whole=True)
    assert composite == want and whole == _ref(alg, raw).hex()
    assert tensors == {k: _ref(alg, raw[8 + n + b:8 + n + e]).hex() for b, e, k in spans}
    assert D.file_digest(p, D.composite_kind(alg)) == want
    # negative control: one flipped data byte changes the tensor digest and the composite
    bad = bytearray(raw)
    bad[-1] ^= 1
    p.write_bytes(bytes(bad))
    assert D.file_digest(p, D.composite_kind(alg)) != want


def test_kinds_and_errors():
    assert D.kind_algorithm("blake3-of-header-and-tensor-digests") == "blake3"
    assert D.is_composite("sha256-of-header-and-tensor-digests") and not D.is_composite("blake3")
    with pytest.raises(ManifestError, match="unknown digest kind 'md5'"):
        D.kind_algorithm("md5")
    with pytest.raises(MegaMoEError, match="valid: sha256, blake3"):
        D.new_hasher("crc32")
    with pytest.raises(MegaMoEError, match="tensor digest must be 32 raw bytes"):
        D.header_and_tensor_digest(b"h", [(0, 1, "x", b"short")], "blake3")


def test_without_blake3_only_blake3_fails(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "blake3", None)  # import blake3 -> ImportError
    p = tmp_path / "f.bin"
    p.write_bytes(b"abc")
    assert D.hash_file(p, "sha256") == hashlib.sha256(b"abc").hexdigest()
    with pytest.raises(DigestUnavailableError, match=r"package 'blake3' is not installed.*--checksum sha256"):
        D.hash_file(p, "blake3")


def test_default_checksum_is_blake3_where_installed_else_sha256(monkeypatch):
    import importlib.util

    from megamoe_runtime.files import digests

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "blake3" else real(name, *a))
    assert digests._default_checksum() == "sha256"  # an install without the package still converts
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert digests._default_checksum() == ("blake3" if real("blake3") is not None else "sha256")
