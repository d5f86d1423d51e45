"""Prove a weight reload with a meta-tensor dry run before touching live memory.

    python examples/reload_dry_run.py                      # tiny synthetic ModelOpt NVFP4 model
    python examples/reload_dry_run.py --format modelopt-mxfp4

What it shows:
1. a served model (every MoE layer built from a converted folder);
2. ``verify_reload(model, new_converted_dir)``: every parameter byte would be
   written exactly once, no name unused or unknown, nothing rebound -- checked
   with meta stand-ins from safetensors headers, no data read, no live write;
3. the same check against the RAW source checkpoint (vLLM-style loader);
4. a defective checkpoint (one expert missing) is caught by the dry run,
   naming the layer, parameter and expert, while the live weights stay as they were;
5. only then the real reload, into the same storage (data pointers unchanged).
Exits non-zero if a check does not behave as described.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import megamoe_runtime as mr


def serve(ckpt: mr.Checkpoint) -> nn.ModuleDict:
    return nn.ModuleDict({f"layer{li.index}": ckpt.build_layer(li.index, backend="reference") for li in ckpt.layers})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="modelopt-nvfp4", help="synthetic source format")
    args = ap.parse_args(argv)
    from megamoe_convert.pipeline.convert import convert
    from megamoe_convert.testing.synth import build_synthetic_checkpoint

    ok = True
    with tempfile.TemporaryDirectory(prefix="megamoe-reload-") as tmp:
        tmp = Path(tmp)
        old_src = build_synthetic_checkpoint(tmp / "v1", args.format, seed=0)
        new_src = build_synthetic_checkpoint(tmp / "v2", args.format, seed=1)  # "fine-tuned" weights
        bad_src = build_synthetic_checkpoint(tmp / "bad", args.format, seed=1, missing_expert=(1, 3))
        convert(old_src, tmp / "v1-out")
        convert(new_src, tmp / "v2-out")

        model = serve(mr.open_checkpoint(tmp / "v1-out"))
        before = {k: m.storage_snapshot() for k, m in model.items()}
        probe = model["layer0"].l1_weight.detach().clone()

        print("1. dry run against the new converted checkpoint:")
        rep = mr.verify_reload(model, tmp / "v2-out")
        print("   " + rep.summary())
        ok &= rep.ok

        print("2. dry run against the new raw checkpoint (vLLM-style loader):")
        rep = mr.verify_reload(model, new_src)
        print("   " + rep.summary())
        ok &= rep.ok

        print("3. dry run against a raw checkpoint with expert 3 of layer 1 missing:")
        rep = mr.verify_reload(model, bad_src)
        print("   " + rep.summary().replace("\n", "\n   "))
        ok &= (not rep.ok) and all(p.missing_experts == [3] for p in rep.missing.values()) and bool(rep.missing)
        ok &= torch.equal(model["layer0"].l1_weight.view(torch.uint8), probe.view(torch.uint8))  # untouched

        print("4. the real reload, now that the dry run passed:")
        new = mr.open_checkpoint(tmp / "v2-out")
        for name, layer in model.items():
            new.load_layer(layer)
        same = all(m.storage_snapshot() == before[k] for k, m in model.items())
        changed = not torch.equal(model["layer0"].l1_weight.view(torch.uint8), probe.view(torch.uint8))
        print(f"   storage (data_ptr, strides, dtype) unchanged: {same}; weights changed: {changed}")
        ok &= same and changed
    print("all checks behaved as expected" if ok else "UNEXPECTED RESULT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
