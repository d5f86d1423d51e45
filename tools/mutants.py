"""Break one rule of the format contract at a time and show the tests catch it.

    python tools/mutants.py            # every mutant, in a scratch copy of the repo
    python tools/mutants.py --list

Each mutant is a one-line change to the package (a layout rule, a rounding
rule, a scale, the activation, the combine order...). The script copies the
repository to a temporary folder, applies the mutant there, runs the test
files that guard that rule, and reports whether they failed (they must). The
working tree is never modified. Exit code 1 if any mutant survives.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, file, old text, new text, test files that must fail)
MUTANTS = [
    ("utccp: no 4x32 transpose", "megamoe_runtime/format/layout.py",
     "v = kv.transpose(-1, -2).unflatten(-1, (h // 128, 32, 4))  # (.., p, b, i, j)",
     "v = kv.transpose(-1, -2).unflatten(-1, (h // 128, 4, 32))  # (.., p, b, i, j)",
     ["tests/runtime/test_layout.py", "tests/runtime/backends/test_reference.py"]),
    ("interleave: gate/up halves swapped", "megamoe_runtime/format/layout.py",
     "return dst.unflatten(-2, (n2 // 16, 2, 8)).select(-3, half)",
     "return dst.unflatten(-2, (n2 // 16, 2, 8)).select(-3, 1 - half)",
     ["tests/runtime/test_layout.py"]),
    ("interleave: groups of 16 instead of 8", "megamoe_runtime/format/layout.py",
     "return dst.unflatten(-2, (n2 // 16, 2, 8)).select(-3, half)",
     "return dst.unflatten(-2, (n2 // 32, 2, 16)).select(-3, half).flatten(-3, -2).unflatten(-2, (n2 // 16, 8))",
     ["tests/runtime/test_layout.py"]),
    ("ue8m0: floor instead of ceil", "megamoe_runtime/format/codecs.py",
     "e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)",
     "e = ((bits >> 23) & 0xFF)",
     ["tests/runtime/test_codecs.py"]),
    ("ue8m0: scale exponent off by one", "megamoe_runtime/format/codecs.py",
     "e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)",
     "e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32) + 1",
     ["tests/runtime/test_codecs.py"]),
    ("e4m3: saturation bound wrong", "megamoe_runtime/format/codecs.py",
     "E4M3_MAX = 448.0", "E4M3_MAX = 480.0",
     ["tests/runtime/test_codecs.py"]),
    ("activation: silu(g) without the gate factor", "megamoe_runtime/backends/reference.py",
     "def activation_fp32(act: ActivationSpec, g: Tensor, u: Tensor, fast_math: bool = False) -> Tensor:",
     "def activation_fp32(act: ActivationSpec, g: Tensor, u: Tensor, fast_math: bool = False) -> Tensor:\n"
     "    return torch.sigmoid(g.float()) * u.float()\n\n\ndef _unused(act, g, u, fast_math=False):",
     ["tests/runtime/backends/test_reference.py"]),
    ("swiglu: clamp on up one-sided", "megamoe_runtime/backends/reference.py",
     "u = torch.maximum(torch.minimum(u, c), -c)", "u = torch.minimum(u, c)",
     ["tests/runtime/backends/test_reference.py"]),
    ("nvfp4 dispatch: upstream fp4_fp4 given DGv's per-token x", "megamoe_runtime/backends/reference.py",
     'NVFP4_DISPATCH_BY_ENTRY = {"fp4_fp4_mega_moe": "unit_global", "nvfp4_mega_moe": "per_token"}',
     'NVFP4_DISPATCH_BY_ENTRY = {"fp4_fp4_mega_moe": "per_token", "nvfp4_mega_moe": "per_token"}',
     ["tests/runtime/backends/test_reference.py", "tests/runtime/backends/test_deepgemm.py"]),
    ("W4A8_NVFP4_FP8: per-32 scales tiled, not split in place", "megamoe_convert/readers/common.py",
     "s = s.view(torch.uint8).repeat_interleave(rep, 1).view(torch.float8_e4m3fn)",
     "s = s.view(torch.uint8).repeat(1, rep).view(torch.float8_e4m3fn)",
     ["tests/convert/readers/test_recipe.py"]),
    ("W4A8_NVFP4_FP8: FP8 input scale used as the NVFP4 a2 unconverted", "megamoe_convert/readers/modelopt.py",
     'Param("input", ("input_scale",), ("F32",), required=False, rescale=(448.0, 2688.0)),',
     'Param("input", ("input_scale",), ("F32",), required=False),',
     ["tests/convert/readers/test_recipe.py"]),
    ("recipe: weight-only activations not refused", "megamoe_convert/readers/recipe.py",
     'return ActivationChange(source, row, kk, kdesc, relation, relation in ("coarser", "unknown"), accepted,',
     'return ActivationChange(source, row, kk, kdesc, relation, False, accepted,',
     ["tests/convert/readers/test_recipe.py"]),
    ("combine: rsf not applied (nvfp4)", "megamoe_runtime/backends/reference.py",
     "    if rsf != 1.0:\n        r = (r.to(torch.float32)", "    if False:\n        r = (r.to(torch.float32)",
     ["tests/runtime/backends/test_reference.py"]),
]


def _run(mutant, keep: bool) -> bool:
    name, rel, old, new, tests = mutant
    with tempfile.TemporaryDirectory(prefix="megamoe-mutant-") as tmp:
        dst = Path(tmp) / "repo"
        shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "fixtures"))
        # the checkpoint fixtures (real producer exports) are read only: link them instead of copying
        (dst / "tests" / "fixtures").symlink_to(ROOT / "tests" / "fixtures", target_is_directory=True)
        path = dst / rel
        text = path.read_text()
        if text.count(old) < 1:
            print(f"  [stale]    {name}: pattern not found in {rel}")
            return False
        path.write_text(text.replace(old, new, 1))
        env_path = str(dst)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                              cwd=dst, capture_output=True, text=True,
                              env={**__import__("os").environ, "PYTHONPATH": env_path})
        caught = proc.returncode != 0
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr.strip()[-200:]
        print(f"  [{'caught' if caught else 'SURVIVED'}]  {name}: {last}")
        return caught


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--only", help="substring of a mutant's name")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or args.only in m[0]]
    if args.list:
        for m in chosen:
            print(f"{m[0]}  ({m[1]})")
        return 0
    results = [_run(m, False) for m in chosen]
    print(f"{sum(results)} of {len(results)} mutants caught")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
