"""The format contract: what the bytes of a converted folder mean, on no device in particular.

Owns the row table and the layer description (`formats`: `Row`, `ROWS`, `LayerSpec`), the number formats
and reference quantizers (`codecs`), the NVFP4 scale rules (`scales`), the tensor roles (`roles`), the
source checkpoints' names and suffixes (`source_formats`), the experts as readers yield them
(`canonical`), the DeepGEMM kernel layout and the only packing code (`layout`), the tiled arrangement a
backend may read (`weight_tiles`), and the manifest (`manifest`, megamoe.json).

May import: `megamoe_runtime.errors`, `megamoe_runtime.files`, and its own modules (no circle). Never
`backends`, `layer`, `load` or `integrations` (tests/test_import_floors.py).
"""
