"""The stated limits on what megamoe reads: sizes in a config, manifest or header beyond which input is refused.

Every number a file can claim (experts, hidden size, layer count, header length, JSON size/depth/digits) is
checked against this table *before* anything is allocated from it, so hostile or corrupted input fails with a
clear error in bounded time and memory instead of an out-of-memory kill or a torch allocation traceback. The
limits are far above any published MoE model (DeepSeek-V3: 256 experts, hidden 7168, 61 layers, top_k 8) and
far below what would exhaust a machine. ``check_limit`` is the one place they are enforced.
"""
from __future__ import annotations

from typing import Any, Type

from ..errors import MegaMoEError

__all__ = [
    "LimitError",
    "LIMITS",
    "MAX_EXPERTS",
    "MAX_HIDDEN",
    "MAX_INTERMEDIATE",
    "MAX_TOP_K",
    "MAX_HEADER_BYTES",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_INT_DIGITS",
    "MAX_LAYER_BYTES",
    "check_limit",
]

#: routed experts of one layer (global count)
MAX_EXPERTS = 16_384
#: model hidden size
MAX_HIDDEN = 65_536
#: expert (or shared-expert) intermediate size
MAX_INTERMEDIATE = 131_072
#: MoE layers of one model
_MAX_LAYERS = 1_024
#: experts chosen per token
MAX_TOP_K = 256
#: the safetensors format's own limit on the JSON header's length
MAX_HEADER_BYTES = 100_000_000
#: tensors one safetensors header may list (a whole Kimi-K2-sized NVFP4 model in one file lists about 280,000);
#: counted in the raw header bytes before it is parsed, since parsing 1.3 M entries took 6-10 GB
_MAX_HEADER_TENSORS = 1 << 19
#: any JSON file megamoe reads (config.json, the index, megamoe.json, hf_quant_config.json)
MAX_JSON_BYTES = 64 * 1024 * 1024
#: nesting depth of objects/arrays in any JSON text megamoe reads
MAX_JSON_DEPTH = 64
#: decimal digits of one JSON integer (2**128 has 39)
MAX_INT_DIGITS = 40
#: bytes of one layer's parameters on one rank (checked before build_layer allocates)
MAX_LAYER_BYTES = 1 << 40

#: name -> limit, for error messages and the docs
LIMITS: dict[str, int] = {
    "num_experts": MAX_EXPERTS,
    "hidden": MAX_HIDDEN,
    "intermediate": MAX_INTERMEDIATE,
    "num_layers": _MAX_LAYERS,
    "top_k": MAX_TOP_K,
    "header_bytes": MAX_HEADER_BYTES,
    "header_tensors": _MAX_HEADER_TENSORS,
    "json_bytes": MAX_JSON_BYTES,
    "json_depth": MAX_JSON_DEPTH,
    "int_digits": MAX_INT_DIGITS,
    "layer_bytes": MAX_LAYER_BYTES,
}


class LimitError(MegaMoEError):
    """A size claimed by the input exceeds a stated limit (megamoe_runtime.files.limits)."""


def check_limit(name: str, value: Any, where: str, error: Type[MegaMoEError] = LimitError,
                label: str | None = None) -> None:
    """Raise `error` (callers keep their own MegaMoEError type) naming `where` and the field `label` (default
    `name`) when integer `value` exceeds ``LIMITS[name]``. Non-integers are left to the caller's type checks."""
    limit = LIMITS[name]
    if isinstance(value, int) and not isinstance(value, bool) and value > limit:
        shown = str(value) if value < 10**30 else f"a number of more than 30 digits"
        what = label or name
        raise error(f"{where}: {what} = {shown} exceeds megamoe's limit of {limit} for {name} "
                    "(megamoe_runtime.files.limits)")
