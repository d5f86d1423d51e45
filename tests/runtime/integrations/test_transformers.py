"""transformers' ``from_pretrained`` on converted folders, proved against transformers' own forward.

* BF16 sources: the reference is transformers loading the SOURCE folder itself. Tolerance: logits
  calc_diff < 1e-4. Both sides compute in bf16; the kernels round at other points (bf16 per slot, fp32
  combine; docs/NUMERICS.md), which moves logits by ~1e-5 (measured 8e-6 .. 3e-5 here), not by a wrong weight.
* Quantized real exports: the reference is transformers' own model class with every weight decoded from the
  SOURCE export by this file's own decoder (not the project's codecs), and an experts implementation
  registered in transformers' ExpertsInterface that quantizes the expert inputs the way the kernels do
  (MXFP8 per 32 for the mx rows; NVFP4 per 16 with a per-token scale, then against a2, for nvfp4).
  The shared expert is run as the layer runs it fused: MXFP8 weights re-encoded from the export's and MXFP8
  activations. Tolerances (logits calc_diff): mx rows 1e-5 -- Qwen3 MXFP4/MXFP8 are bitwise equal (0.0);
  DeepSeek-V3 MXFP4 measures 4e-6 because the kernel sums the fused shared slot with the routed slots in
  fp32 before one bf16 rounding where transformers adds two bf16 outputs -- and nvfp4 5e-4 (measured
  1.5e-4 .. 1.9e-4: transformers' router folds routed scaling into each slot's weight, the kernel scales
  the combined output once, and this file's NVFP4 emulation rounds its own way at ties). Negative
  controls (experts of two layers swapped, routed scaling applied twice, the shared expert dropped, the
  activation quantization left out) land far above those.
* Greedy decoding: identical tokens over 8 steps for the BF16 sources (where logits agree to ~1e-5);
  for the quantized exports, identical until the reference's own top-2 margin is below the measured
  logit error (a tie the tolerance cannot order).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

import megamoe_runtime.integrations.transformers as mtf  # noqa: E402
from megamoe_runtime import calc_diff  # noqa: E402
from megamoe_runtime.errors import CheckpointError, MegaMoEError  # noqa: E402
from megamoe_runtime.integrations.transformers.blocks import MegaMoEBlock  # noqa: E402

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "real"

AutoModel = transformers.AutoModelForCausalLM
BF16_TOL = 1e-4
#: per row, logits calc_diff against the kernel-like transformers reference (see the module doc)
QUANT_TOL = {"mxfp4": 1e-5, "mxfp8": 1e-5, "nvfp4": 5e-4}


def _load(folder: Path, **kw):
    return AutoModel.from_pretrained(folder, dtype=torch.bfloat16, **kw)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _logits_and_routes(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits, and each MoE router's top-k expert ids per token (sorted), in the order the routers ran."""
    routes: list[torch.Tensor] = []

    def keep(module, args, out):
        if isinstance(out, tuple) and len(out) == 3:  # transformers' routers return (logits, weights, ids)
            routes.append(out[2].reshape(-1, out[2].shape[-1]).sort(-1).values)

    hooks = [m.register_forward_hook(keep) for n, m in model.named_modules() if n.endswith(".gate")]
    try:
        return _logits(model, ids), routes
    finally:
        for h in hooks:
            h.remove()


def _prompt(vocab: int, n: int = 2, t: int = 10, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, t), generator=g)


def _snapshot(folder: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


# --------------------------------------------------------------------------- BF16: transformers on the source


def test_bf16_source_matches_transformers_on_the_source(arch, converted_tiny):
    src, out = converted_tiny(arch)
    before = _snapshot(out)
    ours, ref = _load(out), _load(src)
    blocks = [m for m in ours.modules() if isinstance(m, MegaMoEBlock)]
    n_moe = len(json.loads((out / "megamoe.json").read_text())["layers"])
    assert len(blocks) == n_moe and all(b.megamoe.backend.name == "reference" for b in blocks)
    ids = _prompt(ours.config.vocab_size)
    (a, ra), (b, rb) = _logits_and_routes(ours, ids), _logits_and_routes(ref, ids)
    assert len(ra) == len(rb) == n_moe
    # a token whose top-k experts differ in some layer is a near-tie the two sides' bf16 roundings broke
    # differently (seen: one of 20 tokens of glm4_moe on an AMX CPU); it moves that token's logits by a whole
    # expert, so it is counted, bounded, and left out of the numerics check
    flipped = torch.zeros(ids.numel(), dtype=torch.bool)
    for x, y in zip(ra, rb):
        flipped |= (x != y).any(-1)
    assert int(flipped.sum()) <= max(1, ids.numel() // 10), f"{arch}: routing differs at {int(flipped.sum())} tokens"
    keep = ~flipped.reshape(ids.shape)
    d = calc_diff(a[keep], b[keep])
    assert d < BF16_TOL, f"{arch}: calc_diff {d} ({int(flipped.sum())} tokens routed differently left out)"
    forced = _greedy_agree(ours, ref, ids, 8, float((a - b).abs().max()))
    assert forced <= 2, f"{arch}: {forced} of 8 greedy steps were ties"
    if forced == 0:  # no near-tie on the way: generate() itself (KV cache, decode steps of one token) agrees
        gen = dict(max_new_tokens=8, do_sample=False)
        assert torch.equal(ours.generate(ids[:1], **gen), ref.generate(ids[:1], **gen))
    assert _snapshot(out) == before  # loading writes nothing into OUT


def test_relabeled_router_is_caught_by_the_routing_count(converted_tiny):
    """Negative control of the near-tie allowance above: a router whose expert order is reversed routes most
    tokens elsewhere, far past the one-in-ten tokens the comparison may leave out."""
    src, out = converted_tiny("glm4_moe")
    ours, ref = _load(out), _load(src)
    gate = ours.model.layers[1].mlp.gate
    with torch.no_grad():
        gate.weight.copy_(gate.weight.flip(0))
    ids = _prompt(ours.config.vocab_size)
    (_, ra), (_, rb) = _logits_and_routes(ours, ids), _logits_and_routes(ref, ids)
    assert int((ra[0] != rb[0]).any(-1).sum()) > ids.numel() // 10


def test_shared_expert_runs_fused_and_once(converted_tiny):
    src, out = converted_tiny("deepseek_v3")
    ours, ref = _load(out), _load(src)
    layer = ours.model.layers[1].mlp.megamoe
    assert layer.shared_fused and layer.spec.shared is not None
    ids = _prompt(ours.config.vocab_size)
    base = calc_diff(_logits(ours, ids), _logits(ref, ids))
    # negative control: the shared expert dropped from the reference must be seen
    for i in (1, 2):
        ref.model.layers[i].mlp.shared_experts.down_proj.weight.data.zero_()
    assert calc_diff(_logits(ours, ids), _logits(ref, ids)) > 10 * max(base, BF16_TOL)


def test_routed_scaling_applied_once(converted_tiny):
    """The router's own factor is moved into the kernel (set to 1.0 there); a router left scaling as well
    (twice in all) is caught."""
    src, out = converted_tiny("deepseek_v3")
    ours, ref = _load(out), _load(src)
    gate = ours.model.layers[1].mlp.gate
    assert gate.routed_scaling_factor == 1.0 and ours.model.layers[1].mlp.megamoe.spec.routed_scaling_factor == 2.5
    ids = _prompt(ours.config.vocab_size)
    base = calc_diff(_logits(ours, ids), _logits(ref, ids))
    for i in (1, 2):
        ours.model.layers[i].mlp.gate.routed_scaling_factor = 2.5
    assert calc_diff(_logits(ours, ids), _logits(ref, ids)) > 10 * max(base, BF16_TOL)


def test_experts_of_two_layers_swapped_are_caught(converted_tiny):
    src, out = converted_tiny("qwen3_moe")
    ours, ref = _load(out), _load(src)
    ids = _prompt(ours.config.vocab_size)
    base = calc_diff(_logits(ours, ids), _logits(ref, ids))
    a, b = ours.model.layers[0].mlp, ours.model.layers[1].mlp
    a.megamoe, b.megamoe = b.megamoe, a.megamoe
    assert calc_diff(_logits(ours, ids), _logits(ref, ids)) > 10 * max(base, BF16_TOL)


# --------------------------------------------------------------------------- quantized real exports

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_E2M1_GRID = _E2M1[:8]


def _fp4(packed: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).to(torch.int64)
    return torch.stack([_E2M1[b & 15], _E2M1[b >> 4]], dim=-1).flatten(-2)  # low nibble = even element


def _decode(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """This file's own decoder of one stored projection (REFERENCE of the formats, docs/FORMATS.md)."""
    w = t.get("weight_packed", t.get("weight"))
    if w.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return w.float()
    ws = t["weight_scale"]
    if ws.dtype == torch.uint8:  # MX: 2^(s-127) per 32
        vals = _fp4(w) if w.dtype == torch.uint8 else w.float()
        return (vals.unflatten(-1, (-1, 32)) * torch.exp2(ws.float() - 127).unsqueeze(-1)).flatten(-2)
    vals = _fp4(w)
    block = ws.float()
    if "weight_scale_2" in t:
        block = block * t["weight_scale_2"].float()
    else:
        block = block / t["weight_global_scale"].float()
    group = vals.shape[-1] // block.shape[-1]
    return (vals.unflatten(-1, (-1, group)) * block.unsqueeze(-1)).flatten(-2)


def _source_modules(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    mods: dict[str, dict[str, torch.Tensor]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                mod, suffix = k.rsplit(".", 1)
                mods.setdefault(mod, {})[suffix] = h.get_tensor(k)
    return mods


def _mxfp8_qdq(x: torch.Tensor) -> torch.Tensor:
    g = x.float().unflatten(-1, (-1, 32))
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).flatten(-2)


def _e2m1_round(y: torch.Tensor) -> torch.Tensor:
    mag = y.abs().clamp_max(6.0)
    idx = (mag.unsqueeze(-1) - _E2M1_GRID).abs().argmin(-1)
    return _E2M1_GRID[idx] * torch.sign(y)


def _nvfp4_qdq(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 per 16 against ``global_scale`` (per row or scalar): E4M3 block scale of amax/6."""
    g = x.float().unflatten(-1, (-1, 16)) / global_scale.reshape(-1, 1, 1)
    sf = (g.abs().amax(-1, keepdim=True) / 6.0).clamp_min(2.0 ** -9).to(torch.float8_e4m3fn).float()
    return (_e2m1_round(g / sf) * sf * global_scale.reshape(-1, 1, 1)).flatten(-2)


def _kernel_like_experts(self, hidden_states, top_k_index, top_k_weights):
    """An ExpertsInterface function: transformers' experts with the kernels' activation quantization."""
    row, a2 = self._mm_row, self._mm_a2
    x = hidden_states.float()
    if row == "nvfp4":
        tok = (x.abs().amax(-1).clamp_min(1e-12) / 2688.0)
        x = _nvfp4_qdq(x, tok)
    elif row != "bf16":
        x = _mxfp8_qdq(x)
    out = torch.zeros_like(x)
    for e in range(self.num_experts):
        tok_idx, slot = torch.where(top_k_index == e)
        if tok_idx.numel() == 0:
            continue
        h = x[tok_idx] @ self.gate_up_proj[e].float().t()
        g, u = h.chunk(2, dim=-1)
        g, u = g.to(torch.bfloat16).float(), u.to(torch.bfloat16).float()
        a = torch.nn.functional.silu(g) * u
        w = top_k_weights[tok_idx, slot].float().unsqueeze(-1)
        if row == "nvfp4":
            a = _nvfp4_qdq(a, a2)
            y = ((a @ self.down_proj[e].float().t()).to(torch.bfloat16).float() * w).to(torch.bfloat16).float()
        else:
            a = _mxfp8_qdq(a * w)
            y = (a @ self.down_proj[e].float().t()).to(torch.bfloat16).float()
        out.index_add_(0, tok_idx, y)
    return out.to(hidden_states.dtype)


transformers.integrations.moe.ExpertsInterface.register("megamoe_test_kernel_like", _kernel_like_experts)


def _reference_model(fixture: str, row: str, a2: float):
    """transformers' model class of the export, every weight decoded from the export by `_decode`."""
    folder = REAL / fixture
    cfg = transformers.AutoConfig.from_pretrained(folder)
    cfg.quantization_config = None
    cfg._experts_implementation = "megamoe_test_kernel_like"
    torch.manual_seed(0)
    model = AutoModel.from_config(cfg, dtype=torch.bfloat16)  # as from_pretrained builds it: buffers (rotary) stay fp32
    mods = _source_modules(folder)
    with torch.no_grad():
        for name, p in model.state_dict(keep_vars=True).items():
            mod, suffix = name.rsplit(".", 1)
            if suffix in ("gate_up_proj", "down_proj") and ".experts" in mod:
                n_exp = p.shape[0]
                ws = []
                for e in range(n_exp):
                    if suffix == "gate_up_proj":
                        ws.append(torch.cat([_decode(mods[f"{mod}.{e}.gate_proj"]), _decode(mods[f"{mod}.{e}.up_proj"])]))
                    else:
                        ws.append(_decode(mods[f"{mod}.{e}.down_proj"]))
                setattr(model.get_submodule(mod), suffix, torch.nn.Parameter(torch.stack(ws), requires_grad=False))
                continue
            if suffix == "weight" and mod in mods and "weight_scale" in mods[mod]:
                p.copy_(_decode(mods[mod]).to(p.dtype))
            elif name in {f"{m}.{s}" for m in mods for s in mods[m]}:
                p.copy_(mods[mod][suffix].to(p.dtype))
            else:
                raise AssertionError(f"{fixture}: no source tensor for {name}")
    for m in model.modules():
        if hasattr(m, "gate_up_proj"):
            m._mm_row, m._mm_a2 = row, torch.tensor(a2)
    for name, m in model.named_modules():
        if name.endswith("shared_experts") and row != "bf16":
            _kernel_like_shared(m, {p: _decode(mods[f"{name}.{p}"]) for p in ("gate_proj", "up_proj", "down_proj")})
    return model.eval()


def _kernel_like_shared(mlp, w: dict) -> None:
    """The shared MLP as the layer runs it fused on the quantized rows: MXFP8 weights (the export's decoded
    weights re-encoded per 32, as the converter does for a row that fuses MXFP8 shared experts) and MXFP8
    activations, bf16 g/u and output."""
    mlp._w13 = _mxfp8_qdq(torch.cat([w["gate_proj"], w["up_proj"]]))
    mlp._w2 = _mxfp8_qdq(w["down_proj"])

    def forward(x):
        h = _mxfp8_qdq(x.float()) @ mlp._w13.t()
        g, u = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(g.to(torch.bfloat16).float()) * u.to(torch.bfloat16).float()
        return (_mxfp8_qdq(a) @ mlp._w2.t()).to(x.dtype)

    mlp.forward = forward


#: real exports covering the rows and producers (DeepSeek-V3 with shared experts; Qwen3 with two MoE layers)
QUANTIZED = ("modelopt-nvfp4-deepseekv3", "quark-mxfp4-deepseekv3", "llmcompressor-nvfp4-deepseekv3",
             "modelopt-mxfp8-qwen3moe", "modelopt-mxfp4-qwen3moe")


def _greedy_agree(ours, ref, ids, steps: int, err: float) -> int:
    """Teacher-forced greedy over ``steps`` tokens: every step's argmax equal, unless the reference's top-2
    margin is within twice the measured logit error (a tie neither side can be said to break right).
    Returns how many steps were such ties."""
    seq, ties = ids[:1], 0
    for _ in range(steps):
        a, b = _logits(ours, seq)[0, -1], _logits(ref, seq)[0, -1]
        top2 = b.topk(2).values
        if int(a.argmax()) != int(b.argmax()):
            margin = float(top2[0] - top2[1])
            assert margin <= 2 * err, f"greedy tokens differ ({int(a.argmax())} vs {int(b.argmax())}) at a margin {margin}"
            ties += 1
        seq = torch.cat([seq, b.argmax().reshape(1, 1)], dim=1)
    return ties


@pytest.mark.parametrize("fixture", QUANTIZED)
def test_quantized_export_matches_transformers_with_kernel_activations(fixture, converted_real):
    out = converted_real(fixture)
    ours = _load(out)
    m = json.loads((out / "megamoe.json").read_text())
    a2 = m["layers"][0]["scalars"].get("l2_activation_scale", 1.0)
    ref = _reference_model(fixture, m["row"], a2)
    ids = _prompt(ours.config.vocab_size)
    a, b = _logits(ours, ids), _logits(ref, ids)
    d, tol = calc_diff(a, b), QUANT_TOL[m["row"]]
    assert d < tol, f"{fixture}: calc_diff {d}"
    assert _greedy_agree(ours, ref, ids, 6, float((a - b).abs().max())) <= 1
    # negative control: the kernels' activation quantization left out of the routed experts is visible
    for mod in ref.modules():
        if hasattr(mod, "_mm_row"):
            mod._mm_row = "bf16"
    d_plain = calc_diff(a, _logits(ref, ids))
    assert d_plain > 4 * tol, f"{fixture}: {d_plain} vs {d}"


def test_quantized_swapped_layers_and_double_scaling_fail(converted_real):
    out = converted_real("quark-mxfp4-deepseekv3")
    ours = _load(out)
    ref = _reference_model("quark-mxfp4-deepseekv3", "mxfp4", 1.0)
    ids = _prompt(ours.config.vocab_size)
    base = calc_diff(_logits(ours, ids), _logits(ref, ids))
    assert base < QUANT_TOL["mxfp4"]
    ours.model.layers[1].mlp.gate.routed_scaling_factor = 2.5
    assert calc_diff(_logits(ours, ids), _logits(ref, ids)) > 100 * QUANT_TOL["mxfp4"]
    out = converted_real("modelopt-mxfp4-qwen3moe")
    ours = _load(out)
    ref = _reference_model("modelopt-mxfp4-qwen3moe", "mxfp4", 1.0)
    assert calc_diff(_logits(ours, ids), _logits(ref, ids)) == 0.0  # Qwen3 MXFP4: bitwise, logits and all
    a, b = ours.model.layers[0].mlp, ours.model.layers[1].mlp
    a.megamoe, b.megamoe = b.megamoe, a.megamoe
    assert calc_diff(_logits(ours, ids), _logits(ref, ids)) > 100 * QUANT_TOL["mxfp4"]


# --------------------------------------------------------------------------- bad input


def _copy(out: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(out, dst)
    return dst


def _with_config(out: Path, tmp_path: Path, **changes) -> Path:
    """A copy of OUT whose config.json says ``changes`` (a manifest that no longer describes it)."""
    bad = _copy(out, tmp_path)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(changes)
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


def test_not_a_megamoe_folder(converted_tiny, tmp_path):
    _, out = converted_tiny("qwen3_moe")
    bad = _copy(out, tmp_path)
    (bad / "megamoe.json").unlink()
    with pytest.raises(CheckpointError, match="not a megamoe output folder"):
        _load(bad)


def test_manifest_of_another_model(converted_tiny, tmp_path):
    _, out = converted_tiny("qwen3_moe")
    bad = _with_config(out, tmp_path, moe_intermediate_size=64)
    with pytest.raises(CheckpointError, match=r"expert intermediate 128 in megamoe.json, 64 in config.json"):
        _load(bad)


def test_missing_shard_refused_before_any_allocation(converted_tiny, tmp_path, monkeypatch):
    _, out = converted_tiny("deepseek_v3")
    bad = _copy(out, tmp_path)
    shard = next(bad.glob("megamoe-experts-*.safetensors"))
    shard.unlink()
    from megamoe_runtime.load import checkpoint
    real_alloc, built = checkpoint.Checkpoint.allocate_layer, []

    def alloc(self, index, device="cpu", *a, **k):  # the dry run's meta layers are fine; a real one is not
        if torch.device(device).type != "meta":
            built.append(index)
        return real_alloc(self, index, device, *a, **k)

    monkeypatch.setattr(checkpoint.Checkpoint, "allocate_layer", alloc)
    with pytest.raises(CheckpointError, match=shard.name):
        _load(bad)
    assert not built


def test_unknown_architecture(converted_tiny, tmp_path, monkeypatch):
    _, out = converted_tiny("qwen3_moe")
    from megamoe_runtime.integrations.transformers import blocks
    monkeypatch.delitem(blocks.MOE_BLOCKS, "Qwen3MoeSparseMoeBlock")
    with pytest.raises(CheckpointError, match="not a MoE block the megamoe integration knows"):
        _load(out)


def test_routed_scaling_disagreeing_with_the_manifest(converted_tiny, tmp_path):
    _, out = converted_tiny("glm4_moe")
    bad = _with_config(out, tmp_path, routed_scaling_factor=3.0)
    with pytest.raises(CheckpointError, match="routed_scaling_factor is 3.0 in config.json but 1.5 in megamoe.json"):
        _load(bad)


def test_backend_named_and_validated(converted_tiny, monkeypatch):
    _, out = converted_tiny("qwen3_moe")
    model = _load(out, quantization_config=mtf.MegaMoEConfig(backend="reference"))
    assert model.model.layers[0].mlp.megamoe.backend.name == "reference"
    with pytest.raises(ValueError, match="backend 'cuda-magic' is unknown"):
        mtf.MegaMoEConfig(backend="cuda-magic")
    with pytest.raises(ValueError, match="verify level 'all' is unknown"):
        mtf.MegaMoEConfig(verify="all")
    monkeypatch.setenv("MEGAMOE_BACKEND", "reference")
    assert mtf.MegaMoEConfig().backend == "reference"


def test_users_loading_attributes_win_without_a_warning(converted_tiny, monkeypatch):
    """The environment names a backend this CPU cannot run; the user's config names the reference: the user's
    is used (else the load fails), and transformers' "will be overwritten ... ignored" warning is not given."""
    import warnings

    _, out = converted_tiny("qwen3_moe")
    monkeypatch.setenv("MEGAMOE_BACKEND", "triton")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = _load(out, quantization_config=mtf.MegaMoEConfig(backend="reference", verify="checksums"))
    assert model.model.layers[0].mlp.megamoe.backend.name == "reference"
    assert model.hf_quantizer.checkpoint.verify == "checksums"
    assert model.config.quantization_config.backend == "reference"


def _flip_expert_byte(out: Path, tmp_path: Path) -> Path:
    bad = _copy(out, tmp_path)
    shard = next(bad.glob("megamoe-experts-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40  # a weight byte (the header is at the front)
    shard.write_bytes(bytes(data))
    return bad


def test_verify_checksums_through_from_pretrained_catches_a_flipped_byte(converted_tiny, tmp_path, monkeypatch):
    _, out = converted_tiny("qwen3_moe")
    bad = _flip_expert_byte(out, tmp_path)
    _load(bad)  # the default level reads headers only: the flip is not seen (what verify="checksums" is for)
    with pytest.raises(MegaMoEError, match="checksum|sha256|blake3"):
        _load(bad, quantization_config=mtf.MegaMoEConfig(verify="checksums"))
    monkeypatch.setenv("MEGAMOE_VERIFY", "checksums")
    with pytest.raises(MegaMoEError, match="checksum|sha256|blake3"):
        _load(bad)


@pytest.mark.parametrize("edit", ["quant_method", "dropped"])
def test_megamoe_folder_whose_config_lost_the_method_is_refused(converted_tiny, tmp_path, edit):
    """With the integration imported, a folder holding megamoe.json never loads with random experts."""
    _, out = converted_tiny("qwen3_moe")
    bad = _copy(out, tmp_path)
    cfg = json.loads((bad / "config.json").read_text())
    if edit == "dropped":
        del cfg["quantization_config"]
    else:
        cfg["quantization_config"]["quant_method"] = "fp8"
    (bad / "config.json").write_text(json.dumps(cfg))
    want = "is missing" if edit == "dropped" else "names quant_method 'fp8'"
    with pytest.raises(CheckpointError, match=f"holds megamoe.json .*{want}.* experts would be random") as e:
        _load(bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fixture", ["modelopt-nvfp4-qwen3moe", "quark-mxfp8-qwen3moe",
                                     "llmcompressor-nvfp4-qwen3moe"])
def test_source_export_names_the_converter(fixture):
    """A producer's MoE export opened directly: the error says to convert it (transformers alone gives a
    size-mismatch report for ModelOpt, and the producer package's ImportError for the others)."""
    with pytest.raises((CheckpointError, ImportError)) as e:
        _load(REAL / fixture)
    assert f"megamoe-convert convert {REAL / fixture} OUT" in str(e.value)
    assert "\n" not in str(e.value)


def test_block_unloaded_says_so():
    block = MegaMoEBlock(torch.nn.Identity(), 3, "X")
    with pytest.raises(MegaMoEError, match="never loaded"):
        block(torch.zeros(1, 2, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fixture", ["quark-mxfp4-deepseekv3", "modelopt-nvfp4-deepseekv3"])
def test_gpu_from_pretrained_matches_the_cpu_model(fixture, converted_real):
    """On the GPU the backend follows the device (triton on Hopper): each MoE block equals the CPU model's on
    the same hidden states (the triton backend is exact against the reference), and the whole model stays
    close to the CPU one (its other layers run on cuBLAS, so near-tie routing may differ)."""
    out = converted_real(fixture)
    cpu, gpu = _load(out), _load(out, device_map="cuda")
    layer = gpu.model.layers[1].mlp.megamoe
    assert layer.device.type == "cuda" and layer.backend.name in ("triton", "deepgemm")
    x = (torch.randn(1, 48, cpu.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.5)
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        y_cpu = cpu.model.layers[1].mlp(x).float()
        y_gpu = gpu.model.layers[1].mlp(x.cuda()).float().cpu()
    assert calc_diff(y_gpu, y_cpu) < 1e-6
    ids = _prompt(cpu.config.vocab_size)
    d = calc_diff(_logits(gpu, ids.cuda()).cpu(), _logits(cpu, ids))
    assert d < 1e-3, d  # measured 2.1e-4 (nvfp4): cuBLAS vs CPU bf16 attention, amplified by routing
    gen = dict(max_new_tokens=6, do_sample=False)
    assert gpu.generate(ids[:1].cuda(), **gen).shape == (1, 16)


def _moe_ops(graphs: list) -> int:
    op = torch.ops.megamoe.routed_experts
    return sum(1 for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and n.target in (op, op.default))


def test_static_cache_generate_compiles_whole_graph(converted_tiny):
    """generate(cache_implementation="static") compiles the forward when the quantizer allows it (on a GPU by
    default, with CUDA graphs): the megamoe blocks trace as one op each with no graph break, and the tokens are
    eager generate's."""
    _, out = converted_tiny("deepseek_v3")
    model = _load(out)
    assert model.hf_quantizer.is_compileable
    n_moe = sum(isinstance(m, MegaMoEBlock) for m in model.modules())
    ids = _prompt(model.config.vocab_size)[:1]
    gen = dict(max_new_tokens=6, do_sample=False)
    want = model.generate(ids, **gen)
    graphs: list = []

    def backend(gm, example_inputs, **options):  # transformers passes its mode; a recorder has none to use
        graphs.append(gm)
        return gm.forward

    cc = transformers.CompileConfig(backend=backend, fullgraph=True)
    cc._compile_all_devices = True  # transformers compiles on accelerators only unless told
    torch._dynamo.reset()
    try:
        got = model.generate(ids, cache_implementation="static", compile_config=cc, **gen)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, want)
    assert graphs and all(_moe_ops([g]) == n_moe for g in graphs), [_moe_ops([g]) for g in graphs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_static_cache_generate_under_cuda_graphs(converted_real):
    """On the GPU a static-cache generate compiles and replays CUDA graphs around the triton layer.

    Exact part: dynamo's ``cudagraphs`` backend (the eager kernels, recorded and replayed as CUDA graphs) gives
    the tokens of the same static-cache generate run uncompiled, on both the recording and a replaying call.
    transformers' own default (inductor, "reduce-overhead") generates other kernels for attention and norms, so
    its bits differ from eager for any model (measured: also transformers' bf16 model, bench/serve.py); there the
    first step's logits must stay close to eager's."""
    gpu = _load(converted_real("quark-mxfp4-deepseekv3"), device_map="cuda")
    ids = _prompt(gpu.config.vocab_size)[:1].cuda()
    gen = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
    want = gpu.generate(ids, disable_compile=True, **gen)
    from torch._dynamo.backends.registry import lookup_backend

    cudagraphs = lookup_backend("cudagraphs")
    cc = transformers.CompileConfig(backend=lambda gm, example_inputs, **mode: cudagraphs(gm, example_inputs),
                                    fullgraph=True)  # transformers passes a mode this backend does not take
    torch._dynamo.reset()
    for _ in range(2):  # the first call records, the second replays
        assert torch.equal(gpu.generate(ids, compile_config=cc, **gen), want)
    torch._dynamo.reset()
    scores = dict(output_logits=True, return_dict_in_generate=True)
    ref = gpu.generate(ids, disable_compile=True, **gen, **scores).logits[0].float()
    for _ in range(2):
        got = gpu.generate(ids, **gen, **scores).logits[0].float()  # transformers' default compile
        assert calc_diff(got, ref) < 1e-3


def _hub_snapshot(out: Path, cache: Path, repo_id: str, commit: str) -> Path:
    """A hub cache entry for ``repo_id`` at ``commit`` holding OUT's files but megamoe.json (what transformers
    downloads of a converted repo), laid out as huggingface_hub lays it out."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    shutil.copytree(out, snap)
    (snap / "megamoe.json").unlink()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap


def test_hub_repo_fetches_the_manifest_of_the_same_revision(converted_tiny, tmp_path, monkeypatch):
    """A converted folder published on the hub: transformers fetches config and shards but not megamoe.json;
    the integration fetches it for the same commit. (Offline here: a hub cache snapshot is laid out by hand,
    and hf_hub_download is replaced by a copy that records what it was asked.)"""
    import huggingface_hub

    _, out = converted_tiny("qwen3_moe")
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = _hub_snapshot(out, tmp_path / "hub", "org/tiny-megamoe", commit)
    asked = []

    def fake_download(repo_id, filename, revision=None, cache_dir=None, **kw):
        asked.append((repo_id, filename, revision, Path(cache_dir)))
        shutil.copyfile(out / filename, snap / filename)
        return str(snap / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    model = _load("org/tiny-megamoe", cache_dir=tmp_path / "hub", local_files_only=True)
    assert asked == [("org/tiny-megamoe", "megamoe.json", commit, tmp_path / "hub")]
    assert model.model.layers[0].mlp.megamoe is not None


def test_hub_repo_without_a_manifest_is_refused_in_one_line(converted_tiny, tmp_path, monkeypatch):
    import huggingface_hub

    _, out = converted_tiny("qwen3_moe")
    commit = "f" * 40
    _hub_snapshot(out, tmp_path / "hub", "org/not-converted", commit)

    def missing(*a, **k):
        raise FileNotFoundError("404 Client Error.\n\nEntry Not Found for url: https://...")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing)
    with pytest.raises(CheckpointError, match=r"org/not-converted: could not fetch megamoe.json of revision f{40} "
                                              r"from the hub \(FileNotFoundError: 404 Client Error.\)"):
        _load("org/not-converted", cache_dir=tmp_path / "hub", local_files_only=True)
