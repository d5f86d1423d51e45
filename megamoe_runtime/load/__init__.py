"""From a folder to filled layers, and the checks on the way.

Owns opening a converted folder and loading its layers (`checkpoint`: `open_checkpoint`, `Checkpoint`),
the plan and checks of a load (`load_checks`), loading an unconverted checkpoint into layers
(`raw_load`), the meta-tensor dry run of a reload (`reload`), and the check of an output folder's files
against its manifest (`verify`).

May import: `megamoe_runtime.errors`, `files`, `format`, `backends`, `layer`, and its own modules
(no circle). Never `integrations` (tests/test_import_floors.py).
"""
