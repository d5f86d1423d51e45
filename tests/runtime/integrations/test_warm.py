"""megamoe_runtime/integrations/warm.py: building a folder's kernel cache (its refusals, the worker processes,
the new folder appearing only when complete) and finding / seeding the shipped cache. On the CPU the workers
run the reference backend, which compiles nothing: what is checked is the orchestration and the folder
contract; the triton entries themselves are built and timed on the GPU (bench/cold.sh, BENCHMARKS.md)."""
from __future__ import annotations

import json
import warnings

import pytest

from megamoe_runtime.backends import kernel_cache as kc
from megamoe_runtime.errors import ManifestError
from megamoe_runtime.integrations import warm

ENV = {"triton": "3.6.0", "torch": "2.11.0", "cuda": "13.0", "python": "3.12", "machine": "x86_64",
       "capability": "sm_90", "gpu": "NVIDIA H100 80GB HBM3"}


@pytest.fixture
def gpu_env(monkeypatch):
    """This process as if it had triton and an sm_90 GPU (what build_cache and seed check)."""
    monkeypatch.setattr(kc, "environment", lambda device=None: dict(ENV))
    return ENV


def test_parse_tokens():
    assert warm.parse_tokens("64, 1,8,8") == [1, 8, 64]
    for bad in ("", "0", "1,x", "-4", str(warm.MAX_TOKENS + 1)):
        with pytest.raises(kc.KernelCacheError):
            warm.parse_tokens(bad)
    assert warm.parse_tokens(",".join(map(str, warm.DEFAULT_TOKENS))) == list(warm.DEFAULT_TOKENS)


def test_distinct_layers(ckpts):
    from megamoe_runtime.load.checkpoint import open_checkpoint

    _, out = ckpts.converted("modelopt-mxfp4")
    ck = open_checkpoint(out)
    idx = warm.distinct_layers(ck)
    assert len(ck.layers) >= 2 and idx == [ck.layers[0].index]  # the synthetic layers share one spec
    specs = {li.index: li.spec for li in ck.layers}
    assert all(specs[i] == specs[idx[0]] for i in specs)


def test_build_cache_refusals(tmp_path, ckpts, monkeypatch):
    with pytest.raises(ManifestError):
        warm.build_cache(tmp_path / "not-converted", tmp_path / "c")
    _, out = ckpts.converted("modelopt-mxfp4")
    monkeypatch.setattr(kc, "environment", lambda device=None: {**ENV, "capability": None})
    with pytest.raises(kc.KernelCacheError, match="no CUDA device"):
        warm.build_cache(out, tmp_path / "c")
    monkeypatch.setattr(kc, "environment", lambda device=None: {**ENV, "triton": None})
    with pytest.raises(kc.KernelCacheError, match="triton is not installed"):
        warm.build_cache(out, tmp_path / "c")
    monkeypatch.setattr(kc, "environment", lambda device=None: dict(ENV))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(kc.KernelCacheError, match="not a megamoe kernel cache"):
        warm.build_cache(out, mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]  # a folder it did not make is left alone
    other = tmp_path / "other"
    other.mkdir()
    (other / kc.ENTRIES_DIR).mkdir()
    kc.write_manifest(other, {**ENV, "triton": "3.5.0"})
    before = (other / kc.MANIFEST_NAME).read_bytes()
    with pytest.raises(kc.KernelCacheError, match="3.5.0"):
        warm.build_cache(out, other)
    assert (other / kc.MANIFEST_NAME).read_bytes() == before
    with pytest.raises(kc.KernelCacheError, match="jobs=0"):
        warm.build_cache(out, tmp_path / "c", jobs=0)
    assert not (tmp_path / "c").exists() and not list(tmp_path.glob(".c.partial-*"))


def test_build_cache_refuses_an_expert_parallel_folder_before_any_worker(tmp_path, ckpts, gpu_env, monkeypatch):
    """An --ep-size 2 folder: before, each worker loaded its layer and failed ('warm worker failed: ... needs
    torch.distributed initialised ... or build with ep_size=1'); now one refusal, no worker started."""
    import subprocess

    _, out = ckpts.converted("modelopt-mxfp4", ep_size=2)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a worker was started"))
    with pytest.raises(kc.KernelCacheError, match="converted with --ep-size 2: warm runs single-process forwards"):
        warm.build_cache(out, tmp_path / "kc", tokens=[1], jobs=1, backend="reference", device="cpu")
    assert not list(tmp_path.iterdir())


def test_build_cache_workers_and_new_folder(tmp_path, ckpts, gpu_env):
    _, out = ckpts.converted("modelopt-mxfp4")
    cache = tmp_path / "kc"
    res = warm.build_cache(out, cache, tokens=[1, 3], jobs=2, backend="reference", device="cpu")
    assert res["ok"] and res["cache"] == str(cache) and res["jobs"] == 2 and res["tokens"] == [1, 3]
    m = kc.read_manifest(cache)
    assert {k: m[k] for k in kc.MATCH_KEYS} == {k: ENV[k] for k in kc.MATCH_KEYS}
    assert m["tokens"] == [1, 3] and [d["index"] for d in m["layers"]] == res["layers"]
    assert not list(tmp_path.glob(".kc.partial-*"))  # built beside, renamed into place
    # again into the same (compatible) cache: adds, keeps the folder
    res2 = warm.build_cache(out, cache, tokens=[2], jobs=1, backend="reference", device="cpu")
    assert res2["cache"] == str(cache) and kc.read_manifest(cache)["tokens"] == [1, 2, 3]


def test_adding_to_a_cache_keeps_listing_what_it_held(tmp_path, ckpts, gpu_env):
    """warm of a second folder into an existing cache adds entries and merged ``tokens``, but replaced ``layers``
    and ``model_folder`` with the second folder's: the manifest no longer said the cache held the first
    folder's kernels. Now ``layers`` (each with its folder) and ``model_folders`` are unions too."""
    _, a = ckpts.converted("modelopt-mxfp4")
    _, b = ckpts.converted("modelopt-nvfp4")  # another row: another layer spec
    cache = tmp_path / "kc"
    warm.build_cache(a, cache, tokens=[1], jobs=1, backend="reference", device="cpu")
    first = kc.read_manifest(cache)
    warm.build_cache(b, cache, tokens=[2], jobs=1, backend="reference", device="cpu")
    m = kc.read_manifest(cache)
    assert m["tokens"] == [1, 2] and {d["row"] for d in m["layers"]} == {"mxfp4", "nvfp4"}, m["layers"]
    assert first["model_folders"] == [a.name] and {d["model_folder"] for d in first["layers"]} == {a.name}
    assert m["model_folders"] == [a.name, b.name] and m["model_folder"] == b.name
    assert m["layers"][:len(first["layers"])] == first["layers"]
    assert {(d["model_folder"], d["row"]) for d in m["layers"]} == {(a.name, "mxfp4"), (b.name, "nvfp4")}
    # the same folder again lists nothing twice; a manifest of an earlier megamoe (no model_folders, layers
    # without their folder) gets its one model_folder on its layers
    assert warm._merged_contents(m, first["layers"], a.name) == (m["layers"], m["model_folders"])
    legacy = {"model_folder": "old", "layers": [{"index": 1, "row": "bf16"}]}
    assert warm._merged_contents(legacy, [{"model_folder": "new", "index": 1, "row": "bf16"}], "new") == (
        [{"model_folder": "old", "index": 1, "row": "bf16"}, {"model_folder": "new", "index": 1, "row": "bf16"}],
        ["old", "new"])


def test_build_cache_worker_failure_leaves_nothing(tmp_path, ckpts, gpu_env):
    _, out = ckpts.converted("modelopt-mxfp4")
    with pytest.raises(kc.KernelCacheError, match="warm worker failed"):
        warm.build_cache(out, tmp_path / "kc", tokens=[1], jobs=1, backend="no-such-backend", device="cpu")
    assert not list(tmp_path.iterdir())


def test_shipped_cache_lookup(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGAMOE_KERNEL_CACHE", raising=False)
    assert warm.shipped_cache(tmp_path) is None  # no kernel-cache folder
    (tmp_path / warm.CACHE_SUBDIR).mkdir()
    assert warm.shipped_cache(tmp_path) is None  # a folder without a manifest is no cache
    (tmp_path / warm.CACHE_SUBDIR / kc.MANIFEST_NAME).write_text("{}")
    assert warm.shipped_cache(tmp_path) == tmp_path / warm.CACHE_SUBDIR
    monkeypatch.setenv("MEGAMOE_KERNEL_CACHE", "off")
    assert warm.shipped_cache(tmp_path) is None
    monkeypatch.setenv("MEGAMOE_KERNEL_CACHE", str(tmp_path / "elsewhere"))
    assert warm.shipped_cache(tmp_path) == tmp_path / "elsewhere"
    monkeypatch.setenv("MEGAMOE_KERNEL_CACHE", "")
    assert warm.shipped_cache(tmp_path) == tmp_path / warm.CACHE_SUBDIR


def _cache_with_entry(root, env):
    (root / kc.ENTRIES_DIR / "key1").mkdir(parents=True)
    (root / kc.ENTRIES_DIR / "key1" / "k.cubin").write_bytes(b"x")
    kc.write_manifest(root, env)
    return root


def test_seed_for_folder(tmp_path, monkeypatch, gpu_env):
    import torch

    folder = tmp_path / "model"
    _cache_with_entry(folder / warm.CACHE_SUBDIR, ENV)
    triton_dir = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_dir))
    monkeypatch.setattr(kc, "triton_cache_dir", lambda: triton_dir)
    monkeypatch.delenv("MEGAMOE_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert warm.seed_for_folder(folder) is None and not triton_dir.exists()  # no GPU: nothing to seed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rep = warm.seed_for_folder(folder)
    assert rep.new_entries == 1 and (triton_dir / "key1" / "k.cubin").read_bytes() == b"x"


def test_seed_for_folder_never_stops_a_load(tmp_path, monkeypatch, gpu_env):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    triton_dir = tmp_path / "triton-cache"
    monkeypatch.setattr(kc, "triton_cache_dir", lambda: triton_dir)
    folder = tmp_path / "model"
    _cache_with_entry(folder / warm.CACHE_SUBDIR, {**ENV, "capability": "sm_100"})
    with pytest.warns(UserWarning, match="sm_100.*compile at first use"):
        rep = warm.seed_for_folder(folder)
    assert rep.skipped and not triton_dir.exists()
    monkeypatch.setenv("MEGAMOE_KERNEL_CACHE", str(tmp_path / "not-a-cache"))
    with pytest.warns(UserWarning, match="kernel cache not used"):
        assert warm.seed_for_folder(folder) is None
    monkeypatch.setenv("MEGAMOE_KERNEL_CACHE", "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warm.seed_for_folder(folder) is None


def test_worker_module_runs(tmp_path, ckpts):
    import subprocess
    import sys

    _, out = ckpts.converted("modelopt-mxfp4")
    r = subprocess.run([sys.executable, "-m", "megamoe_runtime.integrations.warm", "--worker", str(out), "--layers",
                        "1", "--tokens", "2", "--backend", "reference", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert list(json.loads(r.stdout.strip().splitlines()[-1])["layers_s"]) == ["1"]


@pytest.mark.gpu
def test_shipped_cache_leaves_nothing_to_compile(tmp_path, ckpts):
    """On the GPU: a process whose empty triton cache was seeded from a cache built for the same token counts
    compiles no kernel (its triton cache holds exactly the shipped entries afterwards); negative control: a
    token count the cache was not built for does compile."""
    import os
    import subprocess
    import sys

    _, out = ckpts.converted("modelopt-mxfp4")
    cache = tmp_path / "kc"
    res = warm.build_cache(out, cache, tokens=[1, 5], jobs=2)
    assert res["entries"] > 0
    shipped = {p.name for p in (cache / kc.ENTRIES_DIR).iterdir()}

    def fresh_run(tokens: str, tcache) -> set:
        code = (f"import os; from megamoe_runtime.integrations import warm; from megamoe_runtime.backends import "
                f"kernel_cache as kc; kc.seed({str(cache)!r}); "
                f"warm.run_layers({str(out)!r}, [{res['layers'][0]}], [{tokens}])")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "TRITON_CACHE_DIR": str(tcache)})
        assert r.returncode == 0, r.stderr[-2000:]
        return {p.name for p in tcache.iterdir() if p.is_dir()}

    assert fresh_run("1, 5", tmp_path / "t1") == shipped
    assert fresh_run("64", tmp_path / "t2") - shipped  # not in the cache: compiled at first use


def test_build_cache_never_takes_over_a_folder_it_did_not_make(tmp_path, ckpts, gpu_env):
    """A leftover ``.kc.partial-<pid>`` (a killed earlier build, whose pid a container's next process gets again;
    or anyone's folder of that name) is neither written into, renamed into the cache, nor deleted on failure,
    and it does not block the build."""
    import os

    _, out = ckpts.converted("modelopt-mxfp4")
    stale = tmp_path / f".kc.partial-{os.getpid()}"
    stale.mkdir()
    (stale / "notes.txt").write_text("keep")
    with pytest.raises(kc.KernelCacheError, match="warm worker failed"):
        warm.build_cache(out, tmp_path / "kc", tokens=[1], jobs=1, backend="no-such-backend", device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == [stale.name]
    assert [p.name for p in stale.iterdir()] == ["notes.txt"] and (stale / "notes.txt").read_text() == "keep"
    (stale / kc.ENTRIES_DIR).mkdir()  # what a killed build leaves: the next one still builds
    res = warm.build_cache(out, tmp_path / "kc", tokens=[1], jobs=1, backend="reference", device="cpu")
    assert res["ok"] and kc.read_manifest(tmp_path / "kc")["tokens"] == [1]
    assert sorted(p.name for p in stale.iterdir()) == sorted([kc.ENTRIES_DIR, "notes.txt"])
    assert not (tmp_path / "kc" / "notes.txt").exists()
    (tmp_path / "plain").mkdir()  # the cache a serving user reads gets a plain folder's permissions (not 0700)
    assert (tmp_path / "kc").stat().st_mode == (tmp_path / "plain").stat().st_mode


# --------------------------------------------------------------------------- a killed build's hidden folder


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


def _tree(root) -> dict:
    """relative path -> bytes of a file, the target of a link, or 'dir' (not following links)."""
    import os
    from pathlib import Path

    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d) / n
            rel = str(p.relative_to(root))
            out[rel] = ("link:" + os.readlink(p)) if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


def _plant_partial(parent, name: str, *, pid: int, cache: str = "kc", host: str | None = None,
                   fmt: str = "megamoe-kernel-cache-partial", marker: bool = True):
    """A hidden build folder as a build of cache `cache` killed mid-compile leaves it: its marker (who made it),
    triton's entries (an entry of plain files, a ``tmp.pid_*`` folder of a compile killed mid-write) and a
    temporary manifest; each argument changes one thing a look-alike may get wrong."""
    import socket

    path = parent / name
    entry = path / kc.ENTRIES_DIR / "K3Y"
    (entry / "tmp.pid_41_0c5e").mkdir(parents=True)
    for f in ("kern.cubin", "__grp__kern.json", "tmp.pid_41_0c5e/kern.ptx"):
        (entry / f).write_bytes(b"compiled")
    (path / f".{kc.MANIFEST_NAME}.tmp.{pid}").write_text("{}")
    if marker:
        (path / warm.PARTIAL_MARKER).write_text(json.dumps(
            {"format": fmt, "cache": cache, "pid": pid, "host": host or socket.gethostname(), "started": "then"}))
    return path


def test_build_removes_only_provably_abandoned_folders_of_its_own_builds(tmp_path, ckpts, gpu_env):
    """A build killed before it finished (``kill -9`` of warm) leaves its hidden ``.CACHE.partial-PID-TAG``
    folder; the next build of that cache removes it, under its lock, when it is provably one (the name a
    build gives it, its marker naming that pid) and provably abandoned (nobody holds the marker's flock, the
    pid is gone on this host), and holds nothing a build and triton do not write. Every look-alike stays,
    not a byte of it changed: no marker, a user's file in it, a marker of another pid, host or format, a
    live pid, a marker somebody holds, a symlink, another cache's folder, another name. Before, nothing ever
    removed a killed build's folder (and ``convert --overwrite`` refuses a folder holding one)."""
    import fcntl
    import os
    import socket

    _, out = ckpts.converted("modelopt-mxfp4")
    dead = _dead_pid()
    mine = _plant_partial(tmp_path, f".kc.partial-{dead}-0123abcd", pid=dead)
    keep = {
        "user's file": _plant_partial(tmp_path, f".kc.partial-{dead}-00000001", pid=dead),
        "no marker": _plant_partial(tmp_path, f".kc.partial-{dead}-00000002", pid=dead, marker=False),
        "another pid": _plant_partial(tmp_path, f".kc.partial-{dead}-00000003", pid=dead + 1),
        "another host": _plant_partial(tmp_path, f".kc.partial-{dead}-00000004", pid=dead, host="elsewhere"),
        "another format": _plant_partial(tmp_path, f".kc.partial-{dead}-00000005", pid=dead, fmt="mine"),
        "live pid": _plant_partial(tmp_path, f".kc.partial-{os.getpid()}-00000006", pid=os.getpid()),
        "held": _plant_partial(tmp_path, f".kc.partial-{dead}-00000007", pid=dead),
        "another cache": _plant_partial(tmp_path, f".kc2.partial-{dead}-00000008", pid=dead, cache="kc2"),
        "another name": _plant_partial(tmp_path, f".kc.partial-{dead}-ABCDEF01", pid=dead),
        "no tag": _plant_partial(tmp_path, f".kc.partial-{dead}", pid=dead),
        "marker link": _plant_partial(tmp_path, f".kc.partial-{dead}-00000009", pid=dead, marker=False),
        "link": tmp_path / f".kc.partial-{dead}-0000000a",
    }
    (keep["user's file"] / "notes.txt").write_text("mine")
    (keep["marker link"] / warm.PARTIAL_MARKER).symlink_to(mine / warm.PARTIAL_MARKER)
    elsewhere = _plant_partial(tmp_path / "elsewhere", f".kc.partial-{dead}-0000000b", pid=dead)
    keep["link"].symlink_to(elsewhere)
    before = {k: _tree(p) for k, p in keep.items() if not p.is_symlink()}
    before_elsewhere = _tree(elsewhere)
    held = os.open(keep["held"] / warm.PARTIAL_MARKER, os.O_RDWR)  # a killed build's worker still compiling
    fcntl.flock(held, fcntl.LOCK_EX)
    logs: list = []
    try:
        res = warm.build_cache(out, tmp_path / "kc", tokens=[1], jobs=1, backend="reference", device="cpu",
                               log=logs.append)
    finally:
        os.close(held)
    assert res["ok"] and not mine.exists()
    assert f"warm: removed {mine}, the unfinished folder of a build killed before it finished (pid {dead} on " \
           f"{socket.gethostname()}, started then)" in logs
    assert {k: _tree(p) for k, p in keep.items() if not p.is_symlink()} == before
    assert keep["link"].is_symlink() and _tree(elsewhere) == before_elsewhere
    notes = "\n".join(logs)
    for what, why in (("user's file", "it holds what neither a build nor triton writes there (notes.txt)"),
                      ("no marker", f"it has no {warm.PARTIAL_MARKER} of megamoe's"),
                      ("marker link", f"it has no {warm.PARTIAL_MARKER} of megamoe's"),
                      ("another pid", f"its {warm.PARTIAL_MARKER} is not the one a build of kc writes"),
                      ("another format", f"its {warm.PARTIAL_MARKER} is not the one a build of kc writes"),
                      ("another host", "it was made on host 'elsewhere'"),
                      ("live pid", f"pid {os.getpid()}, which made it, is running"),
                      ("held", "a running process holds it")):
        assert f"warm: note: {keep[what]} is left as it is: {why}" in notes, (what, notes)
    for quiet in ("another cache", "another name", "no tag", "link"):  # not named as a build's at all
        assert f"{keep[quiet]} is left" not in notes
    # what the build made is only the cache: no marker in it, no hidden folder of its own left
    assert kc.not_own_reason(tmp_path / "kc") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["kc", "elsewhere", *(p.name for p in keep.values())])


def test_a_file_appearing_in_a_partial_folder_while_it_is_removed_stays(tmp_path, gpu_env, monkeypatch):
    """Only what the folder held when it was judged is removed: a file that appears in it afterwards stays
    (the folder with it), and the build says so."""
    dead = _dead_pid()
    part = _plant_partial(tmp_path, f".kc.partial-{dead}-0123abcd", pid=dead)
    real = kc.foreign_entries

    def judged_then_written(path):
        got = real(path)
        (path / kc.ENTRIES_DIR / "K3Y" / "late.bin").write_bytes(b"late")  # after the listing
        return got

    monkeypatch.setattr(kc, "foreign_entries", judged_then_written)
    logs: list = []
    assert warm.remove_abandoned_partials(tmp_path / "kc", logs.append) == []
    # removed bottom up, up to the folder the new file is in: that folder and those above it stay, the folder
    # still marked as a build's (the next build judges it again)
    assert sorted(str(q.relative_to(part)) for q in part.rglob("*")) == sorted([
        f".{kc.MANIFEST_NAME}.tmp.{dead}", warm.PARTIAL_MARKER, kc.ENTRIES_DIR, f"{kc.ENTRIES_DIR}/K3Y",
        f"{kc.ENTRIES_DIR}/K3Y/late.bin"])
    assert logs == [f"warm: note: {part} is left partly removed: something appeared in it while it was removed"]
