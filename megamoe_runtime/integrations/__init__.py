"""Engine integrations: open a converted folder inside the engine a user already runs.

What lives here and what it may import:

* ``folder`` -- engine-neutral: check that a converted folder belongs to the model config an engine is about
  to build (before any weight is allocated), and the engine-neutral facts every integration needs.
* ``dense`` -- decode the non-expert linears a quantized source left in its producer's format into the
  engine's float dtype (the engines run those layers in float; docs/ENGINES.md#non-expert-linears).
* ``transformers`` -- the ``megamoe`` quantization method for transformers' ``from_pretrained``.
* ``autoregister`` -- the start-up hook an installed ``megamoe-autoregister.pth`` imports: it imports
  ``transformers`` (this package's) once transformers loads its models, and nothing before that.
* ``vllm`` -- the vLLM plugin (entry point ``vllm.general_plugins``).

Each engine package imports its engine lazily and nothing here is imported by ``megamoe_runtime`` itself:
the base install never needs transformers or vLLM. They import downward only: the runtime's public API
(checkpoint, layer, codecs, errors), never the converter.

May import: every floor of the runtime below (`errors`, `files`, `format`, `backends`, `layer`, `load`) and
its own modules (no circle); never `megamoe_convert` (tests/test_import_floors.py).
"""
