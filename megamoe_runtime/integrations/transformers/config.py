"""`MegaMoEConfig`: the ``quantization_config`` a converted folder's config.json carries.

The converter writes ``{"quant_method": "megamoe", "format_version", "row", "manifest",
"source_quantization_config"}``; transformers turns it into this class through the registry, and the
registered quantizer (`quantizer.MegaMoEHfQuantizer`) reads it. ``backend`` and ``verify`` are the loading
attributes a user sets (``from_pretrained(OUT, quantization_config=MegaMoEConfig(backend="triton",
verify="checksums"))``); the converter never writes them, ``MEGAMOE_BACKEND`` / ``MEGAMOE_VERIFY`` set them
from the environment, and one the user passes wins over the folder's (`hooks`).
"""
from __future__ import annotations

from typing import Any, Optional

from transformers.utils.quantization_config import QuantizationConfigMixin

from ... import knobs
from ..folder import QUANT_METHOD, verify_level

__all__ = ["MegaMoEConfig", "BACKENDS"]

#: what ``backend`` may name (the layer's own backends; "auto" follows the device)
BACKENDS = ("auto", "deepgemm", "triton", "reference")

#: the attributes a user chooses per load (everything else is the converter's record of the folder)
_LOADING_ATTRIBUTES = ("backend", "verify")


class MegaMoEConfig(QuantizationConfigMixin):
    """The megamoe method's config: what the converter recorded, plus the backend to run on and the check
    level of every load (``"none"``, ``"headers"``, ``"checksums"``: megamoe_runtime.open_checkpoint's)."""

    def __init__(self, format_version: Optional[int] = None, row: Optional[str] = None,
                 manifest: str = "megamoe.json", source_quantization_config: Optional[dict] = None,
                 backend: Optional[str] = None, verify: Optional[str] = None, **kwargs: Any):
        self.quant_method = QUANT_METHOD
        self.format_version = format_version
        self.row = row
        self.manifest = manifest
        self.source_quantization_config = source_quantization_config
        #: what the user (or config.json) named, before the environment's and the defaults' fill-in
        self.chosen = {k: v for k, v in zip(_LOADING_ATTRIBUTES, (backend, verify)) if v is not None}
        self.backend = backend or knobs.get("MEGAMOE_BACKEND") or "auto"
        if self.backend not in BACKENDS:
            raise ValueError(f"megamoe backend {self.backend!r} is unknown; valid: {', '.join(BACKENDS)}")
        self.verify = verify_level({"verify": verify})
        kwargs.pop("quant_method", None)
        self.unknown_fields = sorted(kwargs)

    def get_loading_attributes(self) -> dict:
        """The loading attributes the user named (not the ones filled in from the environment or defaults)."""
        return dict(self.chosen)

    def to_dict(self) -> dict[str, Any]:
        """What config.json holds (``backend`` / ``verify`` only when chosen): a model saved back keeps the
        converter's record and no run-time choice of the environment."""
        out = {"quant_method": QUANT_METHOD, "format_version": self.format_version, "row": self.row,
               "manifest": self.manifest, "source_quantization_config": self.source_quantization_config}
        out.update(self.chosen)
        return out
