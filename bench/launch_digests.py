"""sha256 of the triton forward's output on every row x token count x code path, for comparing two trees.

Why: a change to how the kernels are launched (argument grouping, helpers moved between modules) must
leave every output bit as it was. Run this on the tree before and the tree after, on the same card, and
diff the two JSON files: one digest per case, the case named by its row, tokens and path.

    python bench/launch_digests.py --out a.json                  # GPU: every case
    TRITON_INTERPRET=1 python bench/launch_digests.py --out a.json --cpu   # CPU interpreter, small shapes
                                                                  # (the FP8 path with stand-ins: interpret_fp8_path)
    python bench/launch_digests.py --out a.json --shard 0/4      # a quarter of the cases (parallel runs)

Only the public forward (``moe.moe_forward``, ``moe.fold_flags``, ``KernelConfig``) is called, so the
same script runs against both trees. Unwritten slots are never hashed: only the layer output.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import types

import torch
import triton
import triton.language as tl

from megamoe_runtime.format.formats import ActivationSpec, LayerSpec, SharedSpec

ACTS = {"swiglu": ActivationSpec("swiglu"),
        "clamp_ab": ActivationSpec("swiglu", clamp=7.0, alpha=1.702, beta=1.0),
        "situ": ActivationSpec("situ", situ_beta=3.0, situ_linear_beta=6.0),
        "clamp": ActivationSpec("swiglu", clamp=7.0)}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def cases(cpu: bool) -> list[dict]:
    """(row, T, path) cases; a path is a dict of forward options and layer options."""
    out = []
    tokens = (1, 8, 40) if cpu else (1, 8, 64, 300)
    for row in ("bf16", "mxfp4", "mxfp8", "nvfp4", "fp8_block"):
        for T in tokens:
            paths = [dict(name="default")]
            if row == "fp8_block":
                paths = [dict(name="default", act="swiglu"), dict(name="ep1of2", ep=(1, 2), act="swiglu"),
                         dict(name="clamp", act="clamp"), dict(name="bm16", cfg=dict(block_m=16), act="swiglu")]
            else:
                paths += [dict(name="ep1of2", ep=(1, 2)),
                          dict(name="shared_ep", shared="bf16" if row == "bf16" else "mxfp8", ep=(1, 2)),
                          dict(name="bm16", cfg=dict(block_m=16))]
                if row in ("bf16", "nvfp4"):
                    paths.append(dict(name="shared_bf16", shared="bf16"))
                if row != "bf16":
                    paths += [dict(name="split", cfg=dict(k_order="split"), shared="mxfp8"),
                              dict(name="plain2dot", cfg=dict(k_order="frag", decode="plain", l1_gu=False)),
                              dict(name="fold_words_gu", cfg=dict(k_order="frag", decode="fold", scale_load="words",
                                                                  l1_gu=True)),
                              dict(name="fold_flags", cfg=dict(k_order="frag", decode="fold", l1_gu=True),
                                   flags=True),
                              dict(name="l2split2", I=512, cfg=dict(l2_split=2), shared="mxfp8"),
                              dict(name="l2split4_ep", I=512, cfg=dict(l2_split=4), ep=(1, 2)),
                              dict(name="tails", cfg=dict(tail_max=32, block_m=64)),
                              dict(name="act_" + ("situ" if row.startswith("mx") else "plain"),
                                   act="situ" if row.startswith("mx") else "swiglu")]
                    if not cpu:
                        paths += [dict(name="wtile16", wt=16), dict(name="asm_off", asm=False),
                                  dict(name="maxnreg", cfg=dict(l1_maxnreg=96, l2_maxnreg=96))]  # 64: ptxas needs 94+ at prefill
                    if row in ("mxfp4", "mxfp8"):
                        paths += [dict(name="mma_fp8", cfg=dict(mma="fp8")),
                                  dict(name="mma_fp8_shared", cfg=dict(mma="fp8"), shared="mxfp8", ep=(1, 2)),
                                  dict(name="mma_fp8_bm16", cfg=dict(mma="fp8", block_m=16))]
            for rank, p in enumerate(paths):
                if cpu or T in (8, 300) or p["name"] in ("default", "ep1of2", "shared_ep", "mma_fp8"):
                    out.append((rank, T, dict(row=row, T=T, **p)))
    # every row's first paths before any row's later ones: a run cut short by its time limit still covers
    # each row and token count (two trees cut alike compare on what both reached)
    return [c for _, _, c in sorted(out, key=lambda r: (r[0], r[1]))]


def interpret_fp8_path() -> None:
    """Under the interpreter, run the FP8 path (``mma8``) too: take it where a config asks for it (on the
    GPU only the hardware decides), and give the device helpers' GPU branches (libdevice exp / tanh, the
    hardware casts) their interpreter branches. Both trees get the same stand-ins, so their digests still
    compare the code around them; the stand-ins' numerics are not the GPU's."""
    from megamoe_runtime.backends.triton import _jit, moe

    moe.fp8_selected = lambda row, hw, choice: choice == "fp8"
    for name in ("expf", "tanhf", "bf16r", "e4m3_round"):
        _PLAIN[name] = getattr(_jit, name)
        setattr(_jit, name, triton.jit(globals()["_plain_" + name]))


#: the device helpers ``interpret_fp8_path`` replaces, called with their interpreter branch
_PLAIN: dict = {}


def _plain_expf(x, GPU: tl.constexpr):
    return _PLAIN["expf"](x, False)


def _plain_tanhf(x, GPU: tl.constexpr):
    return _PLAIN["tanhf"](x, False)


def _plain_bf16r(x, GPU: tl.constexpr):
    return _PLAIN["bf16r"](x, False)


def _plain_e4m3_round(v, HW_CVT: tl.constexpr):
    return _PLAIN["e4m3_round"](v, False)


def run_case(c: dict, device: str, cpu: bool) -> dict:
    from megamoe_runtime.backends.triton import configs, moe, synth
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles

    row, T = c["row"], c["T"]
    H, E, K = (256, 4, 2) if cpu else (512, 16, 4)
    I = c.get("I", 256)
    ep = c.get("ep", (0, 1))
    shared = c.get("shared")
    spec = LayerSpec(row, H, I, E, K, ACTS[c.get("act", "clamp_ab")], ep_rank=ep[0], ep_size=ep[1],
                     shared=SharedSpec(shared, 1, 128) if shared else None, routed_scaling_factor=2.5)
    lay = synth.random_layer(spec, device=device, seed=T, a2=4.0 / 2688 if row == "nvfp4" else None)
    tw, ids = synth.random_routing(T, E, K, device, seed=T + 1, mask_frac=0.1, zero_tokens=min(1, T - 1))
    g = torch.Generator(device="cpu").manual_seed(T + 2)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    kt = _Roles(lay, "")
    kw = dict(scalars=_NvScalars(lay) if row == "nvfp4" else None)
    if shared:
        kw.update(shared=_Roles(lay, "shared_"), shared_input=x)
    if "cfg" in c:
        kw["config"] = configs.KernelConfig(**c["cfg"])
    if "asm" in c:
        kw["asm"] = c["asm"]
    if c.get("flags"):
        kw["fold_flags"] = moe.fold_flags(spec, kt)
    if c.get("wt"):
        from megamoe_runtime.format import weight_tiles

        tiled = types.SimpleNamespace(**vars(kt))
        tiled.l1_weight = weight_tiles.tiled_copy(kt.l1_weight, c["wt"])
        tiled.l2_weight = weight_tiles.tiled_copy(kt.l2_weight, c["wt"])
        kt = tiled
        kw["w_tile"] = c["wt"]
    y = moe.moe_forward(spec, kt, x, tw, ids, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    return dict(case=c, sha256=_digest(y), finite=bool(torch.isfinite(y.float()).all()),
                nonzero=int((y != 0).sum()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file: one digest per case")
    ap.add_argument("--cpu", action="store_true", help="small shapes, no GPU-only paths (TRITON_INTERPRET=1)")
    ap.add_argument("--shard", default="0/1", help="i/n: every n-th case from the i-th")
    ap.add_argument("--only", default="", help="substring a case's name must hold")
    a = ap.parse_args(argv)
    i, n = (int(v) for v in a.shard.split("/"))
    device = "cpu" if a.cpu else "cuda"
    todo = [c for c in cases(a.cpu) if a.only in json.dumps(c)][i::n]
    import megamoe_runtime

    print(f"tree {megamoe_runtime.__file__}; {len(todo)} cases", file=sys.stderr, flush=True)
    if a.cpu:
        interpret_fp8_path()
    res = []
    t0 = time.time()
    for c in todo:
        try:
            r = run_case(c, device, a.cpu)
        except Exception as e:  # a case that raises is recorded: the two trees must raise alike too
            r = dict(case=c, error=f"{type(e).__name__}: {e}"[:300])
        res.append(r)
        print(json.dumps(r), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=0)
    print(f"{len(res)} cases in {time.time() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
