"""CPU tests of the triton backend's per-expert fold flags (``moe.fold_flags``): which experts hold a
scale byte the fold decode cannot take, computed once per load instead of by every tile
(docs/KERNELS.md, "Fold flags"). The kernels' use of the flags is proven on the GPU
(``test_triton.py::test_fold_decode_bitwise``, ``test_layer_fold_flags_follow_reloads``)."""
from __future__ import annotations

import pytest
import torch

from megamoe_runtime.format.formats import ActivationSpec, LayerSpec

pytest.importorskip("triton")

#: per row: scale bytes the fold decode takes at the edge of its range, and bytes it cannot take
#: (UE8M0: scale * 2^126 (E4M3 weights: 2^120) must be a finite bf16; NVFP4: normal positive finite E4M3)
EDGES = {
    "mxfp4": ([1, 128], [129, 200, 255]),
    "mxfp8": ([1, 134], [135, 255]),
    "nvfp4": ([0x08, 0x7E], [0x00, 0x07, 0x7F, 0x80, 0xA8]),
}


def _layer(row: str, seed: int = 0):
    from megamoe_runtime.backends.triton import synth
    from megamoe_runtime.backends.triton.backend import _Roles

    spec = LayerSpec(row, 256, 128, 6, 2, ActivationSpec("swiglu"))
    lay = synth.random_kernel_bytes(spec, "cpu", seed=seed)
    return spec, lay, _Roles(lay, "")


def _expected(row: str, lay) -> torch.Tensor:
    """Independent of the physical scale layout: every byte of each expert's kernel-view scales
    ``[E_l, N, P]`` against the set of bytes the fold cannot take."""
    ok = set(range(0x08, 0x7F)) if row == "nvfp4" else set(range(0, EDGES[row][0][1] + 1))
    out = []
    for sf in (lay.l1_scale, lay.l2_scale):
        b = torch.empty(sf.shape, dtype=sf.dtype).copy_(sf).view(torch.uint8).reshape(sf.shape[0], -1)
        out.append([int(any(int(v) not in ok for v in torch.unique(b[e]))) for e in range(sf.shape[0])])
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("row", ["mxfp4", "mxfp8", "nvfp4"])
def test_fold_flags_mark_the_experts_with_bytes_the_fold_cannot_take(row):
    from megamoe_runtime.backends.triton import launch, moe, operands

    spec, lay, kt = _layer(row)
    flags = moe.fold_flags(spec, kt)
    assert flags.dtype == torch.int32 and tuple(flags.shape) == (2, 6)
    assert torch.equal(flags, _expected(row, lay)) and int(flags.sum()) == 0, "synthetic scales are in range"
    good, bad = EDGES[row]
    l1b = launch.scale_bytes(lay.l1_scale, "cpu")
    l2b = launch.scale_bytes(lay.l2_scale, "cpu")
    l1b[1, 0, 0] = good[0]  # edge bytes the fold takes: expert 1 stays FOLD_OK
    l2b[1, -1, -1] = good[-1]
    for i, v in enumerate(bad):  # one byte per expert 2.. (L1) and the last experts (L2)
        l1b[2 + i % 4, i % l1b.shape[1], (7 * i) % l1b.shape[2]] = v
    l2b[5, l2b.shape[1] - 1, 3] = bad[0]
    want = _expected(row, lay)
    assert want[0, 1] == 0 and want[1, 1] == 0 and want[0, 2] == 1 and want[1, 5] == 1  # the test plants what it means
    keep = flags.data_ptr()
    got = moe.fold_flags(spec, kt, out=flags)
    assert got.data_ptr() == keep, "flags are rewritten in place (a captured graph reads that storage)"
    assert torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"
    assert operands.FOLD_REDO == 1 and operands.FOLD_OK == 0


def test_fold_flags_refuse_a_wrong_output_buffer():
    from megamoe_runtime.backends.triton import moe
    from megamoe_runtime.errors import MegaMoEError

    spec, _, kt = _layer("mxfp4")
    with pytest.raises(MegaMoEError, match=r"int32 \[2, 6\]"):
        moe.fold_flags(spec, kt, out=torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(MegaMoEError, match="int32"):
        moe.fold_flags(spec, kt, out=torch.zeros(2, 6, dtype=torch.int64))


def test_bf16_rows_have_no_fold():
    from megamoe_runtime.backends.triton import moe

    spec, _, kt = _layer("bf16")
    assert int(moe.fold_flags(spec, kt).abs().sum()) == 0


@pytest.mark.parametrize("bad", ["int64", "short", "transposed"])
def test_forward_refuses_fold_flags_it_cannot_index(bad):
    """Flags a kernel would read out of bounds or misread are refused before any launch (the check needs no
    GPU: it runs before the first kernel)."""
    from megamoe_runtime.backends.triton import moe
    from megamoe_runtime.errors import MegaMoEError

    spec, _, kt = _layer("mxfp4")
    ok = moe.fold_flags(spec, kt)
    flags = {"int64": ok.to(torch.int64), "short": ok[:, :5], "transposed": ok.t().contiguous().t()}[bad]
    x = torch.zeros(3, spec.hidden, dtype=torch.bfloat16)
    tw = torch.ones(3, spec.top_k)
    ids = torch.zeros(3, spec.top_k, dtype=torch.int64)
    ids[:, 1] = 1
    with pytest.raises(MegaMoEError, match="fold_flags must be int32"):
        moe.moe_forward(spec, kt, x, tw, ids, fold_flags=flags)
