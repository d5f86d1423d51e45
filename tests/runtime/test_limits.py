"""Stated limits (megamoe_runtime.files.limits): a size beyond one is refused before anything is allocated from it,
as a MegaMoEError naming where it came from, in bounded time and memory."""
from __future__ import annotations

import json

import pytest

from megamoe_runtime.errors import LayerSpecError, ManifestError
from megamoe_runtime.files.limits import LIMITS, MAX_EXPERTS, MAX_HIDDEN, MAX_TOP_K, check_limit
from megamoe_runtime.format.formats import LayerSpec, SharedSpec
from megamoe_runtime.format.manifest import MANIFEST_NAME, read_manifest, with_self_digest


def test_table_is_stated_and_enforced():
    assert set(LIMITS) >= {"num_experts", "hidden", "intermediate", "num_layers", "top_k", "header_bytes",
                           "json_bytes", "json_depth", "int_digits"}
    check_limit("num_experts", MAX_EXPERTS, "x")  # at the limit: fine
    with pytest.raises(ManifestError, match=r"where: num_experts = 16385 exceeds megamoe.s limit of 16384 for num_experts"):
        check_limit("num_experts", MAX_EXPERTS + 1, "where", ManifestError)


@pytest.mark.parametrize("field,value", [("num_experts", 10**9), ("num_experts", 10**400), ("hidden", MAX_HIDDEN * 2),
                                         ("intermediate", 10**9), ("top_k", MAX_TOP_K + 1), ("ep_size", 10**9)])
def test_layer_spec_limits(field, value):
    kw = dict(row="mxfp4", hidden=256, intermediate=128, num_experts=8, top_k=2)
    kw[field] = value
    with pytest.raises(LayerSpecError, match=f"layer spec: {field} = .* exceeds megamoe's limit"):
        LayerSpec(**kw)


def test_shared_limits():
    with pytest.raises(LayerSpecError, match="shared expert: .* exceeds megamoe's limit"):
        SharedSpec("mxfp8", 10**6, 128)


def test_manifest_claiming_1e9_experts_refused_bounded(ckpts, tmp_path, bounded_python):
    """The issue's case: verify --reload-dry-run on a manifest claiming 10**9 experts grew to 19 GB. Now both
    read_manifest and the CLI refuse it under a 1.4 GiB address-space cap, naming the manifest."""
    import shutil

    _, out = ckpts.converted("quark-mxfp4")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    d = json.loads((bad / MANIFEST_NAME).read_text())
    for le in d["layers"]:
        le["spec"]["num_experts"] = 10**9
    for t in d["tensors"].values():
        if t["experts"] is not None:
            t["experts"] = [0, 10**9]
    (bad / MANIFEST_NAME).write_text(json.dumps(with_self_digest(d)))
    with pytest.raises(ManifestError, match="megamoe.json.*num_experts = 1000000000 exceeds"):
        read_manifest(bad)
    code = ("import sys\nfrom megamoe_convert.cli.main import main\n"
            f"sys.argv = ['megamoe-convert', 'verify', {str(bad)!r}, '--reload-dry-run']\nmain()\n")
    r = bounded_python(code, timeout_s=60)
    assert r.returncode == 1, r.stderr[-2000:]  # verify's documented "verification failed"
    assert "megamoe.json" in r.stdout and "exceeds megamoe's limit" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("name", ["config.json", MANIFEST_NAME])
@pytest.mark.parametrize("payload", ["nested", "digits"])
def test_hostile_json_files_refused_naming_the_file(ckpts, tmp_path, name, payload):
    """Deep nesting or a 5000-digit integer in config.json (convert: exit 2, bad input) or megamoe.json (verify:
    exit 1, verification failed): the file named, no traceback."""
    import shutil

    from click.testing import CliRunner

    from megamoe_convert.cli.main import main

    src, out = ckpts.converted("quark-mxfp4")
    folder = tmp_path / "f"
    shutil.copytree(src if name == "config.json" else out, folder)
    text = "[" * 100_000 + "]" * 100_000 if payload == "nested" else '{"format": ' + "9" * 5000 + "}"
    (folder / name).write_text(text)
    args = ["convert", str(folder), str(tmp_path / "o")] if name == "config.json" else ["verify", str(folder)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == (2 if name == "config.json" else 1), (r.output, r.exception)
    said = r.stderr if name == "config.json" else r.stdout
    assert str(folder / name) in said and ("levels deep" in said or "5000 digits" in said), said
    assert not (tmp_path / "o").exists()


def test_convert_of_a_config_claiming_1e9_experts_refused_bounded(make_ckpt, tmp_path, bounded_python):
    """The issue's case: convert of a config with num_experts = 10**9 grew past 6 GB. Now exit 2 under a 1.4 GiB
    cap, naming config.json, nothing written."""
    src = make_ckpt("quark-mxfp4", num_layers=2, hidden=256, intermediate=128, num_experts=8, top_k=2)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_experts"] = 10**9
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "o"
    code = ("import sys\nfrom megamoe_convert.cli.main import main\n"
            f"sys.argv = ['megamoe-convert', 'convert', {str(src)!r}, {str(out)!r}]\nmain()\n")
    r = bounded_python(code, timeout_s=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{src / 'config.json'}: num_experts = 1000000000 exceeds megamoe's limit" in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.parametrize("name", ["config.json", MANIFEST_NAME])
@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e400"])
def test_non_finite_json_numbers_refused_naming_the_file(ckpts, tmp_path, name, number):
    """NaN / Infinity (which Python's json writes by default) or a float that overflows, in config.json
    (convert: exit 2, nothing left beside OUT) or megamoe.json (verify: exit 1; open_checkpoint: ManifestError):
    were a ValueError traceback from the strict JSON writer or the self-digest."""
    import re
    import shutil

    from click.testing import CliRunner

    from megamoe_convert.cli.main import main
    from megamoe_runtime import open_checkpoint

    src, out = ckpts.converted("quark-mxfp4")
    folder = tmp_path / "f"
    shutil.copytree(src if name == "config.json" else out, folder)
    key = "rms_norm_eps" if name == "config.json" else "routed_scaling_factor"
    text, n = re.subn(rf'("{key}": )[^,}}\n]+', rf"\g<1>{number}", (folder / name).read_text(), count=1)
    assert n == 1
    (folder / name).write_text(text)
    args = ["convert", str(folder), str(tmp_path / "o")] if name == "config.json" else ["verify", str(folder)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == (2 if name == "config.json" else 1), (r.output, r.exception)
    said = r.stderr if name == "config.json" else r.stdout
    assert str(folder / name) in said and f"non-finite number {number}" in said, said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    if name == MANIFEST_NAME:
        with pytest.raises(ManifestError, match="non-finite number"):
            open_checkpoint(folder)
