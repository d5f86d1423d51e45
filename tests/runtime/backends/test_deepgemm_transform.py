"""megamoe's kernel bytes equal what the installed DeepGEMM's own transforms make.

``transform_weights_for_mega_moe`` (SM100) and ``transform_weights_for_mega_moe_sm90`` are plain
torch in the package's Python; their module imports the compiled extension, so this test executes
the source with a stand-in for the extension (nothing of it is called). The source is the installed
``deep_gemm`` (found without importing it) or an unpacked wheel named by ``MEGAMOE_DG_SOURCE``
(the folder holding ``deep_gemm/``); without either the tests skip. For each row megamoe writes
(mxfp4, mxfp8, nvfp4, bf16) the packed stack must equal the package's transform of the canonical
weights, for every layout flavour the build offers that megamoe claims (docs/KERNELS.md#sm90-layout-flavours);
the packed-FP4 flavour of 0.1.7+ must differ (a folder of one is not a folder of the other).
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

from megamoe_runtime.format import codecs
from megamoe_runtime.format.canonical import ExpertTensors, ProjectionTensors
from megamoe_runtime.format.formats import get_row
from megamoe_runtime.format.layout import pack_expert_stack


def _package_dir() -> Path | None:
    env = os.environ.get("MEGAMOE_DG_SOURCE")
    if env:
        d = Path(env) / "deep_gemm"
        return d if (d / "mega" / "__init__.py").exists() else None
    try:
        spec = importlib.util.find_spec("deep_gemm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0])
    return d if (d / "mega" / "__init__.py").exists() else None


PKG = _package_dir()
pytestmark = pytest.mark.skipif(PKG is None, reason="no deep_gemm source (install sgl-deep-gemm or set "
                                                    "MEGAMOE_DG_SOURCE to an unpacked wheel)")


def _load_mega(pkg: Path) -> types.ModuleType:
    """``deep_gemm/mega/__init__.py`` executed under a throwaway package whose ``_C`` is a stub."""
    root = types.ModuleType("_dg_src")
    root.__path__ = []
    root._C = types.SimpleNamespace()
    utils = types.ModuleType("_dg_src.utils")
    utils.__path__ = []
    umath = types.ModuleType("_dg_src.utils.math")
    umath.align = lambda x, y: (x + y - 1) // y * y
    try:  # imported here, outside the patched sys.modules, so that restoring it does not unload them
        import torch.distributed  # noqa: F401
        import torch.distributed._symmetric_memory  # noqa: F401
    except Exception:  # noqa: BLE001 - the module under test tolerates their absence itself
        pass
    mods = {"_dg_src": root, "_dg_src._C": root._C, "_dg_src.utils": utils, "_dg_src.utils.math": umath}
    with mock.patch.dict(sys.modules, mods):
        spec = importlib.util.spec_from_file_location("_dg_src.mega", pkg / "mega" / "__init__.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


def _load_sm90_transform(pkg: Path):
    """``transform_weights_for_mega_moe_sm90`` from ``deep_gemm/__init__.py``: only that function's
    definition is executed (the module body builds and loads the extension)."""
    src = (pkg / "__init__.py").read_text()
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name == "transform_weights_for_mega_moe_sm90":
            ns: dict = {"torch": torch, "Tuple": tuple}
            exec(compile(ast.Module([node], []), str(pkg / "__init__.py"), "exec"), ns)  # noqa: S102
            return ns[node.name]
    return None


def _rand_proj(row, out, k, gen):
    w = row.weight
    b = torch.randint(0, 256, (out, k), dtype=torch.uint8, generator=gen)
    if w.element == "e2m1":
        weight = b[:, : k // 2].contiguous()
    elif w.element == "e4m3":
        weight = b.masked_fill((b & 0x7F) == 0x7F, 0x3C).view(torch.float8_e4m3fn)
    else:
        weight = torch.randn((out, k), generator=gen).bfloat16()
    scale = None
    if w.scale_encoding == "ue8m0":
        scale = torch.randint(100, 150, (out, k // 32), dtype=torch.uint8, generator=gen)
    elif w.scale_encoding == "e4m3":
        scale = torch.randint(1, 0x7F, (out, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    return ProjectionTensors(weight, scale)


def _experts(row, E, H, I, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [ExpertTensors(_rand_proj(row, I, H, gen), _rand_proj(row, I, H, gen), _rand_proj(row, H, I, gen))
            for _ in range(E)]


def _mn_major(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _canonical_stacks(row, experts):
    """DeepGEMM's transform inputs: L1 = [gate; up] rows, scales packed four bytes per int32, MN-major."""
    def w(p):
        return p.weight.view(torch.int8) if p.weight.dtype == torch.uint8 else p.weight

    l1w = torch.stack([torch.cat([w(e.gate), w(e.up)]) for e in experts])
    l2w = torch.stack([w(e.down) for e in experts])
    if not row.has_scales:
        return l1w, l2w
    l1s = _mn_major(torch.stack([torch.cat([codecs.pack_bytes_int32(e.gate.scale), codecs.pack_bytes_int32(e.up.scale)])
                                 for e in experts]))
    l2s = _mn_major(torch.stack([codecs.pack_bytes_int32(e.down.scale) for e in experts]))
    return (l1w, l1s), (l2w, l2s)


def _bytes(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Strides agree on every dim that has more than one element (the rest are never stepped)."""
    return a.shape == b.shape and all(x == y for n, x, y in zip(a.shape, a.stride(), b.stride()) if n > 1)


def _call(transform, l1, l2, mma_type):
    params = inspect.signature(transform).parameters
    kw = {}
    if "mma_type" in params and mma_type is not None:
        kw["mma_type"] = mma_type
    return transform(l1, l2, **kw)


#: megamoe row -> the mma_type names a build's transform may take for it with megamoe's layout
ROW_MMA = {"mxfp4": ("fp8xfp4",), "mxfp8": ("fp8xfp8",), "nvfp4": ("fp4xfp4",), "bf16": (None,)}


@pytest.mark.parametrize("row_name", ["mxfp4", "mxfp8", "nvfp4", "bf16"])
def test_sm100_transform_equals_megamoe_bytes(row_name):
    mega = _load_mega(PKG)
    row = get_row(row_name)
    if not row.has_scales and "isinstance(l1_weights, tuple)" not in inspect.getsource(
            mega.transform_weights_for_mega_moe):
        pytest.skip(f"{PKG}: this build transforms (weight, scale) pairs only (it has no bf16 mega kernel)")
    E, H, I = 2, 512, 256
    experts = _experts(row, E, H, I)
    kt = pack_expert_stack(row, experts)
    l1, l2 = _canonical_stacks(row, experts)
    for mma in ROW_MMA[row_name]:
        t1, t2 = _call(mega.transform_weights_for_mega_moe, l1, l2, mma)
        if not row.has_scales:
            assert torch.equal(_bytes(t1), _bytes(kt.l1_weight)) and torch.equal(_bytes(t2), _bytes(kt.l2_weight))
            continue
        assert torch.equal(_bytes(t1[0]), _bytes(kt.l1_weight)), (row_name, mma, "l1 weight")
        assert torch.equal(_bytes(t2[0]), _bytes(kt.l2_weight)), (row_name, mma, "l2 weight")
        assert torch.equal(t1[1], kt.l1_scale) and _same_strides(t1[1], kt.l1_scale), (row_name, mma, "l1 sf")
        assert torch.equal(t2[1], kt.l2_scale) and _same_strides(t2[1], kt.l2_scale), (row_name, mma, "l2 sf")


@pytest.mark.parametrize("row_name,mma", [("mxfp4", "mxf4xmxf4"), ("nvfp4", "nvfp4xnvfp4")])
def test_packed_fp4_flavour_is_another_layout(row_name, mma):
    """Builds from 0.1.7 interleave FP4 rows for these mma types in a way megamoe does not write:
    the same canonical weights give other bytes, which is why the manifest names its flavour."""
    mega = _load_mega(PKG)
    if "mma_type" not in inspect.signature(mega.transform_weights_for_mega_moe).parameters:
        pytest.skip(f"{PKG}: this build has one SM100 layout (no mma_type)")
    row = get_row(row_name)
    experts = _experts(row, 2, 256, 128)
    kt = pack_expert_stack(row, experts)
    (t1w, _), _ = _call(mega.transform_weights_for_mega_moe, *_canonical_stacks(row, experts), mma)
    assert not torch.equal(_bytes(t1w), _bytes(kt.l1_weight))


def test_sm90_transform_is_interleave8_of_weights_only():
    """SM90: the package interleaves the L1 weight rows by 8 and leaves both scales and L2 as the
    checkpoint has them; megamoe's interleave primitive makes the same bytes."""
    transform = _load_sm90_transform(PKG)
    if transform is None:
        pytest.skip(f"{PKG}: no transform_weights_for_mega_moe_sm90 (not an SGLang build)")
    row = get_row("mxfp8")  # E4M3 weights: the L1 weight rows are what the SM90 transform moves
    E, H, I = 2, 256, 256
    experts = _experts(row, E, H, I)
    kt = pack_expert_stack(row, experts)
    l1w = torch.stack([torch.cat([e.gate.weight, e.up.weight]) for e in experts])
    l2w = torch.stack([e.down.weight for e in experts])
    s1 = torch.rand(E, 2 * I // 128, H // 128) + 0.5
    s2 = torch.rand(E, H // 128, I // 128) + 0.5
    (t1w, t1s), (t2w, t2s) = transform((l1w, s1), (l2w, s2))
    assert torch.equal(_bytes(t1w), _bytes(kt.l1_weight))
    assert t1s is s1 and t2w is l2w and t2s is s2


#: the mma kind the package's kernel for a row runs (sgl-deep-gemm's NVFP4 kernel, from 0.1.7, runs only
#: 'nvfp4xnvfp4'; a transform without mma_type ignores it)
KERNEL_MMA = {"mxfp4": "fp8xfp4", "mxfp8": "fp8xfp8", "nvfp4": "nvfp4xnvfp4", "bf16": None}


def test_package_layouts_tell_the_flavour_the_package_transform_makes():
    """`deepgemm.package_layouts` on the package's own Python: a row it says the package reads in megamoe's
    SM100 flavour is one whose bytes the package's transform (with the kernel's mma kind) makes equal to
    megamoe's, and the other flavour is one whose bytes differ; the SM90 entry reads the SM90 flavour."""
    from megamoe_runtime.backends.deepgemm import package_layouts
    from megamoe_runtime.format.formats import LAYOUT_SM100, LAYOUT_SM90_BLOCK_FP8

    mega = _load_mega(PKG)
    names = ("fp8_fp4_mega_moe", "nvfp4_mega_moe", "bf16_mega_moe", "transform_weights_for_mega_moe",
             "NVFP4SymmBuffer")
    module = types.SimpleNamespace(__name__="_dg_src", **{n: getattr(mega, n) for n in names if hasattr(mega, n)})
    if _load_sm90_transform(PKG) is not None:  # the SM90 functions live in the top-level module
        module.fp8_mega_moe = lambda *a, **k: None
    layouts = package_layouts(module)
    assert (layouts.get("fp8_block", (None,))[0] == LAYOUT_SM90_BLOCK_FP8) == hasattr(module, "fp8_mega_moe")
    checked = 0
    for row_name in ("mxfp4", "mxfp8", "nvfp4", "bf16"):
        if row_name not in layouts:
            continue
        row = get_row(row_name)
        if not row.has_scales and "isinstance(l1_weights, tuple)" not in inspect.getsource(
                mega.transform_weights_for_mega_moe):
            continue
        experts = _experts(row, 2, 512, 256)
        kt = pack_expert_stack(row, experts)
        t1, _ = _call(mega.transform_weights_for_mega_moe, *_canonical_stacks(row, experts), KERNEL_MMA[row_name])
        same = torch.equal(_bytes(t1[0] if row.has_scales else t1), _bytes(kt.l1_weight))
        assert same == (layouts[row_name][0] == LAYOUT_SM100), (row_name, layouts[row_name])
        checked += 1
    assert checked
