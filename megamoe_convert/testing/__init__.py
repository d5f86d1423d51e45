"""Test support that ships with the package: synthetic checkpoints and the independent reference.

Owns `synth` (small checkpoints in every source format)
and `selfcheck` (an fp32 MoE evaluated from a source's own tensors, and the per-row thresholds a served
layer must meet against it). The command line uses both (``demo``, ``synth``, ``verify --against``); the
pipeline uses neither.

Floor 3 of the converter (docs/ARCHITECTURE.md#converter-floors). May import: the runtime, `readers`,
`output`, `pipeline`, and its own modules (no circle). Never `cli` (tests/test_import_floors.py).
"""
