"""transformers' ``from_pretrained`` on converted block-FP8 folders (the fp8_block row, reference backend, CPU).

The reference is transformers' own model class with every weight decoded from the SOURCE export by this
file's decoder (``e4m3 * scale`` per 128x128 block, fp64 then bf16 like any float checkpoint), and an
experts implementation registered in transformers' ExpertsInterface that quantizes as the SM90 kernel does
(docs/NUMERICS.md#fp8-block), written here independently of the project's codecs and reference backend:
x to FP8 per token per 128 (``amax / 448``), gate/up in full precision, ``silu(g) * u * w``, FP8 per 64
(``amax * (1/448)``), down, bf16 per slot, slots summed. The shared expert (not fused by this row) runs
as transformers' MLP on both sides. Tolerance: logits calc_diff < 1e-6; measured 0.0 on both fixtures (the
bf16 logits are bitwise equal: the fp64 sums here and the layer's per-block fp32 sums round to the same
bf16 slot outputs on these tiny models). Negative controls: the kernel's activation quantization left out
of the reference (4e-5 .. 2e-4), the experts of two layers swapped and the shared expert dropped land far
above.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402
from test_transformers import _source_modules  # noqa: E402  (this folder's test module: its source reader)

import megamoe_runtime.integrations.transformers  # noqa: E402,F401  (registers the quantizer)
from megamoe_runtime import calc_diff  # noqa: E402
from megamoe_runtime.errors import MegaMoEError  # noqa: E402

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "real"
TOL = 1e-6
FIXTURES = ("llmcompressor-fp8-block-deepseekv3", "llmcompressor-fp8-block-qwen3moe")


def _decode(t: dict) -> torch.Tensor:
    w = t["weight"]
    if w.dtype != torch.float8_e4m3fn:
        return w.double()
    s = t.get("weight_scale_inv", t.get("weight_scale")).double()
    n, k = w.shape
    s = s.reshape(-(-n // 128), -(-k // 128)).repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return w.double() * s


def _fp8(x: torch.Tensor, group: int, divide: bool) -> torch.Tensor:
    g = x.float().unflatten(-1, (-1, group))
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-10)
    s = amax / 448.0 if divide else amax * torch.tensor(1 / 448, dtype=torch.float32)
    q = (g * (1.0 / s)).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return (q * s.double()).flatten(-2)


def _sm90_like_experts(self, hidden_states, top_k_index, top_k_weights):
    quant = self._mm_quant
    x = _fp8(hidden_states, 128, True) if quant else hidden_states.double()
    out = torch.zeros(hidden_states.shape, dtype=torch.float64)
    for e in range(self.num_experts):
        tok, slot = torch.where(top_k_index == e)
        if tok.numel() == 0:
            continue
        g, u = (x[tok] @ self._mm_w13[e].t()).chunk(2, dim=-1)
        h = g * torch.sigmoid(g) * u * top_k_weights[tok, slot].double().unsqueeze(-1)
        if quant:
            h = _fp8(h, 64, False)
        out.index_add_(0, tok, (h @ self._mm_w2[e].t()).to(torch.bfloat16).double())
    return out.to(hidden_states.dtype)


transformers.integrations.moe.ExpertsInterface.register("megamoe_test_sm90_fp8", _sm90_like_experts)


def _reference(fixture: str):
    folder = REAL / fixture
    cfg = transformers.AutoConfig.from_pretrained(folder)
    cfg.quantization_config = None
    cfg._experts_implementation = "megamoe_test_sm90_fp8"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    mods = _source_modules(folder)
    with torch.no_grad():
        for name, p in model.state_dict(keep_vars=True).items():
            mod, suffix = name.rsplit(".", 1)
            if suffix in ("gate_up_proj", "down_proj") and ".experts" in mod:
                m = model.get_submodule(mod)
                n = p.shape[0]
                if suffix == "gate_up_proj":
                    m._mm_w13 = torch.stack([torch.cat([_decode(mods[f"{mod}.{e}.gate_proj"]),
                                                        _decode(mods[f"{mod}.{e}.up_proj"])]) for e in range(n)])
                else:
                    m._mm_w2 = torch.stack([_decode(mods[f"{mod}.{e}.down_proj"]) for e in range(n)])
                m._mm_quant = True
                continue
            if suffix == "weight" and mod in mods and "weight" in mods[mod]:
                p.copy_(_decode(mods[mod]).to(p.dtype))
            elif mod in mods and suffix in mods[mod]:
                p.copy_(mods[mod][suffix].to(p.dtype))
            else:
                raise AssertionError(f"{fixture}: no source tensor for {name}")
    return model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.fixture(scope="module")
def loaded(converted_real):
    made = {}

    def get(fixture):
        if fixture not in made:
            out = converted_real(fixture)
            assert json.loads((out / "megamoe.json").read_text())["row"] == "fp8_block"
            made[fixture] = (transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16),
                             _reference(fixture))
        return made[fixture]

    return get


def _ids(vocab):
    return torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fixture", FIXTURES)
def test_converted_block_fp8_matches_the_source_with_kernel_numerics(fixture, loaded):
    ours, ref = loaded(fixture)
    ids = _ids(ours.config.vocab_size)
    a, b = _logits(ours, ids), _logits(ref, ids)
    d = calc_diff(a, b)
    assert d < TOL, f"{fixture}: calc_diff {d}"
    gen = ours.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert gen.shape == (1, 16) and torch.equal(gen, ref.generate(ids[:1], max_new_tokens=6, do_sample=False))
    # negative control: the reference without the kernel's FP8 activations is visibly another model
    for m in ref.modules():
        if hasattr(m, "_mm_quant"):
            m._mm_quant = False
    try:
        assert calc_diff(a, _logits(ref, ids)) > 10 * TOL
    finally:
        for m in ref.modules():
            if hasattr(m, "_mm_quant"):
                m._mm_quant = True


def test_shared_expert_runs_outside_and_swapped_layers_fail(loaded):
    ours, ref = loaded("llmcompressor-fp8-block-deepseekv3")
    ids = _ids(ours.config.vocab_size)
    block = ours.model.layers[1].mlp
    assert block.megamoe.spec.shared is None and block.shared_experts is not None
    a = _logits(ours, ids)
    shared, block.shared_experts = block.shared_experts, None
    try:
        assert calc_diff(_logits(ours, ids), _logits(ref, ids)) > 100 * TOL
    finally:
        block.shared_experts = shared
    assert torch.equal(_logits(ours, ids), a)
    ours, ref = loaded("llmcompressor-fp8-block-qwen3moe")
    l0, l1 = ours.model.layers[0].mlp, ours.model.layers[1].mlp
    l0.megamoe, l1.megamoe = l1.megamoe, l0.megamoe
    try:
        assert calc_diff(_logits(ours, ids), _logits(ref, ids)) > 100 * TOL
    finally:
        l0.megamoe, l1.megamoe = l1.megamoe, l0.megamoe


def test_broken_producer_scale_of_a_dense_linear_is_refused(converted_real):
    """transformers 5.17's FineGrainedFP8 writes NaN weight_scale_inv for linears it cannot tile by 128 (here
    the MLA kv projections); loading names the linear instead of serving NaN logits."""
    out = converted_real("finegrained-fp8-deepseekv3")
    with pytest.raises(MegaMoEError, match=r"self_attn\.kv_a_proj_with_mqa: .*weight_scale_inv are not finite and "
                                           r"> 0, .*first at \[row block, col block\] = \[0, 0\] = nan"):
        transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
