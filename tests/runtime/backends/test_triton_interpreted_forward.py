"""The triton backend's whole MX / NV forward against the reference backend, on CPU, under Triton's interpreter.

Why: the bitwise GPU tests (test_triton.py) are the proof of the kernels' numerics, but CI has no GPU, so a
change to an epilogue's rounding, a store or the K order could only be caught where a GPU runs. The
interpreter executes the same kernels (tiles, routing, tails, epilogues) on CPU. Its integer-path casts are
exact (``HW_CVT`` off), so the E2M1 rows are bit for bit the reference's, as on the GPU; the mxfp8 row's
E4M3 x bf16 partial sums are not always exact, so there only the fp32 order shows (docs/NUMERICS.md,
"triton backend: accumulation order"). The token counts reach every prefill tile choice of a small layer:
decode (16-row blocks), prefill64 (64-row blocks) and prefill (128-row blocks with tail launches; the
short-K nvfp4 L1 of ``configs.short_k_tiles``), and both forms of the L1's intermediate store (``l1.store32``).

Two cases run again on weights in the tiled arrangement (``format.weight_tiles``: rows in groups of 16, E2M1
bits of every word in the tiled order), which the kernels read here without the inline asm.

Negative controls, in the same interpreted process: the L1 storing the intermediate in the natural instead of
the frag K order (``_jit.frag_pos`` as the identity), the NVFP4 requantization rounding toward zero
(``_jit.e2m1_magnitude`` without its last step) and tiled words decoded in their stored bit order
(``_jit.e2m1_bits_moved`` as the identity) must all be caught.
"""
from __future__ import annotations

import json

import pytest
from interpreted import interpreted_output

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU CI without triton: the test skips
    triton = None

if triton is not None:
    @triton.jit
    def _natural_pos(c):
        """The planted layout error: the intermediate stored in the natural K order."""
        return c

    @triton.jit
    def _toward_zero(y, d):
        """The planted rounding error: the E2M1 magnitudes 0, 1, 2, 4 only, rounding down."""
        p2 = y >= d * 2.0
        p1 = y >= tl.where(p2, d * 4.0, d * 1.0)
        return tl.where(p2, 4, 0) | tl.where(p1, 2, 0)

    @triton.jit
    def _words_as_stored(wd, TO_TILED: tl.constexpr):
        """The planted error of tiled weights: their words decoded without undoing the tiled bit order."""
        return wd

#: (row, tokens) of a layer of H = I = 256, 4 experts, top-2: 6 tokens decode, 70 prefill64, 200 prefill
CASES = [(row, T) for row in ("nvfp4", "mxfp4", "mxfp8") for T in (6, 70, 200)]
#: (row, tokens) run again on weights in the tiled arrangement (rows by 16, E2M1 bits in the tiled order):
#: without the inline asm the kernels read them through ``_jit.e2m1_bits_moved``
TILED_CASES = [("mxfp4", 6), ("nvfp4", 70)]


def _forward(row: str, T: int, wt: int = 0) -> tuple:
    import torch

    from megamoe_runtime.backends.reference import ReferenceBackend
    from megamoe_runtime.backends.triton import moe, synth
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles
    from megamoe_runtime.format.formats import ActivationSpec, LayerSpec

    spec = LayerSpec(row, 256, 256, 4, 2, ActivationSpec("swiglu", clamp=10.0), routed_scaling_factor=2.5)
    lay = synth.random_layer(spec, device="cpu", seed=0, a2=4.0 / 2688)
    tw, ids = synth.random_routing(T, 4, 2, "cpu", seed=1, mask_frac=0.1, zero_tokens=1)
    x = torch.randn(T, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ref = ReferenceBackend().forward(lay, x, tw, ids)
    kt = _Roles(lay, "")
    if wt:
        from megamoe_runtime.format import weight_tiles

        kt.l1_weight = weight_tiles.tiled_copy(kt.l1_weight, wt)
        kt.l2_weight = weight_tiles.tiled_copy(kt.l2_weight, wt)
    out = moe.moe_forward(spec, kt, x, tw, ids, scalars=_NvScalars(lay) if row == "nvfp4" else None, w_tile=wt)
    return out, ref


def run_cases() -> dict:
    """{"row T": [fraction of output elements bitwise the reference's, calc_diff]}, and the controls'."""
    import torch

    from megamoe_runtime.backends.triton import _jit
    from megamoe_runtime.testing import calc_diff

    def measure(row, T, wt=0):
        out, ref = _forward(row, T, wt)
        return [float((out.view(torch.int16) == ref.view(torch.int16)).float().mean()), calc_diff(out, ref)]

    res = {f"{row} {T}": measure(row, T) for row, T in CASES}
    res.update({f"{row} {T} tiled": measure(row, T, 16) for row, T in TILED_CASES})

    for name, attr, fake, row, wt in (("natural order", "frag_pos", _natural_pos, "mxfp4", 0),
                                      ("toward zero", "e2m1_magnitude", _toward_zero, "nvfp4", 0),
                                      ("stored bit order", "e2m1_bits_moved", _words_as_stored, "mxfp4", 16)):
        saved = getattr(_jit, attr)
        setattr(_jit, attr, fake)
        try:
            res[f"control {name}"] = measure(row, 70, wt)
        finally:
            setattr(_jit, attr, saved)
    return res


def test_forward_matches_the_reference_under_the_interpreter():
    res = json.loads(interpreted_output(__file__, "json.dumps(m.run_cases())", timeout=900))
    for row, T, key in [(r, t, f"{r} {t}") for r, t in CASES] + [(r, t, f"{r} {t} tiled") for r, t in TILED_CASES]:
        bitwise, diff = res[key]
        if row == "mxfp8":  # E4M3 weights: the fp32 order of the partial sums can show in a last bit
            assert diff < 1e-8, f"{key}: calc_diff {diff:.2e} to the reference"
        else:
            assert bitwise == 1.0, f"{key}: {bitwise:.5f} of the output bitwise, calc_diff {diff:.2e}"
    for name in ("natural order", "toward zero", "stored bit order"):
        bitwise, diff = res[f"control {name}"]
        assert bitwise < 0.99 and diff > 1e-6, f"the planted {name} went unnoticed ({bitwise:.5f}, {diff:.2e})"
