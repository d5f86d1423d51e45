"""Activation recipes: what the producer did to the expert inputs, and what the kernel does instead.

A checkpoint's weights are copied bit for bit, but no MegaMoE kernel keeps the
producer's *activation* recipe: every row quantizes its inputs itself (the mx
rows to MXFP8 per 32, nvfp4 to NVFP4 per 16, bf16 not at all; docs/NUMERICS.md).
Each reader says what its source did (`ActivationRecipe`, a per-format fact
that lives in the format's module); `compare` says how the kernel's recipe
relates to it, and one rule decides:

* the kernel's activations are as fine or finer (ModelOpt MXFP4 W4A4 or
  W4A8_MXFP4_FP8 -> MXFP8, NVFP4 -> NVFP4): convert, and record both recipes
  (summary, ``inspect``, ``megamoe.json`` ``source.recipe``);
* they are coarser (fewer element bits: a weight-only export whose BF16
  activations become 8- or 4-bit, FP8 activations that become NVFP4): refuse
  unless the user opts in with ``--accept-activation-change``
  (``accept_activation_change=True``), since the model would change.

"Finer" compares element bits first, then scale granularity (a block scale
per 16 or 32 beats one per tensor); a recipe the checkpoint does not declare
is recorded as such and never refused, while one it states but this module
cannot classify (``unknown``) needs the flag like a coarser one: what the
kernel does to it may be coarser, and the converter refuses what it cannot read.
"""
from __future__ import annotations

from dataclasses import dataclass

from megamoe_runtime.format.formats import DISPATCH_DESCRIPTIONS, ROWS, get_row

#: the CLI flag (and API keyword) that accepts a coarser activation recipe
ACCEPT_FLAG = "--accept-activation-change"

#: kind -> (element bits, granularity rank: 0 none/per-tensor, 1 per token, 2 per block)
_PRECISION = {
    "bf16": (16, 2),
    "fp8": (8, 0),  # one scale per tensor (or per token when dynamic per-token)
    "fp8_128": (8, 2),  # dynamic, one fp32 scale per 1x128 group of a token
    "mxfp8": (8, 2),
    "mxfp4": (4, 2),
    "nvfp4": (4, 2),
}

#: what each row's kernels feed the first GEMM (`Row.dispatch`, docs/NUMERICS.md)
KERNEL_ACTIVATIONS = {name: (r.dispatch, DISPATCH_DESCRIPTIONS[r.dispatch]) for name, r in ROWS.items()}


@dataclass(frozen=True)
class ActivationRecipe:
    """What the producer did to the inputs of the expert GEMMs.

    ``kind``: "bf16" (not quantized: a weight-only export), "fp8" (FP8 E4M3
    with one scale per tensor), "mxfp8", "mxfp4", "nvfp4", or "undeclared".
    ``static``: the checkpoint holds calibrated activation scales.
    ``description``: the producer's own words (recipe name, config), for messages.
    """

    kind: str
    static: bool
    description: str

    def to_dict(self) -> dict:
        return {"kind": self.kind, "static": self.static, "description": self.description}


UNDECLARED = ActivationRecipe("undeclared", False, "the checkpoint does not declare an activation recipe")


def unknown(description: str) -> ActivationRecipe:
    """A recipe the producer config states but this converter cannot classify
    (e.g. FP8 per 128-block or per token): unlike an undeclared one it needs
    `ACCEPT_FLAG`, since the kernel's activations may be coarser."""
    return ActivationRecipe("unknown", False, description)


@dataclass(frozen=True)
class ActivationChange:
    """How the kernel's activation recipe relates to the source's.

    ``relation``: "same" | "finer" | "coarser" | "different" | "undeclared";
    ``needs_flag``: converting changes the model's activation precision for
    the worse and needs `ACCEPT_FLAG`; ``accepted``: the user passed it.
    """

    source: ActivationRecipe
    row: str
    kernel_kind: str
    kernel_description: str
    relation: str
    needs_flag: bool
    accepted: bool = False
    #: what accepted it, as the user typed it: `ACCEPT_FLAG`, or ``--quantize ROW`` (quantizing an
    #: unquantized model is itself that choice); recorded as given, never a flag the user did not pass
    accepted_by: str | None = None

    def summary(self) -> str:
        """One line for the convert summary and inspect."""
        what = {"same": "the same precision", "finer": "finer than the source",
                "coarser": "COARSER than the source", "different": "a different recipe of the same precision",
                "undeclared": "the source recipe is not declared",
                "unknown": "the source recipe is one this converter does not know"}[self.relation]
        line = f"activations: source {self.source.description}; kernel {self.kernel_description} ({what})"
        if self.needs_flag:
            line += f"; {'accepted with ' + self.accepted_with if self.accepted else 'convert needs ' + ACCEPT_FLAG}"
        return line

    def to_dict(self) -> dict:
        """The manifest's ``source.recipe.activations`` record."""
        return {"source": self.source.to_dict(), "kernel": {"row": self.row, "kind": self.kernel_kind,
                                                           "description": self.kernel_description},
                "relation": self.relation, "needs_flag": self.needs_flag,
                "accepted_with": self.accepted_with if (self.needs_flag and self.accepted) else None}

    @property
    def accepted_with(self) -> str:
        return self.accepted_by or ACCEPT_FLAG

    def refusal(self, source_id: str, format_name: str) -> str:
        """The FormatError text when `needs_flag` and the flag is absent."""
        extra = (" NVFP4 also needs the global L2 activation scale: the checkpoint's w2 input scales give it when "
                 "calibrated, otherwise pass --l2-activation-scale." if get_row(self.row).has_alphas else "")
        if self.relation == "unknown":
            how = (f"the source declares an activation recipe this converter does not know "
                   f"({self.source.description}); the {self.row} kernels feed activations as "
                   f"{self.kernel_description}, which may be coarser, so the converted model may not compute what "
                   f"the producer calibrated")
        else:
            how = (f"the source recipe quantizes activations as {self.source.description}, but the {self.row} "
                   f"kernels feed them as {self.kernel_description}, which is coarser ({_bits(self.source.kind)} -> "
                   f"{_bits(self.kernel_kind)} bits per element), so the converted model would not compute what the "
                   "producer calibrated")
        return (f"{source_id}: {format_name}: {how}. Pass {ACCEPT_FLAG} "
                f"(accept_activation_change=True) to convert it anyway (the change is recorded in megamoe.json), or "
                f"re-export with a recipe whose activations the kernel does not make coarser "
                f"({_KEEPS[self.row]}).{extra}")


#: per row, producer recipes whose activations that row's kernel keeps or refines (`Row.source_recipes`)
_KEEPS = {name: r.source_recipes for name, r in ROWS.items()}


def _bits(kind: str) -> int:
    return _PRECISION[kind][0]


def compare(source: ActivationRecipe, row: str, accepted: bool = False, accepted_by: str | None = None
            ) -> ActivationChange:
    """Relate the source recipe to row ``row``'s kernel activations; ``accepted_by``: the option that
    accepted a coarser recipe (default `ACCEPT_FLAG`)."""
    kk, kdesc = KERNEL_ACTIVATIONS[row]
    if source.kind == "unknown":
        relation = "unknown"
    elif source.kind not in _PRECISION:
        relation = "undeclared"
    else:
        sb, sg = _PRECISION[source.kind]
        kb, kg = _PRECISION[kk]
        if (sb, sg, source.kind) == (kb, kg, kk):
            relation = "same"
        elif kb < sb:
            relation = "coarser"
        elif kb > sb or kg > sg:
            relation = "finer"
        else:
            relation = "different"
    return ActivationChange(source, row, kk, kdesc, relation, relation in ("coarser", "unknown"), accepted,
                            accepted_by if accepted else None)


def manifest_record(reader, l2_activation_scale_given: bool = False) -> dict:
    """``megamoe.json`` ``source.recipe``: the activation change and, for the
    nvfp4 row, how the global L2 activation scale a2 was obtained."""
    rec: dict = {"activations": reader.activation_change.to_dict() if reader.activation_change else None}
    if reader.weights_note:  # weights re-encoded on the way (Quark fake-quantized MXFP8)
        rec["weights"] = reader.weights_note
    if get_row(reader.row).has_alphas:
        if l2_activation_scale_given:
            rule = "given with --l2-activation-scale (the checkpoint has no w2 input scales)"
        else:
            rule = reader.l2_activation_scale_rule or "max over all experts of the w2 input scale"
        rec["l2_activation_scale"] = rule
    return rec


__all__ = ["ACCEPT_FLAG", "KERNEL_ACTIVATIONS", "ActivationRecipe", "ActivationChange", "UNDECLARED", "unknown",
           "compare",
           "manifest_record"]
