"""The MoE layer: routed experts in kernel layout, how bytes get into them, and expert parallelism.

Owns `DeepGemmMegaMoEExperts` and `MegaMoESharedExpert` (`experts`), the per-tensor weight loaders the
layer's methods delegate to (`loaders`: one `copy_` per stored tensor, the vLLM-style raw loader, the
shared expert's loader), the EP forward over a process group (`ep`), and how `torch.compile` sees the
layer's backend call (`compiled`: one custom op).

May import: `megamoe_runtime.errors`, `files`, `format`, `backends`, and its own modules (no circle).
Never `load` or `integrations`: the checkpoint side builds layers, a layer never opens a folder
(tests/test_import_floors.py).
"""
