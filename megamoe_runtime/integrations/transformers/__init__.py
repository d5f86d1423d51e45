"""transformers integration: ``from_pretrained`` on a folder ``megamoe-convert convert`` wrote.

    model = AutoModelForCausalLM.from_pretrained(OUT, dtype=torch.bfloat16, device_map="cuda")
    model.generate(...)

The converter writes ``quantization_config.quant_method = "megamoe"`` into OUT's config.json; importing this
package registers that method's config (`MegaMoEConfig`) and quantizer (`MegaMoEHfQuantizer`) with
transformers' own registries (``register_quantization_config`` / ``register_quantizer``), the plugin
mechanism its maintainers provide, and steps into the one function where transformers resolves a folder's
quantization (`hooks`: a user's loading attributes merged without a warning, a megamoe folder whose
config.json lost the method refused, a source export pointed at ``megamoe-convert convert``). transformers
has no entry-point discovery for quantizers: an installed megamoe's start-up hook (`..autoregister`) makes
this import when transformers loads its models; a process where the hook does not run (megamoe on
PYTHONPATH only, ``python -S``, ``MEGAMOE_AUTOREGISTER=0``) imports this package itself, once
(docs/ENGINES.md#start-up-hook).

The backend follows the device (DeepGEMM where it runs, the project's triton kernels on Hopper, the fp32
reference on the CPU); ``MegaMoEConfig(backend=...)`` or ``MEGAMOE_BACKEND`` names one, and
``MegaMoEConfig(verify="checksums")`` or ``MEGAMOE_VERIFY`` hashes every loaded tensor against the manifest.
"""
from __future__ import annotations

from . import hooks
from .config import BACKENDS, MegaMoEConfig
from .quantizer import MegaMoEHfQuantizer

__all__ = ["MegaMoEConfig", "MegaMoEHfQuantizer", "BACKENDS", "register"]


def register() -> None:
    """Register the ``megamoe`` method with transformers (idempotent: a second call changes nothing).

    ``quantization_config=MegaMoEConfig(backend=..., verify=...)`` passed to ``from_pretrained`` is merged
    into the folder's config (`hooks`), so both can be chosen per load."""
    from transformers.quantizers import auto

    from ..folder import QUANT_METHOD

    if auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not MegaMoEConfig:
        auto.register_quantization_config(QUANT_METHOD)(MegaMoEConfig)
    if auto.AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not MegaMoEHfQuantizer:
        auto.register_quantizer(QUANT_METHOD)(MegaMoEHfQuantizer)
    hooks.install()
    types = getattr(auto, "LOADING_ATTRIBUTES_CONFIG_TYPES", None)
    if isinstance(types, tuple) and MegaMoEConfig not in types:
        auto.LOADING_ATTRIBUTES_CONFIG_TYPES = types + (MegaMoEConfig,)


register()
