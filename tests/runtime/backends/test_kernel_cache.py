"""The kernel cache folder's contract (megamoe_runtime/backends/kernel_cache.py): what a cache is, when it is
taken, and that seeding triton's cache only ever adds files. Plain files stand in for triton's entries: the
module never reads what is inside them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megamoe_runtime.backends import kernel_cache as kc

ENV = {"triton": "3.6.0", "torch": "2.11.0", "cuda": "13.0", "python": "3.12", "machine": "x86_64",
       "capability": "sm_90", "gpu": "NVIDIA H100 80GB HBM3"}


def make_cache(root: Path, keys=("k1", "k2"), env=ENV, old_groups: bool = False) -> Path:
    for k in keys:
        d = root / kc.ENTRIES_DIR / k
        d.mkdir(parents=True)
        (d / "kern.cubin").write_bytes(b"cubin-" + k.encode())
        (d / "kern.json").write_text(json.dumps({"name": "kern", "key": k}))
        child = ({"kern.cubin": f"/elsewhere/{k}/kern.cubin", "kern.json": f"/elsewhere/{k}/kern.json"}
                 if old_groups else ["kern.cubin", "kern.json"])
        (d / "__grp__kern.json").write_text(json.dumps({"child_paths": child}))
    kc.write_manifest(root, env, tokens=[1, 8])
    return root


def test_manifest_roundtrip(tmp_path):
    c = make_cache(tmp_path / "c")
    m = kc.read_manifest(c)
    assert m["format"] == kc.FORMAT_VERSION and m["entries"] == 2 and m["tokens"] == [1, 8]
    assert {k: m[k] for k in kc.MATCH_KEYS} == {k: ENV[k] for k in kc.MATCH_KEYS}
    assert not list(c.glob(".*tmp*"))  # the manifest's temporary file is gone


def test_seed_copies_everything_once(tmp_path):
    c = make_cache(tmp_path / "c")
    t = tmp_path / "triton"
    rep = kc.seed(c, t, env=ENV)
    assert rep.skipped is None and not rep.errors
    assert (rep.new_entries, rep.copied_files) == (2, 6)
    for k in ("k1", "k2"):
        for f in ("kern.cubin", "kern.json", "__grp__kern.json"):
            assert (t / k / f).read_bytes() == (c / kc.ENTRIES_DIR / k / f).read_bytes()
    assert not [p for p in t.rglob(".*")]  # no temporary copies left behind
    again = kc.seed(c, t, env=ENV)
    assert (again.new_entries, again.present_entries, again.copied_files) == (0, 2, 0)


def test_seed_never_replaces_a_file(tmp_path):
    c = make_cache(tmp_path / "c")
    t = tmp_path / "triton"
    (t / "k1").mkdir(parents=True)
    (t / "k1" / "kern.cubin").write_bytes(b"compiled here")
    rep = kc.seed(c, t, env=ENV)
    assert (t / "k1" / "kern.cubin").read_bytes() == b"compiled here"  # the process's own file stays
    assert (t / "k1" / "kern.json").is_file() and (t / "k1" / "__grp__kern.json").is_file()  # the rest added
    assert (rep.new_entries, rep.present_entries, rep.copied_files) == (1, 1, 5)


@pytest.mark.parametrize("key,value", [("triton", "3.5.1"), ("capability", "sm_100"), ("python", "3.11"),
                                       ("capability", None)])
def test_seed_skips_a_cache_built_elsewhere(tmp_path, key, value):
    c = make_cache(tmp_path / "c")
    t = tmp_path / "triton"
    rep = kc.seed(c, t, env={**ENV, key: value})
    assert rep.skipped and key in rep.skipped and "compile at first use" in rep.skipped
    assert rep.copied_files == 0 and not t.exists()


def test_other_fields_do_not_matter(tmp_path):
    # a cache built on an H100 serves an H200 (same sm_90), other torch builds too: triton's keys decide
    c = make_cache(tmp_path / "c")
    rep = kc.seed(c, tmp_path / "t", env={**ENV, "gpu": "NVIDIA H200", "torch": "2.12.0"})
    assert rep.skipped is None and rep.new_entries == 2


def test_old_style_groups_point_at_the_copies(tmp_path):
    c = make_cache(tmp_path / "c", old_groups=True)
    t = tmp_path / "t"
    kc.seed(c, t, env=ENV)
    child = json.loads((t / "k1" / "__grp__kern.json").read_text())["child_paths"]
    assert child == {"kern.cubin": str(t / "k1" / "kern.cubin"), "kern.json": str(t / "k1" / "kern.json")}
    # the shipped cache itself is left as it was
    assert "/elsewhere/" in (c / kc.ENTRIES_DIR / "k1" / "__grp__kern.json").read_text()


def test_group_file_goes_last():
    names = [Path(n) for n in ("__grp__a.json", "a.cubin", "a.json", "__grp__b.json")]
    order = [p.name for p in kc._group_first_last(names)]
    assert order[-2:] == ["__grp__a.json", "__grp__b.json"] and order[:2] == ["a.cubin", "a.json"]


def test_refusals(tmp_path):
    with pytest.raises(kc.KernelCacheError, match="no such kernel cache folder"):
        kc.read_manifest(tmp_path / "absent")
    (tmp_path / "plain").mkdir()
    with pytest.raises(kc.KernelCacheError, match="not a megamoe kernel cache"):
        kc.read_manifest(tmp_path / "plain")
    c = make_cache(tmp_path / "c")
    (c / kc.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(kc.KernelCacheError, match="kernel cache manifest"):
        kc.read_manifest(c)
    c2 = make_cache(tmp_path / "c2")
    m = json.loads((c2 / kc.MANIFEST_NAME).read_text())
    (c2 / kc.MANIFEST_NAME).write_text(json.dumps({**m, "format": 99}))
    with pytest.raises(kc.KernelCacheError, match="format 99"):
        kc.read_manifest(c2)
    (c2 / kc.MANIFEST_NAME).write_text(json.dumps({k: v for k, v in m.items() if k != "triton"}))
    with pytest.raises(kc.KernelCacheError, match="lacks triton"):
        kc.read_manifest(c2)
    c3 = make_cache(tmp_path / "c3")
    for p in sorted((c3 / kc.ENTRIES_DIR).rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    (c3 / kc.ENTRIES_DIR).rmdir()
    with pytest.raises(kc.KernelCacheError, match="no triton/ folder"):
        kc.read_manifest(c3)


def test_triton_cache_dir_follows_triton_env(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        pytest.skip("triton installed: its own knobs answer")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "x"))
    assert kc.triton_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    assert kc.triton_cache_dir() == tmp_path / ".triton" / "cache"


def test_environment_on_this_machine():
    env = kc.environment()
    assert set(ENV) <= set(env) and env["python"].count(".") == 1


def test_foreign_entries_and_ownership(tmp_path):
    """A cache holds only the manifest (maybe a temporary one a killed write left) and triton's entry folders of
    plain files (maybe with triton's ``tmp.pid_*`` folder of a killed compile): `foreign_entries` names anything
    else, `not_own_reason` says why a folder is not provably a cache megamoe wrote (what `--overwrite` needs
    before it removes one with the output it was built for)."""
    c = make_cache(tmp_path / "c")
    (c / f".{kc.MANIFEST_NAME}.tmp.4242").write_text("{}")
    (c / kc.ENTRIES_DIR / "k1" / "tmp.pid_7_ab-cd").mkdir()
    (c / kc.ENTRIES_DIR / "k1" / "tmp.pid_7_ab-cd" / "kern.ptx").write_text("x")
    assert kc.foreign_entries(c) == [] and kc.not_own_reason(c) is None
    (c / "notes.txt").write_text("mine")
    (c / kc.ENTRIES_DIR / "loose.bin").write_bytes(b"x")
    (c / kc.ENTRIES_DIR / "k2" / "sub").mkdir()
    (c / kc.ENTRIES_DIR / "k1" / "tmp.pid_7_ab-cd" / "link").symlink_to(tmp_path)
    (c / f".{kc.MANIFEST_NAME}.tmp.x").write_text("{}")
    assert kc.foreign_entries(c) == [f".{kc.MANIFEST_NAME}.tmp.x", "notes.txt", "triton/k1/tmp.pid_7_ab-cd/link",
                                     "triton/k2/sub", "triton/loose.bin"]
    assert "neither megamoe-convert warm nor triton writes there: .megamoe" in kc.not_own_reason(c)
    assert "no megamoe-kernel-cache.json" in kc.not_own_reason(tmp_path)
    (tmp_path / "link").symlink_to(make_cache(tmp_path / "d"))
    assert kc.not_own_reason(tmp_path / "link").startswith("a symlink (to ")
