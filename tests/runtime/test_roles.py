"""roles.py: the role table, and what the code derived from it is."""
from dataclasses import fields

import pytest

from megamoe_runtime.format import layout, roles
from megamoe_runtime.format.formats import ROWS, get_row


def test_table_facts():
    assert roles.KERNEL_ROLES == tuple(f.name for f in fields(layout.KernelTensors))
    assert roles.EXPERT_ROLES == ("l1_weight", "l1_scale", "l2_weight", "l2_scale", "l1_alpha", "l2_global_scale")
    assert roles.SHARED_ROLES == tuple("shared_" + r for r in roles.KERNEL_ROLES)
    assert roles.MN_MAJOR_ROLES == {"l1_scale", "l2_scale", "shared_l1_scale", "shared_l2_scale"}
    for r in roles.ROLE_TABLE:
        assert r.name.startswith(r.stage) or r.shared and r.kernel_field.startswith(r.stage)
        assert roles.is_shared_role(r.name) == r.shared
        assert roles.ROLE_BY_NAME[r.name] is r
    assert not roles.is_shared_role(roles.PASSTHROUGH_ROLE) and not roles.is_shared_role("shared_nothing")


def test_expected_roles_per_row_in_report_order():
    """What a layer must store, weights first, as the checkpoint planner listed them by hand before the table."""
    for row in ROWS.values():
        for shared in (None, "mxfp8", "bf16"):
            want = ["l1_weight", "l2_weight"]
            if row.has_scales:
                want += ["l1_scale", "l2_scale"]
            if row.weight.has_global_scale:
                want += ["l1_alpha", "l2_global_scale"]
            if shared is not None:
                want += ["shared_l1_weight", "shared_l2_weight"]
                if shared != "bf16":
                    want += ["shared_l1_scale", "shared_l2_scale"]
            got = roles.expected_roles(row.has_scales, row.weight.has_global_scale,
                                       None if shared is None else get_row(shared).has_scales)
            assert got == want, (row.name, shared)


def test_role_of_names_each_stage_and_kind_once():
    """The raw loader names a source tensor's destination by stage and kind (``loaders._param_name``)."""
    assert roles.role_of("l1", "weight") == "l1_weight" and roles.role_of("l2", "scale") == "l2_scale"
    assert roles.role_of("l1", "scalar") == "l1_alpha" and roles.role_of("l2", "scalar") == "l2_global_scale"
    assert roles.role_of("l2", "weight", shared=True) == "shared_l2_weight"
    for r in roles.ROLE_TABLE:
        assert roles.role_of(r.stage, r.kind, r.shared) == r.name
    with pytest.raises(KeyError):
        roles.role_of("l1", "scalar", shared=True)  # the shared expert has no per-expert scalars
