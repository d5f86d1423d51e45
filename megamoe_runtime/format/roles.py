"""The tensor roles of a converted layer, once.

A role names one kernel tensor of a MoE layer: its manifest role, its
safetensors name suffix (``{prefix}.megamoe.{role}``) and the
`DeepGemmMegaMoEExperts` attribute it is loaded into. Each role's facts (L1 or
L2, weight / block scale / per-expert scalar, routed or shared, how it is
stored on disk) are written here and nowhere else; the manifest, the layer,
the layout checks, the checkpoint planner, the reference backend and the
converter read them from this table instead of listing role names by hand
(docs/LAYOUT.md#on-disk). Pure data: no torch, no other runtime module.
"""
from __future__ import annotations

from dataclasses import dataclass

STORAGE_CONTIGUOUS = "contiguous"
STORAGE_MN_MAJOR = "mn_major_physical"
STORAGES = (STORAGE_CONTIGUOUS, STORAGE_MN_MAJOR)

#: Role of a non-expert tensor copied through unchanged (not in the table: it is no kernel tensor).
PASSTHROUGH_ROLE = "passthrough"
SHARED_PREFIX = "shared_"


@dataclass(frozen=True)
class Role:
    """One kernel tensor of a layer.

    ``kind``: ``weight`` (E2M1/E4M3/BF16 elements), ``scale`` (block scales,
    packed int32, an MN-major view stored as its physical base) or ``scalar``
    (NVFP4 per-expert fp32 alphas). ``kernel_field`` is the
    ``layout.KernelTensors`` field the tensor is (routed and shared alike).
    """

    name: str
    stage: str  # "l1" | "l2"
    kind: str  # "weight" | "scale" | "scalar"
    shared: bool = False

    @property
    def storage(self) -> str:
        """How the tensor is stored on disk: decided by role, never by looking at strides (with a size-1 dim an
        MN-major view also counts as contiguous, and the on-disk order must not depend on that accident)."""
        return STORAGE_MN_MAJOR if self.kind == "scale" else STORAGE_CONTIGUOUS

    @property
    def kernel_field(self) -> str:
        return self.name[len(SHARED_PREFIX):] if self.shared else self.name


def _shared(r: Role) -> Role:
    return Role(SHARED_PREFIX + r.name, r.stage, r.kind, shared=True)


_KERNEL = (
    Role("l1_weight", "l1", "weight"),
    Role("l1_scale", "l1", "scale"),
    Role("l2_weight", "l2", "weight"),
    Role("l2_scale", "l2", "scale"),
)
_SCALARS = (
    Role("l1_alpha", "l1", "scalar"),  # [E_l, 2]: gate, up weight_scale_2
    Role("l2_global_scale", "l2", "scalar"),  # [E_l]: w2 weight_scale_2
)

#: Every role, in manifest order: routed kernel tensors (``KernelTensors`` field order), the NVFP4 scalars,
#: then the fused shared expert's kernel tensors (2-D, no expert dim, no scalars).
ROLE_TABLE: tuple[Role, ...] = _KERNEL + _SCALARS + tuple(_shared(r) for r in _KERNEL)
ROLE_BY_NAME: dict[str, Role] = {r.name: r for r in ROLE_TABLE}

#: the routed kernel tensors, in ``layout.KernelTensors`` field order
KERNEL_ROLES = tuple(r.name for r in ROLE_TABLE if not r.shared and r.kind != "scalar")
#: the NVFP4 per-expert scalars (rows with alphas only)
SCALAR_ROLES = tuple(r.name for r in ROLE_TABLE if r.kind == "scalar")
#: roles of expert tensors (also the `DeepGemmMegaMoEExperts` attribute names)
EXPERT_ROLES = KERNEL_ROLES + SCALAR_ROLES
SHARED_ROLES = tuple(r.name for r in ROLE_TABLE if r.shared)
#: roles whose kernel layout is an MN-major view (stored as the physical base)
MN_MAJOR_ROLES = frozenset(r.name for r in ROLE_TABLE if r.storage == STORAGE_MN_MAJOR)


def shared_role(kernel_field: str) -> str:
    """The role of the fused shared expert's tensor for a ``KernelTensors`` field."""
    return SHARED_PREFIX + kernel_field


def role_of(stage: str, kind: str, shared: bool = False) -> str:
    """The role of one stage's tensor of one kind (``role_of("l2", "scalar")`` is ``l2_global_scale``), so a
    loader that knows a source tensor's stage and kind names its destination from this table, not by hand."""
    for r in ROLE_TABLE:
        if (r.stage, r.kind, r.shared) == (stage, kind, shared):
            return r.name
    raise KeyError(f"no role for stage {stage!r}, kind {kind!r}, shared={shared}")


def is_shared_role(role: str) -> bool:
    r = ROLE_BY_NAME.get(role)
    return r is not None and r.shared


def expected_roles(has_scales: bool, has_scalars: bool, shared_has_scales: bool | None) -> list[str]:
    """The roles one layer must store: weights, then block scales (``has_scales``), then the NVFP4 scalars
    (``has_scalars``); then the shared expert's weights and scales (``shared_has_scales`` None: no shared
    expert). The order is the order a missing role is reported in."""
    def pick(shared: bool, kinds: tuple[str, ...]) -> list[str]:
        return [r.name for k in kinds for r in ROLE_TABLE if r.shared == shared and r.kind == k]

    roles = pick(False, ("weight",) + (("scale",) if has_scales else ()) + (("scalar",) if has_scalars else ()))
    if shared_has_scales is not None:
        roles += pick(True, ("weight",) + (("scale",) if shared_has_scales else ()))
    return roles


__all__ = ["Role", "ROLE_TABLE", "ROLE_BY_NAME", "KERNEL_ROLES", "SCALAR_ROLES", "EXPERT_ROLES", "SHARED_ROLES",
           "MN_MAJOR_ROLES", "PASSTHROUGH_ROLE", "STORAGE_CONTIGUOUS", "STORAGE_MN_MAJOR", "STORAGES",
           "shared_role", "role_of", "is_shared_role", "expected_roles"]
