"""Reader registry and format detection.

``detect_reader(source, format=None, quantize=None)`` picks the reader for a
checkpoint: from ``format`` when given (a registered name or an alias), else
from ``hf_quant_config.json`` / ``config.json`` ``quantization_config``
(each reader's ``detect``), in ``DETECTION_ORDER``: ModelOpt, Quark,
compressed-tensors, DeepSeek-V4, block FP8 (DeepSeek-V3 / FineGrainedFP8),
unquantized. ``ALIASES`` collects each reader's ``aliases``. Known-but-unsupported
variants (ModelOpt W4A8, CT per-tensor FP8, block sizes other than 128x128, ...) get a FormatError
saying what was found, why it cannot be read, and what can.

Decisions shared by every reader:

* Routed experts excluded from quantization (stored BF16 while the other
  experts are quantized, usually via the ignore/exclude list) are refused
  with a FormatError naming the layer and tensor: a MegaMoE layer has one
  weight format for all its experts, and re-quantizing experts the producer
  deliberately kept in high precision would silently change the model.
* Shared experts may be in a different encoding from the routed ones
  (excluded -> ``SharedInfo.encoding == "bf16"``); readers report it and the
  writer converts them to the row's fusable shared precision.
* ``quantize=`` is accepted only for unquantized checkpoints (no stacking of
  a second quantization on a first).
* The kernels quantize activations themselves (`recipe`): a source recipe
  whose activations the kernel makes coarser (weight-only exports, FP8
  activations on the nvfp4 row) is refused unless
  ``accept_activation_change=True`` (``--accept-activation-change``); a finer
  or equal one converts. Either way the reader's ``activation_change``
  records both recipes. ``quantize=`` is itself that choice for unquantized
  checkpoints.

The converter's lowest floor (docs/ARCHITECTURE.md#converter-floors): the input side. `source` opens a
local folder or a hub repo and hands out tensors lazily; the readers say what those tensors mean.

May import: the runtime (`megamoe_runtime`), and its own modules (no circle). Never `output`, `pipeline`,
`testing` or `cli` (tests/test_import_floors.py).
"""

from __future__ import annotations

from megamoe_runtime.errors import FormatError

from .base import (
    CheckpointReader,
    ExpertScalars,
    ModelFacts,
    MoELayerInfo,
    SharedInfo,
    register_reader,
    registered_readers,
)

from . import recipe as _recipe  # noqa: E402
# importing a module registers its readers; the order they are tried in is DETECTION_ORDER below
from . import modelopt as _modelopt  # noqa: F401,E402
from . import quark as _quark  # noqa: F401,E402
from . import compressed_tensors as _ct  # noqa: F401,E402
from . import deepseek_v4 as _dsv4  # noqa: F401,E402
from . import fp8_block as _fp8b  # noqa: F401,E402
from . import unquantized as _unq  # noqa: F401,E402

__all__ = [
    "CheckpointReader",
    "ExpertScalars",
    "ModelFacts",
    "MoELayerInfo",
    "SharedInfo",
    "register_reader",
    "available_formats",
    "readers_in_order",
    "detect_reader",
    "describe_quant_config",
]

#: The order ``detect_reader`` tries the readers in (the first whose ``detect`` is True wins), stated
#: here rather than left to import order: producer-specific configs before the generic ones, and
#: ``unquantized`` (no quantization config at all) last. Every registered reader must appear.
DETECTION_ORDER = (
    "modelopt-nvfp4", "modelopt-mxfp4", "modelopt-mxfp8", "modelopt-w4a8-nvfp4-fp8",
    "quark-mxfp4", "quark-nvfp4", "quark-mxfp8",
    "ct-nvfp4", "ct-mxfp4", "ct-mxfp8", "ct-fp8-block",
    "deepseek-v4", "fp8-block",
    "unquantized",
)
if set(DETECTION_ORDER) != set(registered_readers()) or len(set(DETECTION_ORDER)) != len(DETECTION_ORDER):
    raise ImportError(f"readers.DETECTION_ORDER {DETECTION_ORDER} must list every registered reader once: "
                      f"{list(registered_readers())}")


def _in_order() -> list[type[CheckpointReader]]:
    regs = registered_readers()
    return [regs[n] for n in DETECTION_ORDER]


def _aliases() -> dict[str, str]:
    """alias -> format name, from each reader's ``aliases``; an alias claimed twice is a bug."""
    out: dict[str, str] = {}
    for cls in _in_order():
        for alias in cls.aliases:
            if out.setdefault(alias, cls.format_name) != cls.format_name:
                raise ImportError(f"format alias {alias!r} claimed by {out[alias]} and {cls.format_name}")
    return out


ALIASES = _aliases()


def available_formats() -> list[str]:
    """Registered reader format names, in detection order."""
    return list(DETECTION_ORDER)


def readers_in_order() -> list[type[CheckpointReader]]:
    """The registered reader classes in ``DETECTION_ORDER``."""
    return _in_order()


def describe_quant_config(source) -> str:
    """One line saying what the checkpoint's quantization config declares."""
    parts = []
    hq = source.hf_quant_config
    if isinstance(hq, dict):
        prod = (hq.get("producer") or {}).get("name")
        algo = (hq.get("quantization") or {}).get("quant_algo")
        parts.append(f"hf_quant_config.json producer={prod!r} quant_algo={algo!r}")
    cq = source.config_quant_config
    if isinstance(cq, dict):
        keys = {k: cq.get(k) for k in ("quant_method", "quant_algo", "format", "fmt", "scale_fmt") if k in cq}
        parts.append("config.json quantization_config " + " ".join(f"{k}={v!r}" for k, v in keys.items()))
    return "; ".join(parts) if parts else "no quantization config (hf_quant_config.json / quantization_config)"


def _resolve_name(format: str) -> type[CheckpointReader]:
    regs = registered_readers()
    name = ALIASES.get(format.lower(), format.lower())
    if name not in regs:
        raise FormatError(
            f"unknown format {format!r}; valid: {', '.join(DETECTION_ORDER)} (aliases: {', '.join(sorted(ALIASES))})"
        )
    return regs[name]


def detect_reader(source, format: str | None = None, quantize: str | None = None,
                  accept_activation_change: bool = False) -> CheckpointReader:
    """The reader for ``source``: forced by ``format`` or detected.

    ``quantize`` ("mxfp4" | "mxfp8" | "nvfp4") applies only to unquantized
    checkpoints; on an already-quantized one it is refused rather than
    silently stacking a second quantization on the first.
    ``accept_activation_change``: convert a checkpoint whose activations the
    kernel quantizes more coarsely than the producer did (FormatError naming
    ``--accept-activation-change`` otherwise).
    """
    _refuse_megamoe_output(source)
    reader = _detect(source, format, quantize)
    change = _recipe.compare(_recipe_reader(source, reader, format).activation_recipe(source), reader.row,
                             accepted=bool(accept_activation_change) or quantize is not None,
                             accepted_by=accepted_by(accept_activation_change, quantize))
    if change.needs_flag and not change.accepted:
        raise FormatError(change.refusal(str(source.id), reader.format_name))
    reader.activation_change = change
    return reader


def _refuse_megamoe_output(source) -> None:
    """FormatError when ``source`` is already a megamoe output (its megamoe.json, or config.json naming the
    megamoe method): its experts are in kernel layout, which no reader reads; it is served as it is."""
    qc = (source.config or {}).get("quantization_config")
    has_manifest = (source.root / "megamoe.json").is_file()
    if has_manifest or (isinstance(qc, dict) and qc.get("quant_method") == "megamoe"):
        why = "megamoe.json is there" if has_manifest else "config.json names quant_method 'megamoe'"
        raise FormatError(f"{source.id}: already a megamoe output ({why}): serve it as it is (megamoe-convert "
                          f"verify {source.id} checks it), or convert the checkpoint it was converted from")


def accepted_by(accept_activation_change: bool, quantize: str | None) -> str | None:
    """The option that accepts a coarser activation recipe, as the user gave it: the flag itself, or
    ``--quantize ROW`` (choosing a quantized row for an unquantized model is that choice); None: neither."""
    if accept_activation_change:
        return _recipe.ACCEPT_FLAG
    return f"--quantize {quantize}" if quantize is not None else None


def _recipe_reader(source, reader: CheckpointReader, format: str | None) -> type:
    """The reader class whose producer config states the source's activation
    recipe: the forced reader reads tensors, but the recipe is the source's own
    (a forced ModelOpt reader finds no hf_quant_config on a Quark export and
    would call its weight-only recipe "undeclared")."""
    if format is not None:
        for c in _in_order():  # the reader detection would pick
            if c.detect(source):
                return c
    return type(reader)


def _detect(source, format: str | None, quantize: str | None) -> CheckpointReader:
    if format is not None:
        cls = _resolve_name(format)
    else:
        for c in _in_order():
            msg = c.unsupported_reason(source)
            if msg:
                raise FormatError(f"{source.id}: {msg}")
        hits = [c for c in _in_order() if c.detect(source)]
        if not hits:
            raise FormatError(
                f"{source.id}: cannot tell the checkpoint format ({describe_quant_config(source)}). "
                f"Supported: {', '.join(f'{c.format_name} ({c.description})' for c in _in_order())}. "
                "Pass format= (--format) to force one."
            )
        cls = hits[0]
    if cls is _unq.UnquantizedReader:
        return cls(source, quantize=quantize)
    if quantize is not None:
        raise FormatError(
            f"{source.id}: quantize={quantize!r} applies to unquantized (BF16/FP16/FP32) checkpoints only; this "
            f"checkpoint is {cls.format_name} and is converted as-is to the {cls.row or 'its'} row"
        )
    return cls(source)
