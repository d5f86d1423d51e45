#!/usr/bin/env python
"""Serve-time numbers of the transformers integration (issue 27 (3)): what a user waits for and holds.

For a few-layer DeepSeek-V3-shaped model (real H, I, top-k, MLA and vocabulary; fewer layers and experts so
that the bf16 source fits the machine's disk), each measured in its own fresh process:

* ``source``: what a user does today -- ``from_pretrained(SRC bf16, device_map="cuda")`` with transformers'
  own experts implementation;
* ``megamoe``: ``from_pretrained(OUT, device_map="cuda")`` on the folder ``megamoe-convert convert SRC OUT
  --quantize mxfp4`` wrote, experts on the project's triton kernels, run three times, each with the cold
  start it stands for (docs/KERNELS.md#cold-start):

  - ``megamoe_cold_jit``: an empty Triton cache and no kernel cache: the first token includes compiling
    every kernel it needs (a fresh machine without a shipped cache);
  - ``megamoe_shipped``: an empty Triton cache, and the kernel cache ``megamoe-convert warm OUT`` built
    (timed as ``warm``, in worker processes of its own) in ``OUT/kernel-cache``, which the load copies into
    Triton's cache (a fresh machine with the model's shipped cache);
  - ``megamoe``: the Triton cache the cold run filled (a restarted server on the same machine).

Per run: seconds from ``from_pretrained`` to the first generated token (a 32-token prompt), peak host RSS,
peak device memory, and greedy decode tokens/s at batch 1 over 32 new tokens after one warm-up generation,
eager and (on a GPU, unless ``--no-static``) through ``generate(cache_implementation="static")``, which
transformers compiles with CUDA graphs; the static run's tokens are compared with the eager run's.
The page cache is warm for both (the files were just written); DeepGEMM is not installed on the H200.

    python bench/serve.py --work /tmp/serve --json serve.json            # H200
    python bench/serve.py --stage prepare --work /tmp/serve && python bench/serve.py --stage measure --work /tmp/serve
    python bench/serve.py --tiny --work /tmp/serve-tiny                  # CPU smoke run, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's packages, whatever the environment installed

PROMPT, NEW_TOKENS = 32, 32
#: also time generate(cache_implementation="static") (compiled, CUDA graphs); --no-static turns it off
STATIC = os.environ.get("MEGAMOE_SERVE_STATIC", "1") != "0"


def build_source(path: Path, tiny: bool, layers: int, experts: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    if tiny:
        cfg = DeepseekV3Config(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                               n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1,
                               first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=64, q_lora_rank=96,
                               qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=256)
        device = "cpu"
    else:  # DeepSeek-V3's own sizes but for the layer and routed-expert counts
        cfg = DeepseekV3Config(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                               moe_intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=128,
                               num_key_value_heads=128, n_routed_experts=experts, num_experts_per_tok=8,
                               n_shared_experts=1, first_k_dense_replace=1, n_group=8, topk_group=4,
                               kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                               v_head_dim=128, routed_scaling_factor=2.5, max_position_embeddings=4096)
        device = "cuda"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return {"config": {k: getattr(cfg, k) for k in ("hidden_size", "moe_intermediate_size", "n_routed_experts",
                                                    "num_experts_per_tok", "num_hidden_layers", "vocab_size")},
            "source_bytes": size}


def measure(folder: str, use_megamoe: bool) -> dict:
    """One fresh process's run (see the module doc)."""
    import torch

    if use_megamoe:
        import megamoe_runtime.integrations.transformers  # noqa: F401
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=dev if cuda else None)
    t_loaded = time.perf_counter() - t0
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, do_sample=False)
    if cuda:
        torch.cuda.synchronize()
    ttft = time.perf_counter() - t0
    gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        model.generate(ids, **gen)  # warm-up
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        eager_out = model.generate(ids, **gen)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t1
    peaks = {"peak_host_rss_gb": round(_peak_rss_bytes() / 2**30, 2),  # before the static cache is allocated
             "peak_device_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
    static = _static_decode(model, ids, gen, eager_out) if cuda and STATIC else {}
    backend = None
    for m in model.modules():
        if type(m).__name__ == "DeepGemmMegaMoEExperts":
            backend = m.backend.name
            break
    return {"load_s": round(t_loaded, 2), "first_token_s": round(ttft, 2),
            **peaks,
            "decode_tokens_per_s": round(NEW_TOKENS / dt, 2), **static, "experts": backend or
            f"transformers ({getattr(model.config, '_experts_implementation', None)})"}


def _static_decode(model, ids, gen: dict, eager_out) -> dict:
    """Greedy decode through ``generate(cache_implementation="static")``: on a GPU transformers compiles the
    forward (inductor, "reduce-overhead": CUDA graphs) when the quantizer allows it. The first call compiles;
    the timed one replays. Tokens are compared with the eager generate of the same prompt."""
    import torch

    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(ids, cache_implementation="static", **gen)  # compiles
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            model.generate(ids, cache_implementation="static", **gen)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            model.generate(ids, cache_implementation="static", **gen)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t1
    except Exception as e:  # a model or quantizer that does not compile: say so, keep the eager numbers
        return {"static_error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"static_first_generate_s": round(first, 2), "static_decode_tokens_per_s": round(NEW_TOKENS / dt, 2),
            "static_tokens_equal_eager": bool(torch.equal(out.cpu(), eager_out.cpu()))}


def _peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss: Linux carries that across
    fork+exec, so a child would report the benchmark parent's peak (the source model it built)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(folder: Path, use_megamoe: bool, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--measure", str(folder)] + (["--megamoe"] if use_megamoe else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/megamoe-serve-bench"))
    ap.add_argument("--layers", type=int, default=3, help="decoder layers (the first dense, the rest MoE)")
    ap.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer (DeepSeek-V3: 256)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke run, not a benchmark)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--no-static", action="store_true",
                    help="skip the static-cache (compiled, CUDA-graph) decode of each run")
    ap.add_argument("--no-cold", action="store_true", help="skip the run with an empty Triton cache")
    ap.add_argument("--no-shipped", action="store_true",
                    help="skip building the kernel cache (megamoe-convert warm) and the run seeded from it")
    ap.add_argument("--no-restart", action="store_true", help="skip the run on the cold run's Triton cache")
    ap.add_argument("--warm-tokens", default=None, help="token counts of the kernel cache (default: warm's own)")
    ap.add_argument("--warm-jobs", type=int, default=8, help="worker processes of megamoe-convert warm")
    ap.add_argument("--stage", choices=("all", "prepare", "measure"), default="all",
                    help="prepare: build and convert only; measure: the runs on a --work folder prepared before")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--megamoe", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure, a.megamoe)))
        return
    work = a.work
    src, out = work / "source-bf16", work / "out-mxfp4"
    prep = work / "prepared.json"
    if a.stage in ("all", "prepare"):
        from megamoe_convert.pipeline.convert import convert

        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        t = time.perf_counter()
        res = {"model": build_source(src, a.tiny, a.layers, a.experts)}
        res["build_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        convert(src, out, quantize="mxfp4")
        res["convert_s"] = round(time.perf_counter() - t, 1)
        res["out_bytes"] = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
        prep.write_text(json.dumps(res))
        print(json.dumps(res), flush=True)
        if a.stage == "prepare":
            return
    if not prep.is_file():
        raise SystemExit(f"{work} was not prepared: run with --stage prepare (or all) first")
    res = json.loads(prep.read_text())
    static = "0" if a.no_static else "1"
    env = dict(os.environ, TRITON_CACHE_DIR=str(work / "triton-cache"), MEGAMOE_SERVE_STATIC=static,
               MEGAMOE_KERNEL_CACHE="off")
    shutil.rmtree(work / "triton-cache", ignore_errors=True)
    res["source"] = _child(src, False, env)
    print(json.dumps({"source": res["source"]}), flush=True)
    if not a.no_cold:
        res["megamoe_cold_jit"] = _child(out, True, dict(env, MEGAMOE_SERVE_STATIC="0"))
        res["cold_jit_kernels"] = _compiled_kernels(work / "triton-cache")
        print(json.dumps({"megamoe_cold_jit": res["megamoe_cold_jit"], "kernels": res["cold_jit_kernels"]}),
              flush=True)
    import torch

    if not a.no_shipped and torch.cuda.is_available():  # a kernel cache is compiled on the GPU it serves
        res["warm"] = _warm(out, a.warm_tokens, a.warm_jobs, env)
        print(json.dumps({"warm": res["warm"]}), flush=True)
    if "warm" in res and res["warm"].get("ok"):
        fresh = work / "triton-cache-fresh"
        shutil.rmtree(fresh, ignore_errors=True)
        res["megamoe_shipped"] = _child(out, True, dict(env, TRITON_CACHE_DIR=str(fresh), MEGAMOE_SERVE_STATIC="0",
                                                        MEGAMOE_KERNEL_CACHE=""))
        shipped = {p.name for p in (out / "kernel-cache" / "triton").iterdir()}
        # kernels the seeded run still compiled: in its Triton cache but not in the shipped one
        res["shipped_compiled_anyway"] = _compiled_kernels(fresh, skip=shipped)
        print(json.dumps({"megamoe_shipped": res["megamoe_shipped"],
                          "compiled_anyway": res["shipped_compiled_anyway"]}), flush=True)
    if not a.no_restart:
        res["megamoe"] = _child(out, True, env)
    src_t = res["source"]["first_token_s"]
    res["first_token_vs_source"] = {k: round(res[k]["first_token_s"] / src_t, 2)
                                    for k in ("megamoe_cold_jit", "megamoe_shipped", "megamoe") if k in res}
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


def _compiled_kernels(cache: Path, skip: frozenset = frozenset()) -> dict:
    """{kernel name: compiled specializations} in a Triton cache folder (one ``*.cubin`` per compilation),
    leaving out the entries named in ``skip``."""
    names: dict = {}
    for f in sorted(cache.glob("*/*.cubin")):
        if f.parent.name not in skip:
            names[f.stem] = names.get(f.stem, 0) + 1
    return names


def _warm(out: Path, tokens, jobs: int, env: dict) -> dict:
    """``megamoe-convert warm OUT`` (OUT/kernel-cache) in a process of its own, timed from its start."""
    cmd = [sys.executable, "-m", "megamoe_convert", "warm", str(out), "--jobs", str(jobs), "--json"]
    if tokens:
        cmd += ["--tokens", tokens]
    shutil.rmtree(out / "kernel-cache", ignore_errors=True)
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                       env=dict(env, PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])))
    if r.returncode:  # the other runs still count: say why and go on
        return {"ok": False, "error": f"{' '.join(cmd)}: rc {r.returncode}: {r.stdout[-1500:]} {r.stderr[-3000:]}"}
    d = json.loads(r.stdout)
    d["wall_s"] = round(time.perf_counter() - t, 1)
    return d

if __name__ == "__main__":
    main()
