"""The start-up hook: ``from_pretrained`` on a converted folder in a process that never imports megamoe.

Each load runs in a fresh interpreter (the registration happens once per process, at transformers' import),
and its logits are compared with this process's, loaded after the explicit
``import megamoe_runtime.integrations.transformers``: equal to the bit. Two ways into the hook:

* ``pth``: the child imports nothing of megamoe; only the installed ``megamoe-autoregister.pth`` can make the
  load work. It needs the package installed (``pip install -e .``, as CI does) and skips, saying so, where
  the package only runs from PYTHONPATH;
* ``hook``: the child imports the hook module, the one line the .pth runs, and nothing else of megamoe;
  this runs everywhere and also proves the integration's refusals (an edited config.json, a source export)
  in a process that never imported it.

Negative control: ``MEGAMOE_AUTOREGISTER=0`` makes the same child load random experts (transformers'
"Unknown quantization type" warning, logits off). The start-up tests run the .pth line through Python's own
`site` in a throw-away venv: a missing or broken package never fails ``python -c pass``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from megamoe_runtime.integrations import autoregister  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
REAL = REPO / "tests" / "fixtures" / "real"
PTH_SOURCE = REPO / "megamoe_runtime" / "integrations" / "autoregister.pth"
PTH_NAME = autoregister.PTH_NAME
SOURCE_EXPORT = REAL / "modelopt-nvfp4-qwen3moe"

#: the child: load a converted folder (and, given, an edited copy and a source export) and report
CHILD = r"""
import json, sys
mode, out, logits_path, edited, source = sys.argv[1:6]
report = {"hook_at_start": "megamoe_runtime.integrations.autoregister" in sys.modules}
if mode == "hook":
    import megamoe_runtime.integrations.autoregister  # the one line megamoe-autoregister.pth runs
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
with torch.no_grad():
    torch.save(model(ids).logits.float(), logits_path)
report["megamoe_blocks"] = sum(type(m).__name__ == "MegaMoEBlock" for m in model.modules())
for key, folder in (("edited", edited), ("source", source)):
    if folder:
        try:
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
            report[key] = "loaded"
        except Exception as e:
            report[key] = f"{type(e).__name__}: {e}"
print(json.dumps(report))
"""


def _env(**extra: str) -> dict:
    """The child's environment: this checkout first on the path (an installed .pth imports it), no knob."""
    env = {k: v for k, v in os.environ.items() if k != autoregister.KNOB}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def _child(mode: str, out: Path, tmp_path: Path, *, edited: Path | None = None, source: Path | None = None,
           **env: str) -> tuple[dict, torch.Tensor, str]:
    logits = tmp_path / f"logits-{mode}.pt"
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(out), str(logits), str(edited or ""),
                        str(source or "")], capture_output=True, text=True, env=_env(**env), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), torch.load(logits), r.stderr


@pytest.fixture(scope="module")
def reference(converted_tiny):
    """(converted folder, its logits loaded after the explicit import) -- the result the hook must give."""
    import megamoe_runtime.integrations.transformers  # noqa: F401

    _, out = converted_tiny("qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
    with torch.no_grad():
        return out, model(ids).logits.float()


def _edited(out: Path, tmp_path: Path) -> Path:
    """A copy of OUT whose config.json names another method (a megamoe folder must still be refused)."""
    bad = tmp_path / "edited"
    shutil.copytree(out, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "fp8"
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


def test_installed_pth_loads_the_converted_experts_without_any_import(reference, tmp_path):
    if autoregister.pth_file() is None:
        pytest.skip(f"{PTH_NAME} is not in this interpreter's site-packages (megamoe runs from PYTHONPATH, "
                    "not installed): `pip install -e .` installs it")
    out, want = reference
    report, logits, _ = _child("pth", out, tmp_path)
    assert report["hook_at_start"], f"{autoregister.pth_file()} did not run at start-up"
    assert report["megamoe_blocks"] > 0
    assert torch.equal(logits, want)


def test_hook_loads_the_converted_experts_and_keeps_the_refusals(reference, tmp_path):
    """The hook module alone: the converted experts, and the integration's one-line refusals of a megamoe
    folder whose config lost the method and of a source export (which names the converter)."""
    out, want = reference
    report, logits, _ = _child("hook", out, tmp_path, edited=_edited(out, tmp_path), source=SOURCE_EXPORT)
    assert report["megamoe_blocks"] > 0
    assert torch.equal(logits, want)
    assert report["edited"].startswith("CheckpointError: ") and "experts would be random" in report["edited"]
    assert f"megamoe-convert convert {SOURCE_EXPORT} OUT" in report["source"]
    assert "\n" not in report["edited"] + report["source"]


def test_knob_off_loads_random_experts(reference, tmp_path):
    """Negative control: with the registration turned off, the same child gets transformers' behaviour
    without megamoe -- the quantization skipped, experts randomly initialised, other logits."""
    out, want = reference
    mode = "pth" if autoregister.pth_file() is not None else "hook"
    report, logits, stderr = _child(mode, out, tmp_path, **{autoregister.KNOB: "0"})
    assert report["megamoe_blocks"] == 0
    assert "Unknown quantization type, got megamoe" in stderr
    assert not torch.equal(logits, want)


def _new_modules(statement: str) -> list[str]:
    """The modules ``statement`` imports in a fresh interpreter that has torch and transformers on its path
    but ran no .pth file (``-S``), this checkout first."""
    code = ("import json, site, sys\n"
            f"sys.path[:0] = [{str(REPO)!r}]; sys.path += site.getsitepackages()\n"
            "before = set(sys.modules)\n"
            f"{statement}\n"
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


#: what the hook may import at start-up besides its own package: nothing heavy
START_UP_STDLIB = {"__future__", "importlib", "warnings"}


def test_hook_module_imports_neither_torch_nor_transformers():
    new = _new_modules("import megamoe_runtime.integrations.autoregister as a; assert a.installed()")
    ours = {m for m in new if m.split(".")[0] == "megamoe_runtime"}
    assert ours == {"megamoe_runtime", "megamoe_runtime.integrations", "megamoe_runtime.integrations.autoregister"}
    others = {m for m in new if m not in ours and not m.startswith("importlib.")}  # importlib's own aliases
    assert others <= START_UP_STDLIB, sorted(others)


def test_the_import_check_sees_a_planted_import():
    """Negative control of the check above: a hook that imported typing (or torch) would be reported."""
    new = _new_modules("import megamoe_runtime.integrations.autoregister, typing")
    assert "typing" in set(new) - START_UP_STDLIB


@pytest.fixture()
def bare_venv(tmp_path):
    """A venv without pip whose site-packages holds megamoe-autoregister.pth, and its python."""
    root = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    sp = Path(subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                             capture_output=True, text=True, check=True).stdout.strip())
    shutil.copy(PTH_SOURCE, sp / PTH_NAME)
    return python, sp


def _start(python: Path, code: str = "pass") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", autoregister.KNOB)}
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_start_up_runs_the_hook_from_site_packages(bare_venv):
    """The .pth line, run by Python's own `site` at start-up, puts the finder first on sys.meta_path."""
    python, sp = bare_venv
    pkg = sp / "megamoe_runtime"
    (pkg / "integrations").mkdir(parents=True)
    for rel in ("__init__.py", "integrations/__init__.py", "integrations/autoregister.py"):
        shutil.copy(REPO / "megamoe_runtime" / rel, pkg / rel)
    r = _start(python, "import sys; print(type(sys.meta_path[0]).__name__, 'torch' in sys.modules)")
    assert (r.returncode, r.stdout.split(), r.stderr) == (0, ["_Finder", "False"], "")


def test_start_up_without_the_package_is_silent(bare_venv):
    """The package gone (an editable checkout moved away), the .pth left: nothing to do, nothing said."""
    python, _ = bare_venv
    r = _start(python)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


def test_start_up_with_a_broken_package_warns_in_one_line(bare_venv):
    """One line, once, although a venv's `site` may process its site-packages (and the .pth) twice."""
    python, sp = bare_venv
    (sp / "megamoe_runtime").mkdir()
    (sp / "megamoe_runtime" / "__init__.py").write_text("raise RuntimeError('planted')\n")
    r = _start(python)
    assert r.returncode == 0 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "megamoe start-up hook" in r.stderr and "planted" in r.stderr


def test_failed_registration_warns_and_transformers_still_loads(monkeypatch):
    """A registration that fails (here: a module that is not there) never raises into transformers' import:
    one warning naming the explicit import. The knob turned off skips it before any import."""
    import transformers.modeling_utils  # noqa: F401 -- imported: install() registers at once
    monkeypatch.setattr(autoregister, "INTEGRATION", "megamoe_runtime.integrations.no_such_module")
    with pytest.warns(RuntimeWarning, match="start-up hook: could not register .*ModuleNotFoundError"):
        autoregister.install()
    monkeypatch.setenv(autoregister.KNOB, "0")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autoregister.install()


def test_install_failing_at_start_up_only_warns(monkeypatch):
    """install() is what the .pth line runs: a meta path it cannot insert into gives a warning, never an
    exception (the interpreter start goes on)."""
    monkeypatch.delitem(sys.modules, autoregister.TARGET)
    monkeypatch.setattr(sys, "meta_path", tuple(f for f in sys.meta_path if f is not autoregister.installed()))
    with pytest.warns(RuntimeWarning, match="could not install its import finder"):
        autoregister.install()


def test_setup_installs_the_line_under_the_name_the_hook_knows():
    """setup.py cannot import the package it builds; its copy of the name and source path must agree."""
    text = (REPO / "setup.py").read_text()
    assert f'PTH_NAME = "{PTH_NAME}"' in text
    assert '"megamoe_runtime" / "integrations" / "autoregister.pth"' in text and PTH_SOURCE.is_file()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"megamoe_runtime.integrations" = ["autoregister.pth"]' in pyproject  # so an sdist carries it
