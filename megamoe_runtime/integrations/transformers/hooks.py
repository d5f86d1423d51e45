"""Where ``from_pretrained`` decides how a folder is quantized: the one place the integration steps in.

transformers resolves the folder's stored ``quantization_config`` and the one passed to ``from_pretrained`` in
``get_hf_quantizer`` (quantizers/auto.py, called from modeling_utils). Three things are decided there that
its registries alone get wrong for megamoe folders, so `install` wraps that function (once, idempotently;
every other call passes through unchanged):

* a user's ``MegaMoEConfig(backend=..., verify=...)`` is merged into the folder's config here, silently:
  transformers' own merge warns that the loading attributes "will be overwritten ... The rest will be
  ignored", which reads as "your setting was ignored" although it is the one used;
* a folder holding ``megamoe.json`` whose config.json names another method, or none, is refused in one line:
  transformers would otherwise skip the quantization and load the model with randomly initialised experts;
* a SOURCE checkpoint megamoe converts (ModelOpt, Quark, compressed-tensors MoE exports) that transformers
  cannot load here fails naming ``megamoe-convert convert``, instead of an import error of the producer's
  package (Quark, compressed-tensors) or a size-mismatch report (ModelOpt, which transformers does not read).

Nothing of this runs before the package is imported: transformers 5.17 has no entry point or other discovery
for quantization methods, so the installed start-up hook (`..autoregister`) imports it when transformers
loads its models, or the user does (docs/ENGINES.md#start-up-hook).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from ...errors import CheckpointError
from ...format.manifest import MANIFEST_NAME
from ..folder import QUANT_METHOD, config_value

__all__ = ["install"]

#: the quant_method values of the producer exports ``megamoe-convert convert`` reads
_SOURCE_METHODS = ("modelopt", "quark", "compressed-tensors")

_WRAPPED = "__megamoe_wrapped__"


def install() -> None:
    """Wrap transformers' ``get_hf_quantizer`` where ``from_pretrained`` calls it (idempotent)."""
    from transformers import modeling_utils

    current = modeling_utils.get_hf_quantizer
    if getattr(current, _WRAPPED, False):
        return
    modeling_utils.get_hf_quantizer = _wrap(current)


def _wrap(original: Callable) -> Callable:
    def get_hf_quantizer(config: Any, quantization_config: Any, *args: Any, **kwargs: Any):
        from .config import MegaMoEConfig

        stored, holder = _stored(config)
        method = _method(stored)
        folder = _local_folder(config)
        converted = folder is not None and (folder / MANIFEST_NAME).is_file()
        if converted and method != QUANT_METHOD:
            raise CheckpointError(
                f"{folder} holds {MANIFEST_NAME} (a megamoe output) but config.json's quantization_config "
                + (f"names quant_method {method!r}" if stored is not None else "is missing")
                + f", not {QUANT_METHOD!r}: loaded so, its experts would be random; restore the config.json the "
                "converter wrote (or convert again)")
        if method == QUANT_METHOD and isinstance(quantization_config, MegaMoEConfig):
            holder.quantization_config = _merge_configs(stored, quantization_config)
            quantization_config = None  # merged: transformers' own merge (and its warning) has nothing to do
        if folder is None or converted or method not in _SOURCE_METHODS or not _is_moe(config):
            return original(config, quantization_config, *args, **kwargs)
        hint = (f"to serve this {method} MoE export with megamoe, convert it first: megamoe-convert convert "
                f"{folder} OUT, then from_pretrained(OUT)")
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

        if method not in AUTO_QUANTIZATION_CONFIG_MAPPING:
            raise CheckpointError(f"{folder}: transformers does not read {method} checkpoints (it would skip the "
                                  f"quantization_config and load packed weights into a bf16 model); {hint}")
        try:
            return original(config, quantization_config, *args, **kwargs)
        except ImportError as e:
            raise ImportError(f"{_first_line(e)}; or, {hint}") from None

    setattr(get_hf_quantizer, _WRAPPED, True)
    get_hf_quantizer.__wrapped__ = original  # type: ignore[attr-defined]
    return get_hf_quantizer


def _merge_configs(stored: Any, chosen: Any) -> dict:
    """The folder's config (a dict, or a MegaMoEConfig) with the loading attributes ``chosen`` names, as the
    dict transformers expects to find in config.json."""
    base = dict(stored) if isinstance(stored, dict) else stored.to_dict()
    base.update(chosen.get_loading_attributes())
    return base


def _stored(config: Any) -> tuple[Optional[Any], Any]:
    """(the folder's quantization_config, the config object holding it), where transformers looks for it."""
    if getattr(config, "quantization_config", None) is not None:
        return config.quantization_config, config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "quantization_config", None), (text if text is not None else config)


def _method(stored: Any) -> Optional[str]:
    if stored is None:
        return None
    method = stored.get("quant_method") if isinstance(stored, dict) else getattr(stored, "quant_method", None)
    return getattr(method, "value", method)


def _local_folder(config: Any) -> Optional[Path]:
    name = getattr(config, "name_or_path", None)
    if not name:
        return None
    p = Path(name)
    return p if p.is_dir() else None


def _is_moe(config: Any) -> bool:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return config_value(text.to_dict(), "num_experts") is not None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
