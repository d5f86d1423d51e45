"""Every built-in backend declares the whole `Backend` protocol, the EP members included."""
from __future__ import annotations

import pytest
import torch

from megamoe_runtime.backends import Backend
from megamoe_runtime.backends.deepgemm import DeepGemmBackend
from megamoe_runtime.backends.reference import ReferenceBackend
from megamoe_runtime.backends.triton import TritonBackend
from megamoe_runtime.errors import MegaMoEError

MEMBERS = ("name", "supports", "supports_fused_shared", "forward", "pairs", "shared_slot")


@pytest.mark.parametrize("cls", [ReferenceBackend, TritonBackend, DeepGemmBackend], ids=lambda c: c.__name__)
def test_backend_classes_declare_every_member(cls):
    missing = [m for m in MEMBERS if not hasattr(cls, m)]
    assert missing == []


def test_reference_instance_is_a_backend_and_computes_pairs():
    be = ReferenceBackend()
    assert isinstance(be, Backend) and callable(be.pairs) and callable(be.shared_slot)


def test_a_backend_without_pair_compute_is_refused_by_ep(monkeypatch):
    """deepgemm declares pairs = None (its kernels do EP): ep_forward names it instead of failing later."""
    from megamoe_runtime.format.formats import ActivationSpec, LayerSpec
    from megamoe_runtime.layer import ep

    class Stub:
        name, pairs, shared_slot = "stub", None, None

    class Layer:
        spec = LayerSpec("bf16", 128, 128, 4, 2, ActivationSpec("swiglu"))
        backend = Stub()
        shared_fused = False

    monkeypatch.setattr(ep.dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(ep.dist, "get_rank", lambda group=None: 0)
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    with pytest.raises(MegaMoEError, match="backend 'stub' has no expert-parallel pair compute"):
        ep.ep_forward(Layer(), x, torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long))
