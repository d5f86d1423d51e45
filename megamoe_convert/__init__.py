"""megamoe_convert: quantized MoE checkpoints to the byte layout DeepGEMM's MegaMoE kernels read.

The public API, for scripts that convert without the command line::

    import megamoe_convert as mc
    mc.available_formats()                       # the source formats a reader exists for
    report = mc.inspect("org/model")             # what convert would do; reads headers and scalars only
    summary = mc.convert("org/model", "out/")    # the converted folder, and what was written

Lazy (PEP 562): importing the package imports nothing else, so ``megamoe-convert --help`` stays torch-free;
each name loads its module on first use. Every other name is imported from the module that defines it
(``megamoe_convert.pipeline.convert.convert`` is ``convert``): the package keeps no aliases of module paths.
The modules sit on floors (docs/ARCHITECTURE.md#converter-floors): `readers`, `output`, `pipeline`,
`testing`, `cli`; this file sits above them all and no floor imports it.
"""
from __future__ import annotations

import importlib
from typing import Any

#: public name -> "module:attribute" it is loaded from
_API = {
    "convert": "megamoe_convert.pipeline.convert:convert",
    "inspect": "megamoe_convert.pipeline.inspection:inspect_checkpoint",
    "available_formats": "megamoe_convert.readers:available_formats",
    "ConvertSummary": "megamoe_convert.pipeline.summary:ConvertSummary",
    "InspectReport": "megamoe_convert.pipeline.inspection:InspectReport",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'megamoe_convert' has no attribute {name!r}")
    module, _, attr = _API[name].partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
