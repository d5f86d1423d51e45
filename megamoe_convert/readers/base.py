"""The reader contract: what every source-format reader exposes.

One subclass per source format (ModelOpt NVFP4, Quark MXFP4, ...) turns a
:class:`~megamoe_convert.readers.source.CheckpointSource` into canonical per-expert
tensors (:class:`megamoe_runtime.format.canonical.ExpertTensors`). Everything
downstream (checks, writer, inspect) talks only to this interface, so a new
checkpoint format is one new module and nothing else.

Rules every reader follows (docs/ARCHITECTURE.md#canonical-expert-tensors):

* weights and block scales stay in the checkpoint's own encoding (packed E2M1
  bytes, E4M3 or UE8M0 scale bytes viewed as ``uint8``, bf16); readers never
  repack into kernel layout;
* global and input scales are plain Python floats and always *multipliers*
  (compressed-tensors divisors are inverted by its reader);
* reads are lazy: only the tensors of the expert asked for are loaded, so
  memory stays bounded by what the caller keeps alive;
* structural checks that belong to reading (presence, shape and dtype of each
  tensor against the config) raise :class:`CheckpointError` naming the file,
  the tensor and expected vs found values. Value checks (NaN / zero / 0xFF
  scales, w1/w3 agreement) are ``checks.py``'s job.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterator

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pathlib import Path
    from typing import Mapping

    import torch

    from megamoe_runtime.format.canonical import ExpertTensors
    from megamoe_runtime.format.formats import ActivationSpec

    from megamoe_convert.readers.source import CheckpointSource


@dataclass(frozen=True)
class SharedInfo:
    """Shared experts of one MoE layer, as the checkpoint stores them.

    ``num_shared`` (S) and ``intermediate`` (I_s, per shared expert) come from
    the config; ``read_shared`` returns ``num_modules`` ExpertTensors whose
    gate rows add up to ``S * I_s`` (DeepSeek stores the S experts already
    folded into one MLP of width S*I_s, so ``num_modules == 1`` there).

    ``encoding`` names the row whose canonical encoding the shared tensors are
    in (``"nvfp4" | "mxfp4" | "mxfp8" | "bf16" | "fp8_block"``), so the writer can
    ``ExpertTensors.dequantize(get_row(encoding))`` or copy them unchanged.
    It can differ from the routed row (e.g. experts quantized, shared experts
    excluded and BF16).

    ``unsupported_reason`` is set when the shared experts exist but cannot be
    fused into any MegaMoE kernel (e.g. Qwen2-MoE's sigmoid-gated
    ``shared_expert``); the writer then passes them through and records why.
    """

    num_shared: int
    intermediate: int
    encoding: str
    num_modules: int = 1
    tensor_names: frozenset[str] = frozenset()
    unsupported_reason: str | None = None

    @property
    def total_intermediate(self) -> int:
        return self.num_shared * self.intermediate


@dataclass(frozen=True)
class MoELayerInfo:
    """One MoE layer: where it is, its sizes, and which tensors are its experts.

    ``prefix`` is the module path of the MoE block (``model.layers.3.mlp``,
    ``layers.3.ffn``, ``model.layers.3.block_sparse_moe``); output tensors are
    named ``{prefix}.megamoe.{role}``. ``expert_tensor_names`` holds every
    routed-expert tensor name of the layer (weights and all scales); the
    shared experts' names are in ``shared.tensor_names``.
    """

    index: int
    prefix: str
    num_experts: int
    hidden: int
    intermediate: int
    shared: SharedInfo | None = None
    expert_tensor_names: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ModelFacts:
    """Model-level facts the runtime needs and that only the config knows.

    ``num_shared`` / ``shared_intermediate`` mirror the config (0 / None when
    the model has no shared experts); ``model_type`` is informational.
    """

    activation: "ActivationSpec"
    top_k: int
    routed_scaling_factor: float
    num_experts: int
    num_shared: int = 0
    shared_intermediate: int | None = None
    model_type: str | None = None
    norm_topk_prob: bool | None = None


@dataclass(frozen=True)
class ExpertScalars:
    """The per-expert float scales only (no weights): cheap to read for all
    experts, which checks need (w1/w3 agreement, the layer's max w2 input
    scale) and ``inspect`` reports. All multipliers; None where the format has
    none."""

    gate_global: float | None = None
    up_global: float | None = None
    down_global: float | None = None
    gate_input: float | None = None
    up_input: float | None = None
    down_input: float | None = None


_REGISTRY: dict[str, type["CheckpointReader"]] = {}


def register_reader(cls: type["CheckpointReader"]) -> type["CheckpointReader"]:
    """Class decorator adding a reader to the registry under ``format_name``.

    Detection order is ``readers.DETECTION_ORDER``, stated there; a later
    duplicate name is a bug.
    """
    name = cls.format_name
    if not name:
        raise TypeError(f"{cls.__name__} has no format_name")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise TypeError(f"reader format {name!r} registered twice ({_REGISTRY[name].__name__}, {cls.__name__})")
    _REGISTRY[name] = cls
    return cls


def registered_readers() -> dict[str, type["CheckpointReader"]]:
    return dict(_REGISTRY)


class CheckpointReader(abc.ABC):
    """Base class of every source-format reader.

    Subclasses set ``format_name`` (e.g. ``"modelopt-nvfp4"``) and ``row``
    (``"nvfp4" | "mxfp4" | "mxfp8" | "bf16" | "fp8_block"``: the feature-matrix row the
    routed experts map onto), and implement the abstract methods ``detect``,
    ``moe_layers``, ``model_facts`` and ``read_expert``.
    ``row`` may be overridden per instance (the unquantized reader's
    ``quantize=`` picks it).
    """

    format_name: ClassVar[str] = ""
    row: str = ""
    #: one line for ``available_formats()`` / error messages
    description: ClassVar[str] = ""
    #: other names ``format=`` (``--format``) accepts for this reader (``readers.ALIASES`` is their union)
    aliases: ClassVar[tuple[str, ...]] = ()
    #: how the layer's a2 is derived from this format's w2 input scales, for the manifest's
    #: ``source.recipe.l2_activation_scale``; None: the plain max over all experts (docs/SCALES.md#a2)
    l2_activation_scale_rule: ClassVar[str | None] = None
    #: the names ``synth.build_synthetic_checkpoint`` builds this format under (its own name, or variants
    #: such as the unquantized reader's ``bf16`` / ``fp16`` / ``fp32``); () when it has no synthetic encoder
    synthetic_formats: ClassVar[tuple[str, ...]] = ()
    #: a sentence for the summary and megamoe.json (``source.recipe.weights``) when the reader changes the
    #: stored weights' encoding on the way (Quark fake-quantized MXFP8 re-encoded as E4M3); None: read as stored
    weights_note: str | None = None

    def __init__(self, source: "CheckpointSource") -> None:
        self.source = source
        #: how the kernel's activations relate to the source recipe (`recipe.ActivationChange`);
        #: set by ``detect_reader``, which refuses a coarser one without the opt-in
        self.activation_change = None

    @classmethod
    def activation_recipe(cls, source: "CheckpointSource"):
        """What the producer did to the expert inputs (`recipe.ActivationRecipe`),
        from the quantization config; a per-format fact, so each format's reader
        overrides this. Default: undeclared (never refused)."""
        from .recipe import UNDECLARED

        return UNDECLARED

    @classmethod
    def global_scale_name(cls) -> str:
        """The source format's own name of the per-projection global scale, for messages about it
        (ModelOpt and Quark ``weight_scale_2``, the default; compressed-tensors ``weight_global_scale``)."""
        return "weight_scale_2"

    # -- the other direction: synthetic checkpoints ---------------------------
    @classmethod
    def encode_expert(cls, variant: str, gate: "torch.Tensor", up: "torch.Tensor", down: "torch.Tensor", *,
                      input_scales: "Mapping[str, float]", shared_global: bool = True,
                      ) -> dict[str, dict[str, "torch.Tensor"]]:
        """One expert's float32 weights as this format stores them: role ->
        suffix -> tensor, in the format's own names and dtypes (what
        ``read_expert`` reads back). ``variant`` is one of ``synthetic_formats``;
        ``input_scales`` (role -> multiplier) are written where the format has
        input scales; ``shared_global``: NVFP4 gate and up share one global
        scale, as ModelOpt >= 0.47 exports. The encoder lives with the reader so
        that a format's names and conventions are written down once."""
        raise NotImplementedError(f"{cls.format_name}: no synthetic encoder")

    @classmethod
    def synthetic_row(cls, variant: str) -> str:
        """The row a synthetic checkpoint in ``variant`` converts to (default: ``row``)."""
        return cls.row

    @classmethod
    def encode_shared(cls, variant: str, gate: "torch.Tensor", up: "torch.Tensor", down: "torch.Tensor", *,
                      input_scales: "Mapping[str, float]") -> dict[str, dict[str, "torch.Tensor"]]:
        """The layer's (folded) shared experts as this format stores them when
        they are not excluded from quantization; default: as a routed expert.
        A format whose shared experts use another encoding (DeepSeek-V4: block
        FP8) overrides this."""
        return cls.encode_expert(variant, gate, up, down, input_scales=input_scales)

    @classmethod
    def synthetic_quant_config(cls, variant: str, ignore: "list[str]") -> "tuple[dict | None, dict | None]":
        """``(config.json quantization_config, hf_quant_config.json)`` of a
        synthetic checkpoint in this format whose ignore / exclude list is
        ``ignore``: what ``detect`` and ``activation_recipe`` read back. Default:
        neither (an unquantized model)."""
        return None, None

    # -- detection -----------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def detect(cls, source: "CheckpointSource") -> bool:
        """True when ``source`` is in this reader's format (config only, cheap)."""

    @classmethod
    def unsupported_reason(cls, source: "CheckpointSource") -> str | None:
        """Why ``source`` is a known variant of this producer that no row can
        read (what was found, and what would convert), or None. Asked of every
        reader before detection, so a near miss is named instead of falling
        through to "cannot tell the format". Default: None."""
        return None

    # -- structure -----------------------------------------------------------
    @abc.abstractmethod
    def moe_layers(self) -> list[MoELayerInfo]:
        """Every MoE layer, in layer order, from config and tensor names
        (headers only)."""

    @abc.abstractmethod
    def model_facts(self) -> ModelFacts:
        """Model-level facts from the config (activation, top-k, scaling, shared experts)."""

    def layer(self, layer_index: int) -> MoELayerInfo:
        for info in self.moe_layers():
            if info.index == layer_index:
                return info
        from megamoe_runtime.errors import CheckpointError

        raise CheckpointError(
            f"{self.source.id}: layer {layer_index} is not an MoE layer; MoE layers are "
            f"{[i.index for i in self.moe_layers()]}"
        )

    # -- data ----------------------------------------------------------------
    @abc.abstractmethod
    def read_expert(self, layer_index: int, expert: int, *, weights: bool = True) -> "ExpertTensors":
        """Routed expert ``expert`` (global index) of MoE layer ``layer_index``
        in checkpoint encoding; reads only that expert's tensors.

        ``weights=False`` (asked only after `weight_byte_ranges` gave the three
        weights' bytes, which the converter then reads itself): the weights may
        be meta tensors of the right dtype and shape; scales and float scales
        are read as usual. A reader without byte ranges may ignore the flag."""

    def weight_byte_ranges(self, layer_index: int, expert: int, role: str) -> "tuple[Path, int, int] | None":
        """Where the weight of projection ``role`` ("gate" | "up" | "down") of an
        expert lies in the source, as ``(file, absolute offset, nbytes)``, when
        ``read_expert`` would return exactly those bytes, row-major, unchanged
        (only reinterpreted as the canonical dtype). The converter then reads
        them straight into the kernel buffer and calls
        ``read_expert(layer_index, expert, weights=False)`` for the rest.

        None (the default) means "use read_expert": readers that convert,
        quantize or reassemble weights never return a range."""
        return None

    def read_expert_scalars(self, layer_index: int, expert: int) -> ExpertScalars:
        """Only the float scales of one expert (default: via read_expert)."""
        et = self.read_expert(layer_index, expert)
        return ExpertScalars(
            gate_global=et.gate.global_scale,
            up_global=et.up.global_scale,
            down_global=et.down.global_scale,
            gate_input=et.gate.input_scale,
            up_input=et.up.input_scale,
            down_input=et.down.input_scale,
        )

    def read_shared(self, layer_index: int) -> list["ExpertTensors"] | None:
        """Shared experts of the layer in the encoding ``SharedInfo.encoding``
        names, or None when the layer has none."""
        return None

    def iter_experts(self, layer_index: int) -> Iterator[tuple[int, int, "ExpertTensors"]]:
        """``(layer_index, expert_index, ExpertTensors)`` for every expert of
        the layer, one at a time."""
        info = self.layer(layer_index)
        for e in range(info.num_experts):
            yield layer_index, e, self.read_expert(layer_index, e)

    def consumed_tensor_names(self) -> set[str]:
        """Every source tensor this reader turns into megamoe tensors (routed
        and fusable shared experts); all others are passed through."""
        names: set[str] = set()
        for info in self.moe_layers():
            names |= set(info.expert_tensor_names)
            if info.shared is not None and info.shared.unsupported_reason is None:
                names |= set(info.shared.tensor_names)
        return names

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.format_name} row={self.row} source={getattr(self.source, 'id', '?')}>"
