"""Converter test settings. The checkpoint-building fixtures (``synth_ckpt``,
``make_ckpt``, ``ckpts``) are shared with the runtime tests: see
``tests/conftest.py``."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def _one_cpu_thread():
    """The tensors here are tiny: intra-op threads only add overhead (and
    contention when other suites run beside these)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


CRASHING_CLI = __import__("pathlib").Path(__file__).with_name("crashing_cli.py")
#: what a run killed by crashing_cli.py exits with
CRASH_EXIT_CODE = 99


@pytest.fixture
def crashing_run():
    """run(step, n, *cli_args, wait=True): `megamoe-convert *cli_args` in a real
    subprocess that dies (os._exit, like kill -9) at the n-th `step`
    (``output_dir.STEP_*``), or with n = "N:SECONDS" pauses there. With
    wait=False returns the Popen (stderr piped). `env`: variables added to the
    process's environment (``CRASHING_CLI_WRITE_DELAY``: slow writes)."""
    import os
    import subprocess
    import sys

    def run(step: str, n, *args, wait: bool = True, env: dict | None = None):
        cmd = [sys.executable, str(CRASHING_CLI), step, str(n), *map(str, args)]
        full_env = {**os.environ, **env} if env else None
        if not wait:
            return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=full_env)

    return run


class _PlantedStop(BaseException):
    """A planted stop (not an Exception: nothing catches it on the way out)."""


@pytest.fixture
def stopped_convert():
    """run(src, out, after, **convert_args): `convert` stopped at its `after`-th tensor in this process, leaving
    what an interrupted run leaves (the finished files journaled, the temp folder kept)."""
    from megamoe_convert.pipeline.convert import convert

    def run(src, out, after: int, **kwargs) -> None:
        seen = [0]

        def on_step(name):
            if name == "tensor":
                seen[0] += 1
                if seen[0] >= after:
                    raise _PlantedStop(name)

        with pytest.raises(_PlantedStop):
            convert(src, out, on_step=on_step, **kwargs)
    return run


@pytest.fixture
def edit_source():
    """edit(src, fn, name=None): rewrite the one safetensors file of a synthetic source (tests that plant bad
    input). Without `name`, ``fn(tensors)`` edits the dict of all its tensors in place; with it,
    ``tensors[name] = fn(a clone of tensors[name])``."""
    from safetensors.torch import load_file, save_file

    def edit(src, fn, name: str | None = None) -> None:
        files = sorted(src.glob("*.safetensors"))
        assert len(files) == 1, files
        t = load_file(files[0])
        if name is None:
            fn(t)
        else:
            t[name] = fn(t[name].clone())
        save_file(t, files[0], metadata={"format": "pt"})
    return edit


@pytest.fixture
def refused_convert():
    """run(src, out, *cli_args) -> the error line: ``megamoe-convert convert src out *cli_args`` must refuse
    bad input the way every refusal does -- exit code 2, one line starting ``error: `` -- and leave nothing
    under OUT (nor its temp folder)."""
    from click.testing import CliRunner

    from megamoe_convert.cli.main import main
    from megamoe_convert.output.output_dir import temp_dir_for

    def run(src, out, *args: str) -> str:
        r = CliRunner().invoke(main, ["convert", str(src), str(out), *args])
        err = r.stderr if hasattr(r, "stderr") else r.output
        assert r.exit_code == 2 and err.startswith("error: ") and err.count("\n") == 1, r.output
        assert not out.exists() and not temp_dir_for(out).exists()
        return err
    return run
