"""The vLLM plugin: serve a converted megamoe folder with ``vllm serve OUT --load-format megamoe``.

Installed with the ``[vllm]`` extra, vLLM finds it through the ``vllm.general_plugins`` entry point
(``megamoe = "megamoe_runtime.integrations.vllm:register"``) in every process it starts; `register` then adds
two things through vLLM's own registries (docs/ENGINES.md#vllm):

* the quantization method ``megamoe`` (``register_quantization_config``). Its
  ``override_quantization_method`` claims a config whose ``quantization_config.quant_method`` is ``"megamoe"``
  (what ``megamoe-convert convert`` writes), so no ``--quantization`` flag is needed. Its FusedMoE method
  allocates each routed-expert layer as a megamoe ``DeepGemmMegaMoEExperts`` in kernel layout (parameters
  named as vLLM's own ``DeepGemmMegaMoEExperts`` names them: ``w13_weight``, ``w13_weight_scale``,
  ``w2_weight``, ``w2_weight_scale``) and runs it on the backend the device supports. Every other layer goes
  to the source's own quantization method (``source_quantization_config``), or unquantized.
* the load format ``megamoe`` (``register_model_loader``): vLLM's default loader for the non-expert tensors
  (the expert shards are never opened by it), then every MoE layer filled from the pre-laid shards with one
  copy per tensor and no transform, each EP rank reading only the files that hold its experts.

Bad input is refused when vLLM builds its config (``QuantizationConfig.maybe_update_config``), before any
weight is allocated: not a megamoe folder, a manifest that does not describe config.json's model, an
architecture this plugin does not know, a missing or truncated shard.

Nothing here imports vLLM until `register` runs: ``import megamoe_runtime`` never needs it.
"""
from __future__ import annotations

__all__ = ["register"]

_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``megamoe`` quantization method and load format.

    Idempotent (vLLM calls it once per process, tests may call it again)."""
    global _registered
    if _registered:
        return
    from . import plugin

    plugin.register_all()
    _registered = True
