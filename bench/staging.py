"""Benchmark the triton staging quantizers against a device copy of the same bytes (issue 11, point 3).

For each hidden size H and token count T:

* bit-exactness first: every kernel variant below against ``megamoe_runtime.format.codecs``
  (``quantize_mxfp8``, ``quantize_nvfp4_per_token``) on fresh random rows (a new
  seed per H, 4096 tokens over 16 decades of scale) and the adversarial rows of
  ``megamoe_runtime.testing`` (zero and -0 rows, values next to powers of two,
  E4M3 / E2M1 ties, bf16 subnormals and near-max values), including the bf16
  dequantized copies the GEMMs read;
* then the median time (``triton.testing.do_bench`` of a CUDA-graph replay, L2
  flushed) of each variant and of ``torch`` ``copy_`` of a uint8 buffer holding
  half the bytes the quantizer moves (so the copy reads and writes the same total:
  bf16 ``[T, H]`` read once, elements + scales written once). "% of copy" is the
  copy's time over the quantizer's time. The last column is the quantizer's bytes
  per second over a 2 GiB copy's (the rate bench/kernel.py's staging table used).
* launches of the whole layer forward at 1 token (``torch.profiler`` kernel count).

Usage (on the GPU)::

    python bench/staging.py --out $OUT            # T = 1,8,64,512,4096; H = 7168,5120
    python bench/staging.py --prove-div --tokens 512,4096 --hidden 7168 --no-launches

Exit status 1 if any variant is not bit-exact.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel import _bench, copy_bandwidth  # noqa: E402  (same timing method as bench/kernel.py)

from megamoe_runtime.format import codecs  # noqa: E402
from megamoe_runtime.testing import frag_positions, staging_adversarial_rows, staging_random_rows  # noqa: E402

MXFP8_CONFIGS = [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8)]
NVFP4_VARIANTS = [  # (label, kwargs)
    ("row fast 4w (default)", dict(impl="row", fast_div=True, num_warps=4)),
    ("row fast 4w 1 step", dict(impl="row", fast_div=True, num_warps=4, div_steps=1)),
    ("row fast 4w 1 step cap 80", dict(impl="row", fast_div=True, num_warps=4, div_steps=1, maxnreg=80)),
    ("row fast 4w 1 step cap 64", dict(impl="row", fast_div=True, num_warps=4, div_steps=1, maxnreg=64)),
    ("row fast 8w 1 step", dict(impl="row", fast_div=True, num_warps=8, div_steps=1)),
    ("row fast 2w 1 step", dict(impl="row", fast_div=True, num_warps=2, div_steps=1)),
    ("row div_rn 4w", dict(impl="row", fast_div=False, num_warps=4)),
    ("chunk (old)", dict(impl="chunk")),
]


def _nv_bytes(T, H):
    return 2 * T * H + T * H // 2 + T * H // 16 + 4 * T


def _mx_bytes(T, H):
    return 2 * T * H + T * H + T * H // 32


def check_exact(H: int, seed: int, full: bool = True) -> list[str]:
    """Every variant (``full``; else the defaults) vs codecs on adversarial + fresh random rows,
    the dequantized copies through the default launch shapes; returns failure lines."""
    from megamoe_runtime.backends.triton import staging

    fails = []
    inputs = [("adversarial", staging_adversarial_rows(H, "cuda")),
              ("random", staging_random_rows(4096, H, "cuda", seed=seed))]
    for name, x in inputs:
        rq, rsf = codecs.quantize_mxfp8(x)
        deq = codecs.dequantize_mx(rq, rsf, "e4m3").to(torch.bfloat16)
        want = {"natural": deq, "split": torch.cat([deq[:, 0::2], deq[:, 1::2]], dim=1)}
        if H % 128 == 0:  # the mxfp4 row's frag K order, which the forward's staging writes
            want["frag"] = torch.empty_like(deq)
            want["frag"][:, frag_positions(H).to(x.device)] = deq
        for cfg in (MXFP8_CONFIGS if full else [None]):
            q, sf, x_sf = staging.quantize_mxfp8(x, config=cfg)
            nbad = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())
            if nbad or not torch.equal(sf, rsf) or not torch.equal(x_sf, codecs.pack_bytes_int32(rsf)):
                fails.append(f"mxfp8 {cfg} H={H} {name}: {nbad} E4M3 bytes / scales differ")
            # every launch shape is timed with the frag dequant, so every one is checked with it
            for mode, w in [(m, w) for m, w in want.items() if cfg in (None, staging._MXFP8_DQ_CONFIG) or m == "frag"]:
                *_, xd = staging.quantize_mxfp8(x, config=cfg, dequant=mode)
                if not torch.equal(xd.view(torch.int16), w.view(torch.int16)):
                    fails.append(f"mxfp8 {cfg} H={H} {name}: dequant {mode} differs")
        rp, rsf4, rts = codecs.quantize_nvfp4_per_token(x)
        d4 = codecs.dequantize_nvfp4(rp, rsf4, 1.0).to(torch.bfloat16)
        w4 = torch.cat([d4[:, 0::2], d4[:, 1::2]], dim=1)
        variants = NVFP4_VARIANTS + [("row int_cvt", dict(impl="row", hw_cvt=False, fast_div=True))]
        for label, kw in (variants if full else [("default", {})]):
            p, sf, x_sf, ts = staging.quantize_nvfp4_per_token(x, **kw)
            bad = []
            if not torch.equal(ts, rts):
                bad.append(f"{int((ts != rts).sum())} token scales")
            if not torch.equal(sf.view(torch.uint8), rsf4.view(torch.uint8)):
                bad.append(f"{int((sf.view(torch.uint8) != rsf4.view(torch.uint8)).sum())} block scales")
            if not torch.equal(p, rp):
                bad.append(f"{int((p != rp).sum())} packed bytes")
            if not torch.equal(x_sf, codecs.pack_bytes_int32(rsf4)):
                bad.append("x_sf words")
            if label in ("default", NVFP4_VARIANTS[0][0], "chunk (old)"):
                *_, xd = staging.quantize_nvfp4_per_token(x, dequant="split", **kw)
                if not torch.equal(xd.view(torch.int16), w4.view(torch.int16)):
                    bad.append("split dequant")
                if H % 128 == 0:  # the frag K order is defined on 128-wide blocks
                    *_, xf = staging.quantize_nvfp4_per_token(x, dequant="frag", **kw)
                    want_f = torch.empty_like(d4)
                    want_f[:, frag_positions(H).to(x.device)] = d4
                    if not torch.equal(xf.view(torch.int16), want_f.view(torch.int16)):
                        bad.append("frag dequant")
            if bad:
                fails.append(f"nvfp4 {label} H={H} {name}: " + ", ".join(bad) + " differ")
    # negative control: the check must see a wrong tie rule
    p, *_ = staging.quantize_nvfp4_per_token(inputs[0][1])
    if torch.equal(p, codecs.quantize_nvfp4_per_token(inputs[0][1], ties="down")[0]):
        fails.append(f"negative control H={H}: ties='down' reference not told apart")
    return fails


def time_row(T: int, H: int, peak: float) -> list[dict]:
    from megamoe_runtime.backends.triton import staging

    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    rows = []
    copies = {}

    def copy_ms(nbytes):
        if nbytes not in copies:
            half = (nbytes + 1) // 2
            a = torch.empty(half, dtype=torch.uint8, device="cuda").random_()
            b = torch.empty_like(a)
            copies[nbytes] = _bench(lambda: b.copy_(a), graph=True, rep=100, warmup=20)
        return copies[nbytes]

    cases = [(f"mxfp8 {c}", lambda c=c: staging.quantize_mxfp8(x, config=c), _mx_bytes(T, H)) for c in MXFP8_CONFIGS]
    cases += [("mxfp8 serving (natural dequant)", lambda: staging.quantize_mxfp8(x, dequant="natural"),
               _mx_bytes(T, H) + 2 * T * H)]
    # what the frag GEMMs' forward runs (default launch shape first), then the other launch shapes
    cases += [(f"mxfp8 serving (frag dequant) {c or 'default'}",
               lambda c=c: staging.quantize_mxfp8(x, dequant="frag", config=c), _mx_bytes(T, H) + 2 * T * H)
              for c in [None] + MXFP8_CONFIGS]
    cases += [(f"nvfp4 {lab}", lambda kw=kw: staging.quantize_nvfp4_per_token(x, **kw), _nv_bytes(T, H))
              for lab, kw in NVFP4_VARIANTS]
    cases += [("nvfp4 serving (split dequant)", lambda: staging.quantize_nvfp4_per_token(x, dequant="split"),
               _nv_bytes(T, H) + 2 * T * H)]
    cases += [("nvfp4 serving (frag dequant)", lambda: staging.quantize_nvfp4_per_token(x, dequant="frag"),
               _nv_bytes(T, H) + 2 * T * H)]
    for name, fn, nbytes in cases:
        try:
            ms = _bench(fn, graph=True, rep=100, warmup=20)
        except Exception as e:  # a variant that does not compile is reported, not fatal
            print(f"# {name} T={T} H={H}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        cms = copy_ms(nbytes)
        rows.append(dict(kind=name, T=T, H=H, us=ms * 1e3, copy_us=cms * 1e3, frac=cms / ms, bytes=nbytes,
                         frac_peak=nbytes / ms / 1e6 / peak))
        print(f"{name:32s} T={T:5d} H={H} {ms * 1e3:8.1f} us  copy {cms * 1e3:7.1f} us  {100 * cms / ms:5.1f}% "
              f"of the copy, {100 * nbytes / ms / 1e6 / peak:5.1f}% of the 2 GiB copy rate", flush=True)
    return rows


def count_launches() -> dict:
    """Kernels launched by one layer forward at 1 token (torch.profiler), per row."""
    from torch.profiler import ProfilerActivity, profile

    from megamoe_runtime.backends.triton import moe, synth
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles
    from megamoe_runtime.format.formats import ActivationSpec, LayerSpec, get_row

    out = {}
    for row in ("nvfp4", "mxfp4"):
        try:
            spec = LayerSpec(row, 7168, 2048, 16, 8, ActivationSpec("swiglu", clamp=10.0), routed_scaling_factor=2.5)
            lay = synth.random_kernel_bytes(spec, "cuda", seed=1)
            kt = _Roles(lay, "")
            sc = _NvScalars(lay) if get_row(row).has_alphas else None
            tw, ids = synth.random_routing(1, 16, 8, "cuda", seed=3)
            x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
            moe.moe_forward(spec, kt, x, tw, ids, scalars=sc)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                moe.moe_forward(spec, kt, x, tw, ids, scalars=sc)
                torch.cuda.synchronize()
            names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
            out[row] = dict(launches=len(names), kernels=names)
            print(f"launches at 1 token, {row}: {len(names)}: {names}", flush=True)
            del lay, kt
        except Exception as e:
            print(f"# launch count {row}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return out


def render(rows: list[dict]) -> str:
    L = ["| kernel | tokens | H | time (us) | copy of same bytes (us) | % of copy | % of 2 GiB copy rate |",
         "|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['kind']} | {r['T']} | {r['H']} | {r['us']:.1f} | {r['copy_us']:.1f} | {100 * r['frac']:.0f}% "
                 f"| {100 * r['frac_peak']:.0f}% |")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--hidden", default="7168,5120")
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-launches", action="store_true")
    ap.add_argument("--prove-div", action="store_true",
                    help="first count where the row kernel's fast division (1 and 2 residual steps; 0 as the "
                         "negative control) differs from div_rn over every significand pair it can meet")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    hidden = [int(h) for h in args.hidden.split(",")]
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    import triton

    info["triton"] = triton.__version__
    print(json.dumps(info), flush=True)
    fails = []
    if args.prove_div:
        from megamoe_runtime.backends.triton import staging

        proof = {}
        for steps in (0, 1, 2):
            for six in (False, True):
                proof[f"steps={steps} {'/6' if six else '|x|/ts'}"] = n = staging.division_mismatches(steps, six)
                print(f"division proof: {steps} residual steps, {'x / 6' if six else 'bf16 / fp32'}: "
                      f"{n} quotients differ from div_rn", flush=True)
        info["division_proof"] = proof
        if proof["steps=0 |x|/ts"] == 0:
            fails.append("division proof: the negative control (no residual step) found no difference")
    if not args.no_check:
        for H in hidden + [128]:
            f = check_exact(H, args.seed + H, full=H in hidden)
            print(f"bit-exact H={H}: {'OK' if not f else 'FAIL'}", flush=True)
            for line in f:
                print("  " + line, flush=True)
            fails += f
    peak = copy_bandwidth()
    info["copy_GBps_2GiB"] = peak
    print(f"2 GiB device copy: {peak:.0f} GB/s (read + write)", flush=True)
    rows = []
    for H in hidden:
        for T in tokens:
            rows += time_row(T, H, peak)
    launches = {} if args.no_launches else count_launches()
    md = render(rows)
    print(md)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "staging.md").write_text(md + "\n")
        (Path(args.out) / "staging.json").write_text(json.dumps(
            dict(info=info, exact_failures=fails, rows=rows, launches=launches), indent=1))
    print(f"bit-exact failures: {len(fails)}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
