"""Non-expert (pass-through) tensors copied unchanged: a plain float one (F16 / BF16 / F32: attention, norms,
embeddings, the router, a quantized linear's bias) holding NaN or inf is refused in one line naming the tensor, its
file, how many values, the first one's index and value, and nothing is left under OUT. Before, it was copied into
the output and served. What is not checked, on purpose (`checks.passthrough_checked`): quantized bytes (F8, U8)
and the float scales of a linear stored quantized, which the engine integration's decode checks (a producer may
leave a NaN weight_scale_inv on a linear it could not tile: docs/CHECKPOINTS.md)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megamoe_convert.pipeline import checks
from megamoe_convert.pipeline.convert import convert
from megamoe_convert.testing import synth

SIZES = dict(num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)


def _plant(value, dtype=None, at=((1, 7), (3, 1))):
    def put(w):
        w = w if dtype is None else w.to(dtype)
        for i in at:
            w[i] = value
        return w
    return put


@pytest.mark.parametrize("fmt, name, dtype, value", [
    ("bf16", "model.embed_tokens.weight", None, float("nan")),
    ("bf16", "model.layers.1.self_attn.o_proj.weight", torch.float16, float("inf")),
    ("modelopt-nvfp4", "model.layers.0.mlp.gate.weight", torch.float32, float("-inf")),
    ("fp8-block", "lm_head.weight", None, float("nan")),
])
def test_non_finite_passthrough_tensor_is_refused(tmp_path, edit_source, refused_convert, fmt, name, dtype, value):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", fmt, **SIZES, seed=2)
    edit_source(src, _plant(value, dtype), name)
    err = refused_convert(src, tmp_path / "out")
    file = next(src.glob("*.safetensors")).name
    shown = str(dtype or torch.bfloat16)
    cols = load_file(src / file)[name].shape[1]
    for part in (f"non-expert tensor {name} in {file} ({shown}) holds 2 non-finite value(s)",
                 f"first at [1, 7] = {value!r} (flat index {cols + 7})", "fix the source"):
        assert part in err, f"{part!r} not in {err!r}"


def test_norm_with_one_bad_value_is_refused(tmp_path, edit_source, refused_convert):
    """A 1-D tensor, the bad value its last element."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "bf16", **SIZES, seed=2)
    name = "model.norm.weight"
    edit_source(src, _plant(float("inf"), at=((SIZES["hidden"] - 1,),)), name)
    err = refused_convert(src, tmp_path / "out")
    assert f"{name} in " in err and f"holds 1 non-finite value(s); first at [255] = inf (flat index 255)" in err, err


def _fp8_q_proj(scale: float, bias: float | None):
    """Layer 0's q_proj stored block FP8 (E4M3 bytes with a NaN byte, one fp32 scale per 128x128 block) with a
    BF16 bias: a quantized linear among the pass-through tensors."""
    def put(t):
        p = "model.layers.0.self_attn.q_proj"
        g = torch.Generator().manual_seed(1)
        b = torch.randint(0, 0x7E, t[f"{p}.weight"].shape, dtype=torch.uint8, generator=g)
        b[0, 0] = 0x7F  # E4M3 NaN: quantized bytes are the decode's to check
        t[f"{p}.weight"] = b.view(torch.float8_e4m3fn)
        t[f"{p}.weight_scale_inv"] = torch.full((2, 2), 0.01)
        t[f"{p}.weight_scale_inv"][1, 1] = scale
        t[f"{p}.bias"] = torch.zeros(t[f"{p}.weight"].shape[0], dtype=torch.bfloat16)
        if bias is not None:
            t[f"{p}.bias"][3] = bias
        t["model.layers.0.self_attn.packed_extra"] = torch.full((4,), 0xFF, dtype=torch.uint8)
    return put


def test_quantized_linear_scales_and_bytes_are_copied_unchecked(tmp_path, edit_source):
    """A NaN block scale of a linear stored quantized converts, bytes unchanged (transformers' FineGrainedFP8
    writes them; the transformers integration refuses that linear at load, tests/runtime/integrations/
    test_transformers_fp8_block.py), and so do E4M3 NaN bytes and U8 bytes."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "bf16", **SIZES, seed=2)
    edit_source(src, _fp8_q_proj(float("nan"), None))
    convert(src, tmp_path / "out")
    got = {}
    for f in (tmp_path / "out").glob("model-*.safetensors"):
        got.update(load_file(f))
    want = load_file(next(src.glob("*.safetensors")))
    for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv",
              "model.layers.0.self_attn.packed_extra"):
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


def test_quantized_linear_bias_is_checked(tmp_path, edit_source, refused_convert):
    """The bias of a quantized linear is a plain float the engine adds as it is: checked."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "bf16", **SIZES, seed=2)
    edit_source(src, _fp8_q_proj(0.01, float("nan")))
    err = refused_convert(src, tmp_path / "out")
    assert "non-expert tensor model.layers.0.self_attn.q_proj.bias in " in err and "first at [3] = nan" in err, err


def test_which_tensors_are_checked():
    dtypes = {
        "model.norm.weight": "BF16", "lm_head.weight": "F16", "rotary.inv_freq": "F32", "x.y": "F64",
        "a.q_proj.weight": "F8_E4M3", "a.q_proj.weight_scale_inv": "F32", "a.q_proj.bias": "BF16",
        "a.k_proj.weight_packed": "U8", "a.k_proj.weight_scale": "F8_E4M3", "a.k_proj.weight_global_scale": "F32",
        "a.o_proj.weight": "U8", "a.o_proj.weight_scale": "F8_E4M3", "a.o_proj.weight_scale_2": "F32",
        "a.o_proj.input_scale": "F32", "b.ids": "I64", "b.mask": "BOOL", "b.e5m2": "F8_E5M2",
    }
    got = checks.passthrough_checked(dtypes)
    assert got == {"model.norm.weight": torch.bfloat16, "lm_head.weight": torch.float16,
                   "rotary.inv_freq": torch.float32, "x.y": torch.float64, "a.q_proj.bias": torch.bfloat16}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_chunks_that_split_an_element_are_checked_across_the_split(tmp_path, dtype):
    """Chunks need not end on an element boundary: the tail of one is checked with the head of the next."""
    x = torch.linspace(-3, 3, 300, dtype=torch.float64).to(dtype).reshape(20, 15)
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * 8 + x.view(torch.uint8).numpy().tobytes())
    item = x.element_size()

    def chunks(data: bytes, cut: int):
        return [memoryview(bytearray(data[i:i + cut])) for i in range(0, len(data), cut)]

    data = x.view(torch.uint8).numpy().tobytes()
    cut = 7 * item + 1  # every chunk ends inside an element
    out = b"".join(bytes(c) for c in checks.finite_passthrough_chunks(chunks(data, cut), dtype, "t", path, 8,
                                                                      tuple(x.shape)))
    assert out == data
    bad = x.clone()
    flat = 3 * cut // item  # the element the third cut splits
    bad.view(-1)[flat] = float("nan")
    path.write_bytes(b"\0" * 8 + bad.view(torch.uint8).numpy().tobytes())
    data = bad.view(torch.uint8).numpy().tobytes()
    with pytest.raises(Exception, match=rf"non-expert tensor t in t.bin \({dtype}\) holds 1 non-finite value\(s\); "
                                        rf"first at \[{flat // 15}, {flat % 15}\] = nan \(flat index {flat}\)"):
        for _ in checks.finite_passthrough_chunks(chunks(data, cut), dtype, "t", path, 8, tuple(x.shape)):
            pass
