"""`MegaMoEConfig`: the ``quantization_config`` a converted folder's config.json carries.

The converter writes ``{"quant_method": "megamoe", "format_version", "row", "manifest",
"source_quantization_config"}``; transformers turns it into this class through the registry, and the
registered quantizer (`quantizer.MegaMoEHfQuantizer`) reads it. ``backend`` is the one loading attribute a
user sets (``from_pretrained(OUT, quantization_config=MegaMoEConfig(backend="triton"))``); it is never
written to disk by the converter, and ``MEGAMOE_BACKEND`` sets it from the environment.
"""
from __future__ import annotations

from typing import Any, Optional

from transformers.utils.quantization_config import QuantizationConfigMixin

from ... import knobs
from ..folder import QUANT_METHOD

__all__ = ["MegaMoEConfig", "BACKENDS"]

#: what ``backend`` may name (the layer's own backends; "auto" follows the device)
BACKENDS = ("auto", "deepgemm", "triton", "reference")


class MegaMoEConfig(QuantizationConfigMixin):
    """The megamoe method's config: what the converter recorded, plus the backend to run on."""

    def __init__(self, format_version: Optional[int] = None, row: Optional[str] = None,
                 manifest: str = "megamoe.json", source_quantization_config: Optional[dict] = None,
                 backend: Optional[str] = None, **kwargs: Any):
        self.quant_method = QUANT_METHOD
        self.format_version = format_version
        self.row = row
        self.manifest = manifest
        self.source_quantization_config = source_quantization_config
        self.backend = backend or knobs.get("MEGAMOE_BACKEND") or "auto"
        if self.backend not in BACKENDS:
            raise ValueError(f"megamoe backend {self.backend!r} is unknown; valid: {', '.join(BACKENDS)}")
        kwargs.pop("quant_method", None)
        self.unknown_fields = sorted(kwargs)

    def get_loading_attributes(self) -> dict:
        return {"backend": self.backend}

    def to_dict(self) -> dict[str, Any]:
        """What config.json holds (``backend`` only when the user chose one): a model saved back keeps the
        converter's record and no run-time choice."""
        out = {"quant_method": QUANT_METHOD, "format_version": self.format_version, "row": self.row,
               "manifest": self.manifest, "source_quantization_config": self.source_quantization_config}
        if self.backend != "auto":
            out["backend"] = self.backend
        return out
