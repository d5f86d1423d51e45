"""Expert tensor naming and config facts, shared by every reader.

Checkpoints name the same thing many ways
(docs/CHECKPOINTS.md#expert-naming). This module maps every known spelling onto (layer, expert, role):

* per-expert modules: ``{prefix}.experts.{E}.{gate_proj|up_proj|down_proj}``
  (DeepSeek V2/V3, GLM, Kimi K2, Qwen3-MoE), ``{prefix}.experts.{E}.{w1|w3|w2}``
  (Mixtral / Kimi ``block_sparse_moe``, DeepSeek-V4 ``layers.N.ffn``);
  w1 = gate, w3 = up, w2 = down;
* fused 3-D parameters (transformers >= 5): ``{prefix}.experts.gate_up_proj``
  ``[E, 2I, H]`` with the **gate half first** (the modelling code does
  ``linear(x, gate_up_proj[e]).chunk(2, dim=-1)`` -> gate, up) and
  ``{prefix}.experts.down_proj`` ``[E, H, I]``;
* shared experts: ``{prefix}.shared_experts.{gate_proj|...|w1|...}`` (one
  MLP of width S*I_s) or Qwen2-MoE's ``{prefix}.shared_expert`` (+ a sigmoid
  ``shared_expert_gate``, which no MegaMoE kernel has a slot for).

``prefix`` is the MoE block (``model.layers.3.mlp``, ``layers.3.ffn``,
``model.layers.3.block_sparse_moe``); the layer index is the number after
``layers.``. DeepSeek-V4's ``mtp.N.*`` blocks carry no ``layers.N`` and are
left alone (passed through).

The config helpers read sizes and routing facts under every spelling we know
(HF ``hidden_size``/``moe_intermediate_size``/``n_routed_experts``...,
DeepSeek inference ``dim``/``moe_inter_dim``/``n_activated_experts``, Kimi K3
``routed_expert_hidden_size``/``num_experts_per_token``), looking into
``text_config`` for multimodal wrappers.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from megamoe_runtime.errors import CheckpointError, FormatError
from megamoe_runtime.files.limits import check_limit
from megamoe_runtime.format.source_formats import PROJECTION_PATTERN, PROJECTION_ROLES, SHARED_MODULE_PATTERN

ROLES = ("gate", "up", "down")

_BLOCK = r"(?:mlp|ffn|block_sparse_moe|moe|feed_forward|sparse_moe_block)"
_PREFIX = rf"(?P<prefix>(?:[\w.]*?\.)?layers\.(?P<layer>\d+)\.{_BLOCK})"
_PROJ = rf"(?P<proj>{PROJECTION_PATTERN})"

EXPERT_RE = re.compile(rf"^{_PREFIX}\.experts\.(?P<expert>\d+)\.{_PROJ}\.(?P<suffix>[\w.]+)$")
FUSED_RE = re.compile(
    rf"^{_PREFIX}\.experts\.(?P<proj>gate_up_proj|down_proj)(?:(?:[._])(?P<suffix>[\w.]+))?$"
)
_SHARED_RE = re.compile(
    rf"^{_PREFIX}\.(?P<kind>{SHARED_MODULE_PATTERN})\.{_PROJ}\.(?P<suffix>[\w.]+)$"
)
_SHARED_GATE_RE = re.compile(rf"^{_PREFIX}\.shared_expert_gate\.[\w.]+$")
#: gpt-oss style MX-packed fused experts / expert biases
_GPT_OSS_RE = re.compile(rf"^{_PREFIX}\.experts\.(?:gate_up_proj|down_proj)_(?:blocks|scales|bias)$")


@dataclass
class LayerNames:
    """Tensor names of one MoE block, grouped (headers only)."""

    prefix: str
    layer: int
    #: expert -> role -> module name (``...experts.3.gate_proj``)
    experts: dict[int, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))
    #: module name -> suffix -> tensor name
    modules: dict[str, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))
    #: "gate_up" / "down" -> suffix ("" for the bare parameter) -> tensor name
    fused: dict[str, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))
    #: role -> module name of the shared expert
    shared: dict[str, str] = field(default_factory=dict)
    shared_kind: str | None = None
    shared_gate: list[str] = field(default_factory=list)
    gpt_oss: list[str] = field(default_factory=list)

    def expert_tensor_names(self) -> set[str]:
        out: set[str] = set()
        for roles in self.experts.values():
            for mod in roles.values():
                out |= set(self.modules[mod].values())
        for d in self.fused.values():
            out |= set(d.values())
        return out

    def shared_tensor_names(self) -> set[str]:
        out: set[str] = set()
        for mod in self.shared.values():
            out |= set(self.modules[mod].values())
        return out


def scan(names: Iterable[str]) -> dict[str, LayerNames]:
    """Group expert / shared-expert tensor names by MoE block prefix."""
    layers: dict[str, LayerNames] = {}

    def get(m: re.Match) -> LayerNames:
        p = m.group("prefix")
        ln = layers.get(p)
        if ln is None:
            ln = layers[p] = LayerNames(prefix=p, layer=int(m.group("layer")))
        return ln

    for name in names:
        m = EXPERT_RE.match(name)
        if m:
            ln = get(m)
            mod = name[: -len(m.group("suffix")) - 1]
            role = PROJECTION_ROLES[m.group("proj")]
            e = int(m.group("expert"))
            prev = ln.experts[e].get(role)
            if prev is not None and prev != mod:
                raise CheckpointError(
                    f"layer {ln.layer} expert {e}: two modules claim role {role}: {prev} and {mod}"
                )
            ln.experts[e][role] = mod
            ln.modules[mod][m.group("suffix")] = name
            continue
        m = _GPT_OSS_RE.match(name)
        if m:
            get(m).gpt_oss.append(name)
            continue
        m = FUSED_RE.match(name)
        if m:
            ln = get(m)
            key = "gate_up" if m.group("proj") == "gate_up_proj" else "down"
            ln.fused[key][m.group("suffix") or ""] = name
            continue
        m = _SHARED_RE.match(name)
        if m:
            ln = get(m)
            mod = name[: -len(m.group("suffix")) - 1]
            ln.shared[PROJECTION_ROLES[m.group("proj")]] = mod
            ln.shared_kind = m.group("kind")
            ln.modules[mod][m.group("suffix")] = name
            continue
        m = _SHARED_GATE_RE.match(name)
        if m:
            get(m).shared_gate.append(name)
    # blocks with only shared experts (a dense layer's shared MLP) are not MoE blocks
    return {p: ln for p, ln in layers.items() if ln.experts or ln.fused or ln.gpt_oss}


# ----------------------------------------------------------------------------- config


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language-model part of a config (``text_config`` / ``language_config``
    for multimodal wrappers), else the config itself."""
    for key in ("text_config", "language_config", "llm_config"):
        sub = config.get(key)
        if isinstance(sub, Mapping) and ("hidden_size" in sub or "num_hidden_layers" in sub):
            return sub
    return config


def cfg_get(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """First present, non-None key among ``keys`` (text_config first)."""
    tc = _text_config(config)
    for src in (tc, config) if tc is not config else (config,):
        for k in keys:
            v = src.get(k)
            if v is not None:
                return v
    return default


def model_type(config: Mapping[str, Any]) -> str | None:
    return _text_config(config).get("model_type") or config.get("model_type")


@dataclass(frozen=True)
class ConfigSizes:
    hidden: int | None
    intermediate: int | None
    num_experts: int | None
    top_k: int | None
    num_shared: int
    shared_intermediate: int | None
    num_layers: int | None


def config_sizes(config: Mapping[str, Any], where: str = "config.json") -> ConfigSizes:
    """MoE sizes from the config under every known spelling (None = unknown); CheckpointError naming `where`
    for a size beyond megamoe_runtime.files.limits."""
    hidden = cfg_get(config, "routed_expert_hidden_size", "hidden_size", "dim", "d_model")
    inter = cfg_get(config, "moe_intermediate_size", "moe_inter_dim", "expert_intermediate_size")
    if inter is None and cfg_get(config, "num_local_experts") is not None:
        inter = cfg_get(config, "intermediate_size")  # Mixtral: experts use intermediate_size
    n_exp = cfg_get(config, "n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
    top_k = cfg_get(
        config, "num_experts_per_tok", "num_experts_per_token", "n_activated_experts", "moe_topk", "top_k"
    )
    n_shared = cfg_get(config, "n_shared_experts", "num_shared_experts", default=0) or 0
    shared_inter = cfg_get(config, "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size")
    if shared_inter is not None and not cfg_get(config, "n_shared_experts", "num_shared_experts"):
        n_shared = 1  # Qwen2-MoE style: one shared expert of its own width
    if shared_inter is None and n_shared:
        shared_inter = inter
    sizes = ConfigSizes(
        hidden=_int_or_none(hidden),
        intermediate=_int_or_none(inter),
        num_experts=_int_or_none(n_exp),
        top_k=_int_or_none(top_k),
        num_shared=_int_or_none(n_shared) or 0,
        shared_intermediate=_int_or_none(shared_inter),
        num_layers=_int_or_none(cfg_get(config, "num_hidden_layers", "n_layers", "num_layers")),
    )
    _check_config_limits(sizes, where)
    return sizes


def _check_config_limits(sizes: ConfigSizes, where: str = "config.json") -> None:
    """Refuse sizes beyond megamoe_runtime.files.limits before a reader sizes a list or a buffer from them (a config
    claiming 10**9 experts would otherwise be enumerated expert by expert)."""
    for limit, label, value in (("hidden", "hidden_size", sizes.hidden),
                                ("intermediate", "moe_intermediate_size", sizes.intermediate),
                                ("num_experts", "num_experts", sizes.num_experts),
                                ("top_k", "num_experts_per_tok", sizes.top_k),
                                ("num_experts", "n_shared_experts", sizes.num_shared),
                                ("intermediate", "shared_expert_intermediate_size", sizes.shared_intermediate),
                                ("num_layers", "num_hidden_layers", sizes.num_layers)):
        check_limit(limit, value, where, CheckpointError, label)


def _int_or_none(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, list):  # some configs give per-layer lists; MoE sizes are uniform here
        v = v[0] if v else None
        if v is None:
            return None
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(float("inf"))
        return None


def expected_moe_layers(config: Mapping[str, Any]) -> set[int] | None:
    """Layer indices the config says are MoE (None when it does not say).

    DeepSeek/Kimi/GLM: ``first_k_dense_replace`` and ``moe_layer_freq``;
    Qwen-MoE: ``decoder_sparse_step`` and ``mlp_only_layers``; Mixtral and
    other all-MoE models: every layer. MTP layers beyond ``num_hidden_layers``
    are not expected (but accepted when present)."""
    n = _int_or_none(cfg_get(config, "num_hidden_layers", "n_layers"))
    if n is None:
        return None
    first_dense = _int_or_none(cfg_get(config, "first_k_dense_replace", "n_dense_layers")) or 0
    freq = _int_or_none(cfg_get(config, "moe_layer_freq")) or 1
    step = _int_or_none(cfg_get(config, "decoder_sparse_step")) or 1
    mlp_only = set(cfg_get(config, "mlp_only_layers", default=[]) or [])
    out = set()
    for i in range(n):
        if i < first_dense or i in mlp_only:
            continue
        if "first_k_dense_replace" in _text_config(config) and (i % freq):
            continue
        if "decoder_sparse_step" in _text_config(config) and (i + 1) % step:
            continue
        out.add(i)
    return out


def activation_from_config(config: Mapping[str, Any]):
    """The expert activation as an ActivationSpec, or FormatError naming the
    config value when no MegaMoE kernel computes it."""
    from megamoe_runtime.format.formats import ActivationSpec

    act = cfg_get(config, "hidden_act", "hidden_activation", "activation", "act_fn", default="silu")
    act = str(act).lower()
    if act in ("silu", "swish", "swiglu"):
        clamp = cfg_get(config, "swiglu_limit", "activation_clamp", "swiglu_clamp")
        alpha = cfg_get(config, "swiglu_alpha", default=1.0)
        beta = cfg_get(config, "swiglu_beta", default=0.0)
        return ActivationSpec(
            kind="swiglu",
            clamp=None if clamp is None else _cfg_float("swiglu_limit", clamp),
            alpha=_cfg_float("swiglu_alpha", alpha),
            beta=_cfg_float("swiglu_beta", beta),
        )
    if act == "situ":
        sb = cfg_get(config, "activation_situ_beta", "situ_beta")
        slb = cfg_get(config, "activation_situ_linear_beta", "situ_linear_beta")
        if sb is None or slb is None:
            raise FormatError(
                f"config hidden_act='situ' but activation_situ_beta={sb!r}, activation_situ_linear_beta={slb!r}; "
                "both are needed"
            )
        return ActivationSpec(kind="situ", situ_beta=_cfg_float("activation_situ_beta", sb),
                              situ_linear_beta=_cfg_float("activation_situ_linear_beta", slb))
    raise FormatError(
        f"config hidden_act={act!r} has no MegaMoE kernel; supported: 'silu' (SwiGLU, optional swiglu_limit clamp) "
        "and 'situ' (with activation_situ_beta / activation_situ_linear_beta)"
    )


def _cfg_float(key: str, v: Any) -> float:
    """float(config value), or FormatError naming the key and the value."""
    if isinstance(v, bool):
        raise FormatError(f"config {key}={v!r} must be a number")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise FormatError(f"config {key}={v!r} must be a number") from None


def routed_scaling_factor(config: Mapping[str, Any]) -> float:
    v = cfg_get(config, "routed_scaling_factor", "route_scale", default=1.0)
    v = _cfg_float("routed_scaling_factor", v)
    if not math.isfinite(v) or v <= 0:
        raise FormatError(f"config routed_scaling_factor={v!r} must be a finite number > 0")
    return v
