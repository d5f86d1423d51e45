"""The conversion pipeline: from a source checkpoint to the kernel layout, through the output floor.

Owns the plan of every output tensor and file (`plan`), the checks before any byte is written
(`preflight`, `checks`), the shared-expert precision (`shared`), the layer-by-layer packing (`stream`,
`direct`), the run inside the temp folder (`run`), the entry point (`convert`), what a conversion reports
(`summary`) and the report without converting (`inspection`: ``megamoe-convert inspect``; `convert` uses
its estimate, so it sits here, not with the command line).

Floor 2 of the converter (docs/ARCHITECTURE.md#converter-floors). May import: the runtime, `readers`,
`output`, and its own modules (no circle). Never `testing` or `cli` (tests/test_import_floors.py).
"""
