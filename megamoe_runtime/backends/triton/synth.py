"""Random layers in kernel layout, for the triton tests and ``bench/kernel.py``.

``random_layer`` quantizes random fp32 experts with the reference quantizers
(``codecs``) and packs them with ``layout`` (the converter's code path), so
tests exercise real interleaved rows and UTCCP-permuted scales.
``random_kernel_bytes`` fills kernel-layout tensors with random valid bytes
directly (no quantization), for benchmark-sized layers.
Pure torch; no triton import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megamoe_runtime.format import codecs, layout
from megamoe_runtime.format.canonical import ExpertTensors, ProjectionTensors
from megamoe_runtime.format.formats import LayerSpec

__all__ = ["SynthLayer", "random_layer", "random_kernel_bytes", "random_routing"]


@dataclass
class SynthLayer:
    """What ``DeepGemmMegaMoEExperts`` exposes to a backend: ``spec`` plus role attributes."""

    spec: LayerSpec
    l1_weight: torch.Tensor
    l1_scale: Optional[torch.Tensor]
    l2_weight: torch.Tensor
    l2_scale: Optional[torch.Tensor]
    l1_alpha: Optional[torch.Tensor] = None
    l2_global_scale: Optional[torch.Tensor] = None
    l2_activation_scale: Optional[torch.Tensor] = None
    shared_l1_weight: Optional[torch.Tensor] = None
    shared_l1_scale: Optional[torch.Tensor] = None
    shared_l2_weight: Optional[torch.Tensor] = None
    shared_l2_scale: Optional[torch.Tensor] = None


def _proj(row: str, w: torch.Tensor) -> ProjectionTensors:
    return ProjectionTensors.quantize(row, w)


def _expert(row: str, H: int, I: int, gen: torch.Generator, std: float, device: Any = "cpu") -> ExpertTensors:
    # drawn on the CPU (reproducible), quantized where the layer lives (fast on a GPU)
    g, u, d = _expert_fp32(H, I, gen, std, device)
    return ExpertTensors(_proj(row, g), _proj(row, u), _proj(row, d))


def _block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[N, K]`` -> (E4M3 ``[N, K]``, fp32 scales ``[N/128, K/128]``): one multiplier per
    128x128 block, ``amax / 448``, as DeepSeek-V3's FP8 export stores ``weight_scale_inv``."""
    N, K = w.shape
    b = w.reshape(N // 128, 128, K // 128, 128)
    s = b.abs().amax(dim=(1, 3)).clamp(min=1e-4) / 448.0
    q = (b / s[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(N, K), s


def _block_fp8_layer(spec: LayerSpec, gen: torch.Generator, std: float, device: Any) -> SynthLayer:
    """The block-FP8 row: random experts quantized per 128x128 block, in the SM90 kernel layout
    (``layout.block_fp8_kernel_layout``: gate/up rows interleaved by 8, scales as they are)."""
    H, I = spec.hidden, spec.intermediate
    l1, l2 = [], []
    for _ in range(spec.experts_per_rank):
        e = _expert_fp32(H, I, gen, std, device)
        l1.append(_block_fp8(torch.cat(e[:2], dim=0)))
        l2.append(_block_fp8(e[2]))
    kt = layout.block_fp8_kernel_layout(tuple(torch.stack(t) for t in zip(*l1)),
                                        tuple(torch.stack(t) for t in zip(*l2)))
    return SynthLayer(spec, kt.l1_weight, kt.l1_scale, kt.l2_weight, kt.l2_scale)


def _expert_fp32(H: int, I: int, gen: torch.Generator, std: float, device: Any) -> tuple[torch.Tensor, ...]:
    # drawn on the CPU (reproducible), moved where the layer lives
    return tuple((torch.randn(*shape, generator=gen) * std).to(device) for shape in ((I, H), (I, H), (H, I)))


def random_layer(spec: LayerSpec, device: Any = "cpu", seed: int = 0, a2: Optional[float] = None) -> SynthLayer:
    """A random layer (this rank's experts; shared expert if ``spec.shared``)."""
    gen = torch.Generator().manual_seed(seed)
    H, I, E_l, row = spec.hidden, spec.intermediate, spec.experts_per_rank, spec.row
    std = H ** -0.5
    if spec.row_spec.weight.scale_encoding == "fp32":  # block-FP8 (no fused shared expert)
        return _block_fp8_layer(spec, gen, std, device)
    experts = [_expert(row, H, I, gen, std, device) for _ in range(E_l)]
    kt = layout.pack_expert_stack(row, experts, device=device)
    lay = SynthLayer(spec, kt.l1_weight, kt.l1_scale, kt.l2_weight, kt.l2_scale)
    if spec.row_spec.has_alphas:
        lay.l1_alpha = torch.tensor([[e.gate.global_scale, e.up.global_scale] for e in experts],
                                    dtype=torch.float32, device=device)
        lay.l2_global_scale = torch.tensor([e.down.global_scale for e in experts], dtype=torch.float32,
                                           device=device)
        lay.l2_activation_scale = torch.tensor(a2 if a2 is not None else 6.0 / 2688.0, dtype=torch.float32,
                                               device=device)
    if spec.shared is not None:
        prec = spec.shared.precision
        sh = [_expert(prec, H, spec.shared.intermediate, gen, std, device) for _ in range(spec.shared.num_shared)]
        skt = layout.pack_shared(prec, sh, device=device)
        lay.shared_l1_weight, lay.shared_l1_scale = skt.l1_weight, skt.l1_scale
        lay.shared_l2_weight, lay.shared_l2_scale = skt.l2_weight, skt.l2_scale
    return lay


def random_kernel_bytes(spec: LayerSpec, device: Any, seed: int = 0) -> SynthLayer:
    """Benchmark-sized layer: random bytes directly in kernel layout.

    E2M1 bytes uniform; E4M3 weights random finite bytes; UE8M0 scales in
    [118, 124] (2^-9..2^-3); NVFP4 E4M3 block scales in [0x28, 0x50] (finite,
    positive); bf16 weights N(0, 1/H). No quantization pass, so an
    8 GB layer builds in a second.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    H, I, E_l, row = spec.hidden, spec.intermediate, spec.experts_per_rank, spec.row
    if spec.row_spec.weight.scale_encoding == "fp32":  # block-FP8: fp32 block scales in [2^-12, 2^-8)
        kt = layout.KernelTensors(*(torch.empty(shape, dtype=dt, device=device) for shape, dt in (
            ((E_l, 2 * I, H), torch.float8_e4m3fn), ((E_l, 2 * I // 128, H // 128), torch.float32),
            ((E_l, H, I), torch.float8_e4m3fn), ((E_l, H // 128, I // 128), torch.float32))))
        for t in (kt.l1_scale, kt.l2_scale):
            t.uniform_(-12.0, -8.0, generator=g).exp2_()
    else:
        kt = layout.allocate_kernel_tensors(row, E_l, H, I, device)

    def fill_w(t: torch.Tensor) -> None:
        if t.dtype == torch.bfloat16:
            t.normal_(0.0, H ** -0.5, generator=g)
        elif t.dtype == torch.float8_e4m3fn:
            b = torch.randint(0, 0x77, t.shape, generator=g, device=device, dtype=torch.uint8)
            sign = torch.randint(0, 2, t.shape, generator=g, device=device, dtype=torch.uint8) << 7
            t.view(torch.uint8).copy_(b | sign)
        else:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, generator=g, device=device,
                                                    dtype=torch.uint8))

    def fill_s(t: Optional[torch.Tensor]) -> None:
        if t is None:
            return
        lo, hi = (118, 125) if spec.row_spec.weight.scale_encoding == "ue8m0" else (0x28, 0x51)
        phys = layout.physical(t)
        b = torch.randint(lo, hi, phys.shape + (4,), generator=g, device=device, dtype=torch.int32)
        phys.copy_(b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24))

    for t in (kt.l1_weight, kt.l2_weight):
        fill_w(t)
    if kt.l1_scale is not None and kt.l1_scale.dtype != torch.float32:
        fill_s(kt.l1_scale)
        fill_s(kt.l2_scale)
    lay = SynthLayer(spec, kt.l1_weight, kt.l1_scale, kt.l2_weight, kt.l2_scale)
    if spec.row_spec.has_alphas:
        lay.l1_alpha = torch.full((E_l, 2), 1e-3, dtype=torch.float32, device=device)
        lay.l2_global_scale = torch.full((E_l,), 1e-3, dtype=torch.float32, device=device)
        lay.l2_activation_scale = torch.tensor(1.0 / 448, dtype=torch.float32, device=device)
    return lay


def random_routing(T: int, E: int, K: int, device: Any, seed: int = 0, mask_frac: float = 0.0,
                   zero_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k ids per token (uniform), softmax-like weights; optional masked slots
    (-1, weight 0) and fully masked tokens at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].to(torch.int64)
    w = torch.softmax(torch.randn(T, K, generator=g), dim=1).to(torch.float32)
    if mask_frac > 0:
        m = torch.rand(T, K, generator=g) < mask_frac
        ids[m] = -1
        w[m] = 0.0
    if zero_tokens:
        ids[T - zero_tokens:] = -1
        w[T - zero_tokens:] = 0.0
    return w.to(device), ids.to(device)
