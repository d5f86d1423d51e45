"""megamoe_runtime.format.scales: the NVFP4 scale rules, and that every user takes them from here."""
from __future__ import annotations

import math

import pytest
import torch

from megamoe_runtime.format import scales


def test_gate_up_agreement_boundary():
    assert scales.gate_up_agree(1.0, 1.0)
    assert scales.gate_up_agree(1.0, 1.0 + 0.9e-5) and scales.gate_up_agree(1.0 + 0.9e-5, 1.0)  # either order
    assert not scales.gate_up_agree(1.0, 1.0 + 2e-5)  # negative control: just past the tolerance
    assert not scales.gate_up_agree(0.5, 5.0)
    assert scales.gate_up_relative_difference(1.0, 2.0) == 0.5


def test_tensor_form_matches_the_float_form():
    g = torch.tensor([1.0, 1.0, 2.0, 3.0, 1e-3, 7.0], dtype=torch.float32)
    u = torch.tensor([1.0, 1.0 + 2e-5, 2.0 * (1 + 5e-6), 3.3, 1e-3 * (1 - 3e-5), 7.0], dtype=torch.float32)
    want = [i for i in range(len(g)) if not scales.gate_up_agree(float(g[i]), float(u[i]))]
    assert want == [1, 3, 4]
    assert scales.gate_up_disagreeing(g, u) == want
    assert scales.gate_up_disagreeing(g, g) == []


def test_a2_is_the_max_over_all_experts():
    assert scales.global_l2_activation_scale([0.25, 2.0, 0.5]) == 2.0
    assert scales.global_l2_activation_scale(iter([3])) == 3.0
    assert scales.global_l2_activation_scale([]) is None


@pytest.mark.parametrize("v", [0.0, -1.0, math.inf, math.nan, True, "1.0", None])
def test_invalid_scales(v):
    assert not scales.is_valid_scale(v)


def test_valid_scales():
    assert scales.is_valid_scale(1) and scales.is_valid_scale(2.0 ** -126)


def test_one_definition_used_by_checks_loaders_and_deepgemm():
    """The converter's checks, the raw loader and the deepgemm backend share these objects."""
    from megamoe_convert.pipeline import checks
    from megamoe_runtime.backends import deepgemm
    from megamoe_runtime.layer import loaders

    assert checks.GATE_UP_RTOL is scales.W13_RTOL and loaders.W13_RTOL is scales.W13_RTOL
    assert deepgemm.W13_RTOL is scales.W13_RTOL
    assert checks.gate_up_agree is scales.gate_up_agree and checks._finite_pos is scales.is_valid_scale
