"""README.md runs as pasted: every shell and Python block, in order, in a fresh copy of the repository.

A user pastes the README top to bottom; so does this test, in a temporary copy of the working tree, with
CUDA hidden and the hub offline, through a ``megamoe-convert`` on PATH that runs the copy's own package.
Blocks the README marks ``<!-- not run: REASON -->`` are skipped, each with its reason (today: the
``pip install`` lines, which need the network; "your own model", which needs a hub model; the 2.1 GB
synthetic source, 3.5 minutes to build; ``vllm serve``, which needs vLLM and a GPU). Everything the
commands write must land under ``scratch/``, which .gitignore covers.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: a fenced block, with the "not run" marker that may stand on the line before it
_BLOCK = re.compile(r"(?:<!-- not run: (?P<why>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.S)
#: the folder every README output lands in (.gitignore'd)
SCRATCH = "scratch"


def readme_blocks(text: str) -> list[tuple[str, str, str | None]]:
    """(language, code, reason it is not run or None) for every fenced block, in order."""
    return [(m["lang"], m["code"], m["why"]) for m in _BLOCK.finditer(text)]


def _copy_repo(dst: Path) -> None:
    """The working tree as a fresh clone would have it: tracked and untracked-but-not-ignored files."""
    try:
        names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                               capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".git", "__pycache__", SCRATCH, "*.egg-info"))
        return
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_every_readme_block_runs_in_order_in_a_fresh_copy(tmp_path):
    blocks = readme_blocks(README.read_text())
    run = [(lang, code) for lang, code, why in blocks if why is None]
    skipped = [why for _, _, why in blocks if why is not None]
    assert sum(lang == "bash" for lang, _ in run) >= 3 and sum(lang == "python" for lang, _ in run) >= 2
    assert all(why.strip() for why in skipped)
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    _copy_repo(repo)
    bin_dir.mkdir()
    shim = bin_dir / "megamoe-convert"  # the console script, bound to the copy's package
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m megamoe_convert "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(repo),
           "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    before = _files(repo)
    hook = _start_up_hook()
    for i, (lang, code) in enumerate(run):
        if lang == "bash":
            cmd = ["bash", "-euo", "pipefail", "-c", code]
        elif lang == "python":
            cmd = [sys.executable, "-c", hook + code]
        else:
            continue
        t = time.perf_counter()
        r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        print(f"README block {i} ({lang}, {code.count(chr(10))} line(s)): {time.perf_counter() - t:.1f} s")
        assert r.returncode == 0, f"README block {i} ({lang}) failed with exit {r.returncode}:\n{code}\n" \
                                  f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    made = sorted(f for f in _files(repo) - before if not f.startswith(SCRATCH + "/"))
    assert made == [], f"README commands wrote outside {SCRATCH}/: {made[:10]}"
    assert (repo / SCRATCH / "demo" / "converted" / "megamoe.json").is_file()


def _start_up_hook() -> str:
    """What the installed megamoe-autoregister.pth runs at every interpreter start, for a Python block to run
    first where megamoe is used from PYTHONPATH without being installed: the README's transformers block
    relies on it (an installed megamoe, as in CI, runs the blocks exactly as pasted)."""
    from megamoe_runtime.integrations import autoregister

    return "" if autoregister.pth_file() else "import megamoe_runtime.integrations.autoregister\n"


def test_scratch_is_ignored_by_git():
    assert f"/{SCRATCH}/" in (ROOT / ".gitignore").read_text().split()


def test_readme_install_lines_are_the_runtimes_hint():
    """One way to add an extra, everywhere: the README's ``pip install -e '.[X]'`` is what
    `megamoe_runtime.errors.install_hint` tells a user (the triton backend, the demo without transformers),
    and every extra named exists."""
    from megamoe_runtime.errors import install_hint

    text = README.read_text()
    extras = set(re.findall(r"pip install -e '\.\[([a-z]+)\]'", text))
    assert {"transformers", "test", "vllm"} <= extras
    assert "megamoe[" not in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    for extra in extras:
        assert re.search(rf"^{extra} = \[", pyproject, re.M), extra
        assert install_hint(extra).startswith(f"pip install -e '.[{extra}]'")
    assert "EXTRA" in text and "pip install -e '.[EXTRA]'" in text


def test_a_failing_block_is_reported(tmp_path):
    """Negative control for the block parser: a marked block is skipped with its reason, others are kept."""
    text = "x\n<!-- not run: needs a GPU -->\n```bash\nfalse\n```\n\n```bash\ntrue\n```\n```python\nprint(1)\n```\n"
    assert readme_blocks(text) == [("bash", "false\n", "needs a GPU"), ("bash", "true\n", None),
                                   ("python", "print(1)\n", None)]
