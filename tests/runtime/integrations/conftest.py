"""Shared builders for the engine-integration tests: tiny REAL transformers models and their conversions.

Every model is a real transformers architecture with random weights, built from a config with a fixed seed
and written by ``save_pretrained`` (what a user's checkpoint is); quantized ones are the committed real
producer exports in tests/fixtures/real/. Conversions go through the converter's public API.
"""
from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from megamoe_convert.pipeline.convert import convert  # noqa: E402

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "real"

from megamoe_runtime.integrations.transformers.tiny import ARCHS, save_tiny_model  # noqa: E402


def pytest_generate_tests(metafunc):
    """A test taking ``arch`` runs once per architecture the integration covers."""
    if "arch" in metafunc.fixturenames:
        metafunc.parametrize("arch", ARCHS)


@pytest.fixture(scope="session")
def real_fixtures() -> Path:
    return REAL


@pytest.fixture(scope="session")
def converted_tiny(tmp_path_factory):
    """arch -> (source folder, converted folder), built once per session."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in made:
            root = tmp_path_factory.mktemp(f"tiny-{arch}")
            src = save_tiny_model(arch, root / "src")
            convert(src, root / "out")
            made[arch] = (src, root / "out")
        return made[arch]

    return get


@pytest.fixture(scope="session")
def converted_real(tmp_path_factory):
    """fixture name -> converted folder of a committed real producer export, built once per session."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp(f"real-{name}") / "out"
            convert(REAL / name, out)
            made[name] = out
        return made[name]

    return get
