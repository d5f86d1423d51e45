"""Tiny synthetic MoE checkpoints in every source format.

Used by ``megamoe-convert demo``, the tests and the benchmarks, so every part
of the converter is exercised on the same bytes without downloading
anything. The files follow the real producers' conventions (names, dtypes,
shapes, quantization configs; docs/CHECKPOINTS.md#source-formats) and the experts are
quantized with the reference quantizers of ``megamoe_runtime.format.codecs``. Each
format's encoder and quantization config are its reader's (``encode_expert``,
``encode_shared``, ``synthetic_quant_config``), next to the code that reads
them back; this module builds the model around them (names, config, shards).

The float weights are a pure function of ``(seed, layer, expert)``
(:func:`synthetic_expert_weights`), so a test can compare what a reader
dequantizes against the values that were quantized.

Defects for the bad-input tests are injected by keyword (each takes one
tuple or a list of tuples): ``missing_expert=(layer, expert)``,
``nan_scale`` / ``zero_scale`` / ``ff_scale=(layer, expert, role)``,
``scale_mismatch=(layer, expert)`` (NVFP4: gate and up quantized with their
own global scales, up scaled by ``mismatch_factor``), ``wrong_shape=(layer,
expert, role)`` (weight one row short), ``excluded_layer=layer`` (that
layer's routed experts stored unquantized, listed in the ignore list).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megamoe_runtime.format.source_formats import SUFFIX_KINDS

from ..readers import CheckpointReader, readers_in_order

#: every synthetic format, in the order ``demo --format`` and errors list them. Each is one of a
#: reader's ``synthetic_formats``, and that reader encodes it (a test checks both ways).
FORMATS = (
    "modelopt-nvfp4",
    "modelopt-mxfp4",
    "modelopt-mxfp8",
    "quark-mxfp4",
    "quark-nvfp4",
    "quark-mxfp8",
    "ct-nvfp4",
    "ct-mxfp4",
    "ct-mxfp8",
    "bf16",
    "fp16",
    "fp32",
    "bf16-fused",
    "deepseek-v4",
    "fp8-block",
    "ct-fp8-block",
)


def _encoders() -> dict[str, type[CheckpointReader]]:
    """synthetic format -> the reader class that encodes it (``synthetic_formats``)."""
    return {f: cls for cls in readers_in_order() for f in cls.synthetic_formats}


ENCODER_OF = _encoders()
#: source format -> the row its experts map onto
ROW_OF = {f: ENCODER_OF[f].synthetic_row(f) for f in FORMATS}
_ROLES = ("gate", "up", "down")
_HF_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_W_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}


def _as_list(v: Any) -> list[tuple]:
    if v is None:
        return []
    if isinstance(v, list):
        return [tuple(x) if isinstance(x, (tuple, list)) else (x,) for x in v]
    return [tuple(v) if isinstance(v, (tuple, list)) else (v,)]


def _gen(seed: int, *key: int) -> torch.Generator:
    s = seed * 1_000_003
    for k in key:
        s = (s * 31 + int(k) + 7) % (2**62)
    return torch.Generator().manual_seed(s)


def synthetic_expert_weights(
    seed: int, layer: int, expert: int, hidden: int, intermediate: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 (gate [I, H], up [I, H], down [H, I]) of one synthetic expert.

    Magnitudes vary per expert and per row so block scales differ (a test of
    scale handling, not just of bytes)."""
    g = _gen(seed, layer, 1000 + expert)
    amp = 0.02 * (1.0 + 0.25 * (expert % 5))
    gate = torch.randn(intermediate, hidden, generator=g) * amp
    up = torch.randn(intermediate, hidden, generator=g) * amp * 0.8
    down = torch.randn(hidden, intermediate, generator=g) * amp * 1.2
    row_amp = 1.0 + torch.rand(intermediate, 1, generator=g)
    return gate * row_amp, up, down


def synthetic_shared_weights(
    seed: int, layer: int, hidden: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(seed, layer, 77)
    return (
        torch.randn(width, hidden, generator=g) * 0.03,
        torch.randn(width, hidden, generator=g) * 0.03,
        torch.randn(hidden, width, generator=g) * 0.03,
    )


def synthetic_input_scale(seed: int, layer: int, expert: int, role: str) -> float:
    """The calibrated NVFP4 activation scale (multiplier) written for a projection;
    gate and up share one (fused input), down varies per expert."""
    g = _gen(seed, layer, 5000 + expert, 0 if role in ("gate", "up") else 1)
    amax = 2.0 + 6.0 * float(torch.rand(1, generator=g))
    return float(torch.tensor(amax / 2688.0, dtype=torch.float32))


# ----------------------------------------------------------------------------- building


class _Builder:
    def __init__(self, fmt: str, seed: int, naming: str) -> None:
        self.fmt = fmt
        self.seed = seed
        self.naming = naming
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        assert name not in self.tensors, name
        self.tensors[name] = t.contiguous()

    def projection(
        self,
        module: str,
        enc: dict[str, Any],
    ) -> None:
        for suffix, t in enc.items():
            self.add(f"{module}.{suffix}", t)


def _encode_expert(
    fmt: str,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    *,
    input_scales: dict[str, float],
    shared_global: bool = True,
) -> dict[str, dict[str, torch.Tensor]]:
    """role -> suffix -> tensor, in the format's own names and dtypes (its reader's ``encode_expert``)."""
    if fmt not in ENCODER_OF:
        raise ValueError(f"unknown synthetic format {fmt!r}; valid: {', '.join(FORMATS)}")
    return ENCODER_OF[fmt].encode_expert(fmt, gate, up, down, input_scales=input_scales, shared_global=shared_global)


#: bytes per routed-expert parameter of a synthetic source, by the row its format converts to (weights;
#: block scales add a few percent, `_estimate_bytes` counts them as 1/16 more)
_BYTES_PER_PARAM = {"nvfp4": 0.5, "mxfp4": 0.5, "mxfp8": 1.0, "bf16": 2.0}


def _estimate_bytes(fmt: str, num_layers: int, hidden: int, intermediate: int, num_experts: int,
                   shared: int = 0) -> int:
    """About how many bytes a synthetic source of these sizes holds (its experts dominate)."""
    per = _BYTES_PER_PARAM.get(ROW_OF.get(fmt, "bf16"), 2.0) * (1 + 1 / 16)
    return int(num_layers * (num_experts + shared) * 3 * hidden * intermediate * per)


def check_sizes(fmt: str, out: Path, *, num_layers: int, hidden: int, intermediate: int, num_experts: int,
                top_k: int, shared: int = 0) -> None:
    """Refuse, before anything is allocated or written, sizes beyond megamoe's stated limits
    (``megamoe_runtime.files.limits``: no converter or server takes such a model) and a source that would
    not fit the free disk space beside `out` or the memory available (the build holds about the source's
    size in memory). Raises LimitError naming the option and the values: an ``--experts 1000000000`` ended
    in an allocator traceback, a ``--layers 1000000`` grew without end."""
    import shutil

    from megamoe_runtime.files.limits import MAX_INTERMEDIATE, LimitError, check_limit

    for name, value, flag in (("num_layers", num_layers, "--layers"), ("num_experts", num_experts, "--experts"),
                              ("hidden", hidden, "--hidden"), ("intermediate", intermediate, "--intermediate"),
                              ("top_k", top_k, "--top-k")):
        check_limit(name, value, "synth", LimitError, label=flag)
    if shared * intermediate > MAX_INTERMEDIATE:
        raise LimitError(f"synth: --shared {shared} x --intermediate {intermediate} = {shared * intermediate} "
                         f"(the fused shared expert's width) exceeds megamoe's limit of {MAX_INTERMEDIATE} for "
                         "intermediate (megamoe_runtime.files.limits)")
    need = _estimate_bytes(fmt, num_layers, hidden, intermediate, num_experts, shared)
    base = Path(out).absolute()
    while not base.exists() and base != base.parent:
        base = base.parent
    free = shutil.disk_usage(base).free
    mem = _available_memory()
    for what, have in (("free disk space in " + str(base), free), ("available memory", mem)):
        if have is not None and need > have:
            from ..output.units import format_bytes

            raise LimitError(f"synth: a {fmt} source of {num_layers} layer(s) x {num_experts} expert(s) "
                             f"(+{shared} shared), hidden {hidden}, intermediate {intermediate} is about "
                             f"{format_bytes(need)}, more than the {format_bytes(have)} of {what}; pick smaller "
                             "sizes")


def _available_memory() -> int | None:
    """MemAvailable (Linux), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def build_synthetic_checkpoint(
    path: str | Path,
    fmt: str,
    *,
    num_layers: int = 2,
    hidden: int = 256,
    intermediate: int = 128,
    num_experts: int = 8,
    top_k: int = 2,
    shared: int = 0,
    seed: int = 0,
    max_shard_bytes: int | None = None,
    first_k_dense_replace: int = 0,
    naming: str = "hf",
    model_type: str | None = None,
    routed_scaling_factor: float = 1.0,
    shared_format: str | None = None,
    vocab_size: int = 64,
    extra_config: dict | None = None,
    missing_expert: Any = None,
    nan_scale: Any = None,
    zero_scale: Any = None,
    ff_scale: Any = None,
    scale_mismatch: Any = None,
    mismatch_factor: float = 2.0,
    wrong_shape: Any = None,
    excluded_layer: Any = None,
) -> Path:
    """Write a tiny MoE checkpoint in source format ``fmt`` to ``path``.

    ``naming``: ``"hf"`` (``model.layers.N.mlp.experts.E.gate_proj``),
    ``"w123"`` (Mixtral/Kimi ``block_sparse_moe.experts.E.w1``) or
    ``"fused"`` (transformers >= 5 ``experts.gate_up_proj [E, 2I, H]``;
    implied by ``fmt="bf16-fused"``); ``deepseek-v4`` always uses its own
    ``layers.N.ffn.experts.E.w1.{weight,scale}``. ``shared`` = S shared
    experts of width ``intermediate`` each, stored DeepSeek-style as one MLP
    of width S*I (``mlp.shared_experts``) in the routed format, or in
    ``shared_format`` (``"bf16"``: excluded from quantization). Layers below
    ``first_k_dense_replace`` get a dense MLP instead of experts.
    ``max_shard_bytes`` splits the tensors into shards with
    ``model.safetensors.index.json``. Returns the folder.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threading only adds overhead (7x on a loaded 2-core box)
    try:
        return _build(path, fmt, **{k: v for k, v in locals().items() if k not in ("path", "fmt", "threads")})
    finally:
        torch.set_num_threads(threads)


def _build(
    path: str | Path,
    fmt: str,
    *,
    num_layers: int,
    hidden: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    shared: int,
    seed: int,
    max_shard_bytes: int | None,
    first_k_dense_replace: int,
    naming: str,
    model_type: str | None,
    routed_scaling_factor: float,
    shared_format: str | None,
    vocab_size: int,
    extra_config: dict | None,
    missing_expert: Any,
    nan_scale: Any,
    zero_scale: Any,
    ff_scale: Any,
    scale_mismatch: Any,
    mismatch_factor: float,
    wrong_shape: Any,
    excluded_layer: Any,
) -> Path:

    if fmt not in FORMATS:
        raise ValueError(f"unknown synthetic format {fmt!r}; valid: {', '.join(FORMATS)}")
    if fmt == "bf16-fused":
        naming = "fused"
    if naming == "fused" and ROW_OF[fmt] != "bf16":
        raise ValueError("fused experts are only written unquantized")
    v4 = fmt == "deepseek-v4"
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    H, I, E, S = hidden, intermediate, num_experts, shared
    missing = set(_as_list(missing_expert))
    nans, zeros, ffs = set(_as_list(nan_scale)), set(_as_list(zero_scale)), set(_as_list(ff_scale))
    mism = {t[:2] for t in _as_list(scale_mismatch)}
    wrong = set(_as_list(wrong_shape))
    excluded = {t[0] for t in _as_list(excluded_layer)}
    dense_I = 2 * I

    root = "" if v4 else "model."
    block = "ffn" if v4 else ("block_sparse_moe" if naming == "w123" else "mlp")
    proj = _W_PROJ if (v4 or naming == "w123") else _HF_PROJ
    b = _Builder(fmt, seed, naming)
    g0 = _gen(seed, 999)
    float_dt = {"fp16": torch.float16, "fp32": torch.float32}.get(fmt, torch.bfloat16)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g0) * 0.02).to(float_dt)

    b.add("embed.weight" if v4 else "model.embed_tokens.weight", rnd(vocab_size, H))
    ignore: list[str] = ["lm_head"] if not v4 else ["head"]
    for L in range(num_layers):
        lp = f"{root}layers.{L}"
        b.add(f"{lp}.{'attn_norm' if v4 else 'input_layernorm'}.weight", torch.ones(H, dtype=float_dt))
        b.add(f"{lp}.{'ffn_norm' if v4 else 'post_attention_layernorm'}.weight", torch.ones(H, dtype=float_dt))
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            b.add(f"{lp}.{'attn' if v4 else 'self_attn'}.{p}.weight", rnd(H, H))
        ignore.append(f"{lp}.{'attn' if v4 else 'self_attn'}*")
        mp = f"{lp}.{block}"
        if L < first_k_dense_replace:
            for r in _ROLES:
                shape = (H, dense_I) if r == "down" else (dense_I, H)
                b.add(f"{mp}.{proj[r]}.weight", rnd(*shape))
            ignore.append(f"{mp}.*")
            continue
        b.add(f"{mp}.gate.weight", rnd(E, H))
        ignore.append(f"{mp}.gate")
        if S or model_type == "deepseek_v3":
            b.add(f"{mp}.gate.e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        layer_fmt = "bf16" if L in excluded else fmt
        if L in excluded:
            ignore.append(f"{mp}.experts*")
        if naming == "fused":
            gus, dns = [], []
            for e in range(E):
                gt, ut, dt_ = synthetic_expert_weights(seed, L, e, H, I)
                gus.append(torch.cat([gt, ut], 0))
                dns.append(dt_)
            b.add(f"{mp}.experts.gate_up_proj", torch.stack(gus).to(float_dt))
            b.add(f"{mp}.experts.down_proj", torch.stack(dns).to(float_dt))
        else:
            for e in range(E):
                if (L, e) in missing:
                    continue
                gt, ut, dt_ = synthetic_expert_weights(seed, L, e, H, I)
                if (L, e) in mism:
                    ut = ut * mismatch_factor
                ins = {r: synthetic_input_scale(seed, L, e, r) for r in _ROLES}
                enc = _encode_expert(
                    layer_fmt, gt, ut, dt_, input_scales=ins, shared_global=(L, e) not in mism
                )
                for r in _ROLES:
                    d = enc[r]
                    _inject(d, (L, e, r) in nans, (L, e, r) in zeros, (L, e, r) in ffs)
                    if (L, e, r) in wrong:
                        wk = _of_kind(d, "weight")
                        d[wk] = d[wk][:-1]
                    b.projection(f"{mp}.experts.{e}.{proj[r]}", d)
        if S:
            sg, su, sd = synthetic_shared_weights(seed, L, H, S * I)
            sfmt = shared_format or ("bf16" if naming == "fused" else fmt)
            ins = {r: synthetic_input_scale(seed, L, 10_000, r) for r in _ROLES}
            if shared_format is None:  # the format's own shared experts (DeepSeek-V4: block FP8)
                enc = ENCODER_OF[sfmt].encode_shared(sfmt, sg, su, sd, input_scales=ins)
            else:
                enc = _encode_expert(sfmt, sg, su, sd, input_scales=ins)
            if sfmt == "bf16" and ROW_OF[fmt] != "bf16":
                ignore.append(f"{mp}.shared_experts*")
            for r in _ROLES:
                b.projection(f"{mp}.shared_experts.{proj[r]}", enc[r])
    b.add("norm.weight" if v4 else "model.norm.weight", torch.ones(H, dtype=float_dt))
    b.add("head.weight" if v4 else "lm_head.weight", rnd(vocab_size, H))

    # -- config ------------------------------------------------------------------
    mt = model_type or ("deepseek_v4" if v4 else "deepseek_v3" if (S or first_k_dense_replace) else
                        "mixtral" if naming == "w123" else "qwen3_moe")
    cfg: dict[str, Any] = {
        "architectures": [{"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v4": "DeepseekV4ForCausalLM",
                           "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}.get(mt, "AutoModel")],
        "model_type": mt,
        "hidden_size": H,
        "num_hidden_layers": num_layers,
        "num_attention_heads": max(1, H // 64),
        "num_key_value_heads": max(1, H // 64),
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": {"fp16": "float16", "fp32": "float32"}.get(fmt, "bfloat16"),
        "num_experts_per_tok": top_k,
        "norm_topk_prob": True,
    }
    if mt == "mixtral":
        cfg.update({"num_local_experts": E, "intermediate_size": I})
    elif mt == "qwen3_moe":
        cfg.update({"num_experts": E, "moe_intermediate_size": I, "intermediate_size": dense_I,
                    "decoder_sparse_step": 1, "mlp_only_layers": list(range(first_k_dense_replace))})
    else:
        cfg.update({
            "n_routed_experts": E,
            "moe_intermediate_size": I,
            "intermediate_size": dense_I,
            "n_shared_experts": S,
            "first_k_dense_replace": first_k_dense_replace,
            "moe_layer_freq": 1,
            "routed_scaling_factor": routed_scaling_factor,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "n_group": 1,
            "topk_group": 1,
        })
    if routed_scaling_factor != 1.0:
        cfg["routed_scaling_factor"] = routed_scaling_factor
    if v4:
        cfg.update({"expert_dtype": "fp4", "swiglu_limit": 10.0, "scoring_func": "sqrtsoftplus"})
    cq, hf = ENCODER_OF[fmt].synthetic_quant_config(fmt, ignore)
    if cq is not None:
        cfg["quantization_config"] = cq
    if extra_config:
        cfg.update(extra_config)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if hf is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps(_TOKENIZER_CONFIG) + "\n")
    (path / "tokenizer.json").write_text(tokenizer_json(vocab_size) + "\n")
    _save(b.tensors, path, max_shard_bytes)
    return path


#: tokenizer_config.json of a synthetic checkpoint: the generic fast tokenizer over tokenizer.json
_TOKENIZER_CONFIG = {"model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                    "eos_token": "</s>", "unk_token": "<unk>"}


def tokenizer_json(vocab_size: int) -> str:
    """A word-level tokenizer.json over the model's whole vocabulary (``<s>``, ``</s>``, ``<unk>``, then ``w3``
    ...), in exactly the form the ``tokenizers`` library writes (tests compare it with
    ``Tokenizer.from_str(...).to_str()``), so transformers' AutoTokenizer and vLLM load it as a real one.
    Written without importing ``tokenizers``, which the base install does not need."""
    specials = ["<s>", "</s>", "<unk>"][:vocab_size]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(specials)]
    vocab = {**{t: i for i, t in enumerate(specials)}, **{f"w{i}": i for i in range(len(specials), vocab_size)}}
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    return json.dumps(doc, separators=(",", ":"))


def _of_kind(d: dict[str, torch.Tensor], kind: str) -> str | None:
    """The suffix in ``d`` that is a ``kind`` (weight | scale | global_scale | input_scale) by the
    runtime's table of suffix meanings, so defects land where the format keeps that tensor."""
    return next((k for k in d if SUFFIX_KINDS[k][0] == kind), None)


def _inject(d: dict[str, torch.Tensor], nan: bool, zero: bool, ff: bool) -> None:
    """Scale defects: NaN / zero go to the global scale when there is one (NVFP4),
    else into the block scale; 0xFF into an E8M0 block scale byte."""
    if not (nan or zero or ff):
        return
    glob = _of_kind(d, "global_scale")
    sk = _of_kind(d, "scale")
    if ff:
        s = d[sk].clone()
        b = s.view(torch.uint8)
        b.view(-1)[0] = 0xFF
        d[sk] = s
    if nan or zero:
        v = float("nan") if nan else 0.0
        if glob is not None:
            d[glob] = torch.full_like(d[glob], v)
        else:
            s = d[sk].clone()
            if s.dtype == torch.float8_e4m3fn:
                s.view(-1)[0] = v
            else:  # E8M0 has no zero or NaN except 0xFF; zero byte = 2^-127 ~ 0 (ModelOpt's all-zero block)
                s.view(torch.uint8).view(-1)[0] = 0xFF if nan else 0
            d[sk] = s


def save_file(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file the way ``safetensors.torch.save_file`` lays it
    out (tensors sorted by descending alignment, then name; header padded to
    8 bytes), without numpy, which that function needs and torch does not."""
    from megamoe_runtime.files.tensor_bytes import byte_view
    from megamoe_runtime.format.manifest import dtype_name

    from ..output.shard_writer import PlannedTensor, safetensors_header

    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    plan = [PlannedTensor(n, dtype_name(tensors[n].dtype), tuple(tensors[n].shape)) for n in order]
    with open(filename, "wb") as f:
        f.write(safetensors_header(plan, metadata))
        for n in order:
            f.write(byte_view(tensors[n].detach().contiguous()))


def _save(tensors: dict[str, torch.Tensor], path: Path, max_shard_bytes: int | None) -> None:
    meta = {"format": "pt"}
    names = list(tensors)
    if not max_shard_bytes:
        save_file(tensors, str(path / "model.safetensors"), metadata=meta)
        return
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nb = tensors[n].numel() * tensors[n].element_size()
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nb
    total = len(shards)
    weight_map = {}
    for i, group in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{total:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(path / fname), metadata=meta)
        for n in group:
            weight_map[n] = fname
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        + "\n"
    )


def expert_tensor_names(path: str | Path) -> list[str]:
    """Helper for tests: the routed-expert tensor names of a synthetic checkpoint."""
    from megamoe_convert.readers.naming import EXPERT_RE, FUSED_RE

    from ..readers.source import CheckpointSource

    return [n for n in CheckpointSource(path).tensor_names() if EXPERT_RE.match(n) or FUSED_RE.match(n)]
