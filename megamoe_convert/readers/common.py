"""Machinery shared by the format readers: tensor schemes and a generic reader.

Every supported format stores an expert projection as one module with a few
suffixed tensors (``weight``, ``weight_scale``, ``weight_scale_2``, ...). A
:class:`Scheme` says, per format, which suffixes carry the weight, the block
scale, the global and the input scale, which safetensors dtypes are accepted,
and how a synthetic checkpoint writes them (:meth:`Scheme.encode`); what a
suffix means (weight, scale, divisor or multiplier) is read from
``megamoe_runtime.format.source_formats``, the table the raw loader uses.
:class:`SchemeReader` then does the rest once for every format: finds the
experts by name (``naming.scan``), checks presence, dtype and shape of every
tensor against the config from the headers alone, and reads one expert at a
time into canonical :class:`ExpertTensors` without repacking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, ClassVar, Mapping

import torch

from megamoe_runtime.errors import CheckpointError, FormatError, ScaleError
from megamoe_runtime.files.safetensors_header import DTYPES
from megamoe_runtime.format.canonical import ExpertTensors, ProjectionTensors
from megamoe_runtime.format.formats import Element, get_row
from megamoe_runtime.format.source_formats import SUFFIXES

from . import naming
from .base import CheckpointReader, ExpertScalars, ModelFacts, MoELayerInfo, SharedInfo

FLOAT_DTYPES = ("BF16", "F16", "F32")


#: Param.key -> the kind `megamoe_runtime.format.source_formats` gives the same suffixes
_KIND_OF_KEY = {"weight": "weight", "scale": "scale", "global": "global_scale", "input": "input_scale"}


@dataclass(frozen=True)
class Param:
    """One stored tensor of a projection module: the converter's view of the
    runtime's suffix meaning (`megamoe_runtime.format.source_formats`), plus what only
    reading needs (accepted dtypes, whether it must be present, a change of
    convention). Whether the stored float is a divisor is the runtime's fact,
    not restated here, so the reader and the raw loader cannot disagree."""

    key: str  # "weight" | "scale" | "global" | "input"
    suffixes: tuple[str, ...]
    dtypes: tuple[str, ...]
    required: bool = True
    #: (a, b): canonical = fl32(fl32(stored * a) / b), a change of convention (ModelOpt W4A8_NVFP4_FP8's
    #: FP8 input_scale, amax/448, as the NVFP4 global activation scale, amax/2688: (448, 2688))
    rescale: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        want = _KIND_OF_KEY[self.key]
        for s in self.suffixes:
            m = SUFFIXES.get(s)
            if m is not None and m.kind != want:
                raise TypeError(f"Param {self.key!r}: suffix {s!r} is a {m.kind} in megamoe_runtime.format.source_formats")
        if len({self._divisor(s) for s in self.suffixes}) > 1:
            raise TypeError(f"Param {self.key!r}: suffixes {self.suffixes} mix divisors and multipliers")

    @staticmethod
    def _divisor(suffix: str) -> bool:
        m = SUFFIXES.get(suffix)
        return m is not None and m.divisor

    @property
    def invert(self) -> bool:
        """Stored as a divisor (compressed-tensors): canonical = 1 / stored."""
        return self._divisor(self.suffixes[0])


@dataclass(frozen=True)
class Scheme:
    """How one format stores a projection; ``encoding`` is the canonical row."""

    name: str
    encoding: str
    params: tuple[Param, ...]
    ignored: tuple[str, ...] = ()
    #: UE8M0 scales may be stored per block of R rows x C columns (C a multiple
    #: of 32) and are expanded to the canonical per-row, per-32 scales: exact,
    #: since every element of a block shares the byte (DeepSeek-V4 FP8 128x128,
    #: Quark per_block [R, 32]).
    blocked_scales: bool = False
    #: E4M3 block scales stored per this many elements (a multiple of the row's group, e.g. 32 for
    #: ModelOpt W4A8_NVFP4_FP8) and repeated to the row's per-16 scales: exact, every element of a
    #: stored block keeps its scale byte
    stored_scale_group: int | None = None
    #: the shape the format stores a per-tensor float scale in (compressed-tensors: ``[1]``); read back as
    #: either, this is what :meth:`encode` writes
    scalar_shape: tuple[int, ...] = ()

    def encode(self, pt: ProjectionTensors) -> dict[str, torch.Tensor]:
        """The inverse of reading: one projection in canonical encoding as this
        format stores it (suffix -> tensor), for the synthetic checkpoints
        (``megamoe_convert.testing.synth``). Each tensor goes under the first suffix and
        the first dtype its Param accepts (bytes reinterpreted, never
        converted); float scales are inverted where the format stores divisors.
        Block scales are written per row (``blocked_scales`` schemes accept
        that too); schemes that change a convention on read (``rescale``,
        ``stored_scale_group``) have no inverse here."""
        if self.stored_scale_group or any(p.rescale for p in self.params):
            raise NotImplementedError(f"{self.name}: no synthetic encoder for a scheme that converts on read")
        out: dict[str, torch.Tensor] = {}
        for p in self.params:
            if p.key in ("weight", "scale"):
                t = pt.weight if p.key == "weight" else pt.scale
                out[p.suffixes[0]] = t.view(DTYPES[p.dtypes[0]])
                continue
            v = pt.global_scale if p.key == "global" else pt.input_scale
            if v is None:
                continue
            out[p.suffixes[0]] = torch.tensor(1.0 / v if p.invert else v, dtype=torch.float32).reshape(
                self.scalar_shape)
        return out

    def param(self, key: str) -> Param | None:
        for p in self.params:
            if p.key == key:
                return p
        return None

    def known_suffixes(self) -> set[str]:
        out = set(self.ignored)
        for p in self.params:
            out |= set(p.suffixes)
        return out

    def matches(self, tensors: Mapping[str, str], headers: Mapping[str, tuple[str, tuple[int, ...]]]) -> bool:
        """Whether a module's tensors look like this scheme (required keys present,
        weight dtype accepted)."""
        for p in self.params:
            if not p.required:
                continue
            hit = [s for s in p.suffixes if s in tensors]
            if not hit:
                return False
            if p.key == "weight" and headers[tensors[hit[0]]][0] not in p.dtypes:
                return False
        return True


BF16_SCHEME = Scheme(
    name="unquantized",
    encoding="bf16",
    params=(Param("weight", ("weight",), FLOAT_DTYPES),),
)


@dataclass(frozen=True)
class Resolved:
    """A projection's tensors after header checks: key -> tensor name."""

    module: str
    role: str
    names: dict[str, str]
    out: int
    k: int
    scale_block: tuple[int, int] | None = None  # (R, C) when stored blocked


def _block_factor(stored: int, full: int, unit: int) -> int | None:
    """The block size R (a multiple of ``unit``) with ceil(full / R) == stored.

    Real block sizes are powers of two (128x128 DeepSeek, [32, 32] Quark), so
    those are tried first, smallest first: ceil(300/R) == 3 must mean R=128,
    not R=100. Other multiples of ``unit`` only when no power of two fits."""
    if stored <= 0:
        return None
    r = unit
    while r <= 2 * max(full, unit):
        if -(-full // r) == stored:
            return r
        r *= 2
    r = unit
    while r <= max(full, unit):
        if -(-full // r) == stored:
            return r
        r += unit
    return None


class SchemeReader(CheckpointReader):
    """A reader driven by a :class:`Scheme` (subclasses set ``scheme``)."""

    scheme: ClassVar[Scheme]
    #: schemes to try, in order, for shared experts (routed scheme first)
    shared_schemes: ClassVar[tuple[Scheme, ...]] = ()
    #: fused 3-D experts are plain float parameters; only the unquantized reader reads them
    reads_fused: ClassVar[bool] = False
    #: whether `weight_byte_ranges` may offer the source bytes of routed weights (readers whose
    #: ``read_expert`` returns the stored weight bytes unchanged; see `weight_byte_ranges`)
    direct_weight_bytes: ClassVar[bool] = False

    @classmethod
    def global_scale_name(cls) -> str:
        """The scheme's ``global`` parameter's stored name."""
        return next((p.suffixes[0] for p in cls.scheme.params if p.key == "global"), "weight_scale_2")

    @classmethod
    def synthetic_row(cls, variant: str) -> str:
        """The encoding of ``scheme``, which `encode_expert` writes (DeepSeek-V4: the FP4 experts)."""
        return cls.scheme.encoding

    @classmethod
    def encode_expert(cls, variant: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                      input_scales: Mapping[str, float], shared_global: bool = True,
                      ) -> dict[str, dict[str, torch.Tensor]]:
        """The row's reference quantizers (``ExpertTensors.quantize``), then
        ``scheme.encode`` per projection: the bytes ``read_expert`` reads back."""
        scheme = cls.scheme
        et = ExpertTensors.quantize(scheme.encoding, gate, up, down, shared_gate_up_global=shared_global)
        has_input = scheme.param("input") is not None
        return {role: scheme.encode(replace(getattr(et, role), input_scale=input_scales[role] if has_input else None))
                for role in naming.ROLES}

    def __init__(self, source) -> None:
        super().__init__(source)
        self.config: Mapping[str, Any] = source.config
        self.row = self.scheme.encoding if not type(self).row else type(self).row
        self._ignore_patterns: tuple[str, ...] = ()

    # ------------------------------------------------------------------ helpers
    def _hdr(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self.source.header(name)

    def _where(self, tensor: str) -> str:
        try:
            f = self.source.file_of(tensor).name
        except CheckpointError:
            f = "?"
        return f"{tensor} (in {f})"

    def excluded_by_config(self, module: str) -> str | None:
        """The entry of the quantization config's ignore/exclude list that names ``module``, or None
        (only used to word errors; the tensors decide)."""
        for pat in self._ignore_patterns:
            if self._ignore_names(pat, module):
                return pat
        return None

    @staticmethod
    def _ignore_names(pat: str, module: str) -> bool:
        """Whether ignore-list entry ``pat`` names ``module``: compressed-tensors' / ModelOpt's / Quark's rule
        (``re:`` + a regex matched at the start, else a glob or the exact name). A reader whose producer
        matches otherwise overrides it."""
        from fnmatch import fnmatchcase
        import re

        if pat.startswith("re:"):
            return re.match(pat[3:], module) is not None
        return pat == module or fnmatchcase(module, pat) or fnmatchcase(module + ".", pat)

    # ------------------------------------------------------------------ checks
    def _resolve(
        self, scheme: Scheme, module: str, tensors: Mapping[str, str], role: str, out: int, k: int, where: str
    ) -> Resolved:
        """Presence, dtype and shape of one projection's tensors (headers only)."""
        unknown = sorted(set(tensors) - scheme.known_suffixes())
        if "bias" in unknown:
            raise FormatError(
                f"{where}: expert bias {tensors['bias']} found; no MegaMoE kernel has a slot for expert biases "
                "(gpt-oss style), so this checkpoint cannot be converted (no producer recipe or --quantize removes "
                "the bias term)"
            )
        if unknown and scheme is BF16_SCHEME and "weight_scale" in unknown:
            raise FormatError(
                f"{where}: {tensors['weight_scale']} stands beside the float weight {tensors.get('weight', module)}: "
                "this is a quantized (or fake-quantized) export, not an unquantized one, so the unquantized reader "
                "(--format unquantized / --quantize) cannot read it; run without --format and --quantize to "
                "convert it in its own format (megamoe-convert inspect SRC says which)"
            )
        if unknown:
            raise CheckpointError(
                f"{where}: unexpected tensor(s) {[tensors[s] for s in unknown]} in {module}; "
                f"{scheme.name} expects {sorted(scheme.known_suffixes())}"
            )
        names: dict[str, str] = {}
        block: tuple[int, int] | None = None
        row = get_row(scheme.encoding)
        wshape = (out, row.weight.stored_cols(k))
        sshape = row.weight.scale_shape(out, k)
        for p in scheme.params:
            hit = [s for s in p.suffixes if s in tensors]
            if not hit:
                if p.required:
                    want = " or ".join(f"{module}.{s}" for s in p.suffixes)
                    raise CheckpointError(f"{where}: missing tensor {want} ({scheme.name} {p.key})")
                continue
            name = tensors[hit[0]]
            dtype, shape = self._hdr(name)
            if dtype not in p.dtypes:
                raise CheckpointError(
                    f"{where}: {self._where(name)} has dtype {dtype}; {scheme.name} {p.key} must be "
                    f"{' or '.join(p.dtypes)}"
                )
            if p.key == "weight":
                if shape != wshape:
                    raise CheckpointError(
                        f"{where}: {self._where(name)} has shape {list(shape)}, expected {list(wshape)} "
                        f"({role}: out={out}, in={k}{', packed 2 per byte' if wshape[1] != k else ''})"
                    )
            elif p.key == "scale" and scheme.stored_scale_group:
                g = scheme.stored_scale_group
                want = (out, k // g)
                if k % g or shape != want:
                    raise CheckpointError(
                        f"{where}: {self._where(name)} has shape {list(shape)}, expected {list(want)} "
                        f"(one scale per {g} along in={k})"
                    )
            elif p.key == "scale":
                assert sshape is not None
                if row.weight.block_scaled and shape == tuple(d for d in sshape if d != 1):
                    shape = sshape  # transformers <= 5.17 squeezes size-1 block dims when it splits fused experts
                if shape != sshape and row.weight.block_scaled:
                    b = row.weight.scale_block_rows
                    raise CheckpointError(
                        f"{where}: {self._where(name)} has shape {list(shape)}, expected {list(sshape)} "
                        f"(one scale per {b}x{row.weight.scale_group} block of the [{out}, {k}] weight)"
                    )
                if shape != sshape:
                    block = self._blocked(scheme, shape, out, k, row.weight.scale_group)
                    if block is None:
                        raise CheckpointError(
                            f"{where}: {self._where(name)} has shape {list(shape)}, expected {list(sshape)} "
                            f"(one scale per {row.weight.scale_group} along in={k})"
                        )
            else:  # global / input scalars
                if math.prod(shape) != 1 or len(shape) > 1:
                    raise CheckpointError(
                        f"{where}: {self._where(name)} has shape {list(shape)}, expected a scalar ([] or [1])"
                    )
            names[p.key] = name
        return Resolved(module, role, names, out, k, block)

    @staticmethod
    def _blocked(scheme: Scheme, shape: tuple[int, ...], out: int, k: int, group: int | None) -> tuple[int, int] | None:
        if not scheme.blocked_scales or group is None or len(shape) != 2:
            return None
        r = _block_factor(shape[0], out, 1)
        c = _block_factor(shape[1], k, group)
        if r is None or c is None:
            return None
        return r, c

    # ------------------------------------------------------------------ structure
    @cached_property
    def _names(self) -> dict[str, naming.LayerNames]:
        return naming.scan(self.source.tensor_names())

    @cached_property
    def _layers(self) -> dict[int, tuple[MoELayerInfo, naming.LayerNames, dict]]:
        """index -> (info, names, {(expert, role): Resolved}); every header check."""
        sizes = naming.config_sizes(self.config, self._config_where())
        found: dict[int, tuple[MoELayerInfo, naming.LayerNames, dict]] = {}
        if not self._names:
            raise CheckpointError(
                f"{self.source.id}: no routed-expert tensors found (looked for "
                "'*.layers.N.{mlp,ffn,block_sparse_moe}.experts.E.{gate_proj,up_proj,down_proj,w1,w2,w3}.*' and fused "
                "'*.experts.gate_up_proj' / 'down_proj'); is this an MoE checkpoint?"
            )
        for prefix, ln in sorted(self._names.items(), key=lambda kv: (kv[1].layer, kv[0])):
            if ln.layer in found:
                raise CheckpointError(
                    f"{self.source.id}: two MoE blocks claim layer {ln.layer}: {found[ln.layer][0].prefix} and {prefix}"
                )
            found[ln.layer] = self._scan_layer(ln, sizes)
        expected = naming.expected_moe_layers(self.config)
        if expected is not None:
            missing = sorted(expected - set(found))
            if missing:
                raise CheckpointError(
                    f"{self.source.id}: config.json says layers {missing} are MoE layers, but the checkpoint has no "
                    f"expert tensors for them (MoE layers found: {sorted(found)})"
                )
        return found

    def _scan_layer(self, ln: naming.LayerNames, sizes: naming.ConfigSizes):
        L = ln.layer
        if ln.gpt_oss:
            raise FormatError(
                f"{self.source.id}: layer {L} has gpt-oss style experts ({ln.gpt_oss[0]}, ...): their expert biases "
                "have no slot in any MegaMoE kernel, so gpt-oss checkpoints are not supported"
            )
        if ln.fused and ln.experts:
            raise CheckpointError(
                f"{self.source.id}: layer {L} ({ln.prefix}) has both fused experts "
                f"{sorted(n for d in ln.fused.values() for n in d.values())[:2]} and per-expert modules"
            )
        if ln.fused:
            return self._scan_fused(ln, sizes)
        E_cfg = sizes.num_experts
        present = sorted(ln.experts)
        E = E_cfg if E_cfg is not None else (present[-1] + 1)
        beyond = [e for e in present if e >= E]
        if beyond:
            raise CheckpointError(
                f"{self.source.id}: layer {L} has expert(s) {beyond[:8]} but config.json says "
                f"num_experts={E} (valid indices 0..{E - 1})"
            )
        missing = [e for e in range(E) if e not in ln.experts]
        if missing:
            some = f"{ln.prefix}.experts.{missing[0]}.*"
            raise CheckpointError(
                f"{self.source.id}: layer {L} is missing expert(s) {missing[:16]}"
                f"{' ...' if len(missing) > 16 else ''} of {E} (no tensors named {some})"
            )
        # sizes: config first, else from expert 0's tensors
        H, I = sizes.hidden, sizes.intermediate
        if H is None or I is None:
            H, I = self._infer_sizes(ln, H, I)
        resolved: dict[tuple[int, str], Resolved] = {}
        excluded: list[tuple[int, str]] = []
        for e in range(E):
            roles = ln.experts[e]
            for role in naming.ROLES:
                mod = roles.get(role)
                where = f"{self.source.id}: layer {L} expert {e} {role}"
                if mod is None:
                    others = sorted(roles.values())
                    raise CheckpointError(
                        f"{where}: missing projection (no {role} module among {others}); expected gate (w1/gate_proj), "
                        "up (w3/up_proj) and down (w2/down_proj)"
                    )
                tensors = ln.modules[mod]
                out, k = (I, H) if role != "down" else (H, I)
                if not self.scheme.matches(tensors, self._header_map(tensors)):
                    if self.scheme is not BF16_SCHEME and BF16_SCHEME.matches(tensors, self._header_map(tensors)):
                        excluded.append((e, role))
                        continue
                resolved[(e, role)] = self._resolve(self.scheme, mod, tensors, role, out, k, where)
        if excluded:
            self._refuse_excluded(ln, excluded, E * len(naming.ROLES))
        info, extra = self._layer_info(ln, sizes, E, H, I)
        resolved_all = dict(resolved)
        resolved_all["_extra"] = extra
        return info, ln, resolved_all

    def _layer_info(self, ln: naming.LayerNames, sizes: naming.ConfigSizes, E: int, H: int, I: int):
        """The layer's MoELayerInfo (its shared experts scanned) and the ``_extra`` entry of its resolution."""
        shared = self._scan_shared(ln, sizes, H)
        info = MoELayerInfo(
            index=ln.layer,
            prefix=ln.prefix,
            num_experts=E,
            hidden=H,
            intermediate=I,
            shared=shared[0] if shared else None,
            expert_tensor_names=frozenset(ln.expert_tensor_names()),
        )
        return info, {"shared": shared[1] if shared else None}

    def _header_map(self, tensors: Mapping[str, str]) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: self._hdr(n) for n in tensors.values()}

    def _infer_sizes(self, ln: naming.LayerNames, H: int | None, I: int | None) -> tuple[int, int]:
        e0 = ln.experts[min(ln.experts)]
        mod = e0.get("down")
        w = None
        if mod is not None:
            for s in ("weight", "weight_packed"):
                if s in ln.modules[mod]:
                    w = ln.modules[mod][s]
        if w is None:
            raise CheckpointError(
                f"{self.source.id}: config.json lacks hidden_size / moe_intermediate_size and layer {ln.layer} "
                "expert 0 has no down weight to infer them from"
            )
        dtype, shape = self._hdr(w)
        row = get_row(self.scheme.encoding)
        h = shape[0]
        i = shape[1] * (2 if row.weight.elements_per_byte == 2 and dtype in ("U8", "I8") else 1)
        return (H if H is not None else h), (I if I is not None else i)

    def _refuse_excluded(self, ln: naming.LayerNames, excluded: list[tuple[int, str]], total: int) -> None:
        """Refuse routed experts stored in float while the reader expects a quantized scheme, saying
        which of three cases it is, since each has its own remedy: some experts excluded from
        quantization (the ignore list), every expert float with block scales beside it (a
        fake-quantized export: the producer must export real quantized), or every expert plainly
        float (the quantization config does not describe the tensors)."""
        e, role = excluded[0]
        mod = ln.experts[e][role]
        tensors = ln.modules[mod]
        dtype = self._hdr(tensors["weight"])[0]
        where = f"{self.source.id}: layer {ln.layer}"
        by_cfg = self.excluded_by_config(mod)
        if len(excluded) == total:
            scale = tensors.get("weight_scale")
            if scale is not None and self._hdr(scale)[0] in FLOAT_DTYPES:
                raise FormatError(
                    f"{where}: all {total} routed expert projections are stored as {dtype} with float block scales "
                    f"beside them (e.g. {self._where(tensors['weight'])} and {scale}, "
                    f"{self._hdr(scale)[0]}): a fake-quantized export (quantize-dequantize values), not the "
                    f"{self.scheme.name} tensors its quantization config declares. megamoe re-encodes that form "
                    "only for Quark MXFP8; export the model again with real quantized weights (Quark: "
                    "export_safetensors(weight_format=\"real_quantized\")), or convert the unquantized model with "
                    "--quantize mxfp4|mxfp8|nvfp4|fp8_block"
                )
        if len(excluded) == total and not by_cfg:
            raise FormatError(
                f"{where}: all {total} routed expert projections are stored unquantized (e.g. "
                f"{self._where(tensors['weight'])}, {dtype}), although the quantization config declares "
                f"{self.scheme.name}; the config does not describe these tensors. If the model is meant to be "
                "unquantized, convert it with --format unquantized (add --quantize mxfp4|mxfp8|nvfp4|fp8_block for a "
                "quantized row)"
            )
        raise FormatError(
            f"{where} has {len(excluded)} of {total} routed expert projection(s) stored unquantized "
            f"(e.g. {mod}.weight, {dtype})"
            f"{f' - the quantization config excludes them (its list of unquantized modules names {by_cfg!r})' if by_cfg else ''}"
            f", while the rest of the model's experts are "
            f"{self.scheme.name}. A MegaMoE layer has one weight format for all its experts, and silently "
            "re-quantizing experts the producer chose to keep in high precision would change the model; "
            "quantize them with the producer"
            + (" (remove them from its ignore/exclude list)" if by_cfg else "") + " and export again"
        )

    def _scan_fused(self, ln: naming.LayerNames, sizes: naming.ConfigSizes):
        L = ln.layer
        where = f"{self.source.id}: layer {L} fused experts"
        if not self.reads_fused:
            raise FormatError(
                f"{where}: {ln.prefix}.experts.gate_up_proj is stored fused (3-D) but {self.scheme.name} readers only "
                "read per-expert modules; only unquantized (BF16/FP16/FP32) fused experts are supported"
            )
        gu, dn = ln.fused.get("gate_up", {}), ln.fused.get("down", {})
        extra = [s for s in (set(gu) | set(dn)) if s not in ("", "weight")]
        if extra:
            names = [d[s] for d in (gu, dn) for s in extra if s in d]
            if any(s.endswith("bias") for s in extra):
                raise FormatError(f"{where}: expert biases {names} have no slot in any MegaMoE kernel")
            raise FormatError(
                f"{where}: quantized fused experts {names} are not supported (only plain float fused "
                "gate_up_proj [E, 2I, H] / down_proj [E, H, I]); to convert it, export per-expert modules with the "
                "producer, or convert the unquantized model with --quantize mxfp4|mxfp8|nvfp4|fp8_block"
            )
        gname = gu.get("") or gu.get("weight")
        dname = dn.get("") or dn.get("weight")
        if gname is None or dname is None:
            raise CheckpointError(
                f"{where}: need both {ln.prefix}.experts.gate_up_proj and {ln.prefix}.experts.down_proj; "
                f"found {sorted(list(gu.values()) + list(dn.values()))}"
            )
        gdt, gsh = self._hdr(gname)
        ddt, dsh = self._hdr(dname)
        for n, dt in ((gname, gdt), (dname, ddt)):
            if dt not in FLOAT_DTYPES:
                raise CheckpointError(f"{where}: {self._where(n)} has dtype {dt}; fused experts must be BF16/F16/F32")
        if len(gsh) != 3 or len(dsh) != 3:
            raise CheckpointError(
                f"{where}: {self._where(gname)} {list(gsh)} / {self._where(dname)} {list(dsh)} must be 3-D"
            )
        E = sizes.num_experts if sizes.num_experts is not None else gsh[0]
        H = sizes.hidden if sizes.hidden is not None else dsh[1]
        I = sizes.intermediate if sizes.intermediate is not None else dsh[2]
        if gsh == (E, H, 2 * I) and gsh != (E, 2 * I, H):
            raise FormatError(
                f"{where}: {self._where(gname)} is stored transposed [E, H, 2I] = {list(gsh)} (Llama4 / gpt-oss style, "
                "whose gate/up order differs per model); only transformers' [E, 2I, H] with the gate half first is "
                "supported"
            )
        if gsh != (E, 2 * I, H):
            raise CheckpointError(
                f"{where}: {self._where(gname)} has shape {list(gsh)}, expected [E, 2I, H] = {[E, 2 * I, H]}"
            )
        if dsh != (E, H, I):
            raise CheckpointError(
                f"{where}: {self._where(dname)} has shape {list(dsh)}, expected [E, H, I] = {[E, H, I]}"
            )
        info, extra = self._layer_info(ln, sizes, E, H, I)
        return info, ln, {"_fused": (gname, dname), "_extra": extra}

    def _scan_shared(self, ln: naming.LayerNames, sizes: naming.ConfigSizes, H: int):
        if not ln.shared:
            if sizes.num_shared and self._config_expects_shared():
                raise CheckpointError(
                    f"{self.source.id}: config.json says n_shared_experts={sizes.num_shared} but layer {ln.layer} "
                    f"({ln.prefix}) has no shared_experts tensors"
                )
            return None
        L = ln.layer
        where = f"{self.source.id}: layer {L} shared experts"
        missing = [r for r in naming.ROLES if r not in ln.shared]
        if missing:
            raise CheckpointError(f"{where}: missing {missing} projection(s); found {sorted(ln.shared.values())}")
        gate_mod = ln.shared["gate"]
        tensors = ln.modules[gate_mod]
        wname = tensors.get("weight") or tensors.get("weight_packed")
        if wname is None:
            raise CheckpointError(f"{where}: {gate_mod} has no weight tensor")
        schemes = self.shared_schemes or (self.scheme, BF16_SCHEME)
        scheme = None
        for s in schemes:
            if all(s.matches(ln.modules[ln.shared[r]], self._header_map(ln.modules[ln.shared[r]])) for r in naming.ROLES):
                scheme = s
                break
        if scheme is None:
            dt = self._hdr(wname)[0]
            raise FormatError(
                f"{where}: {self._where(wname)} ({dt}) is in none of the shared-expert encodings this reader knows "
                f"({', '.join(s.name for s in schemes)})"
            )
        # total width from the gate weight rows
        total = self._hdr(wname)[1][0]
        S = sizes.num_shared or 1
        I_s = sizes.shared_intermediate
        if I_s is None or S * I_s != total:
            if total % S == 0:
                I_s = total // S
            else:
                S, I_s = 1, total
        resolved = {}
        for r in naming.ROLES:
            mod = ln.shared[r]
            out, k = (total, H) if r != "down" else (H, total)
            resolved[r] = self._resolve(scheme, mod, ln.modules[mod], r, out, k, f"{where} {r}")
        reason = None
        if ln.shared_kind == "shared_expert" or ln.shared_gate:
            reason = (
                "the shared expert is scaled by a sigmoid gate "
                f"({ln.shared_gate[0] if ln.shared_gate else ln.prefix + '.shared_expert_gate'}), "
                "which no MegaMoE kernel applies; it runs outside the kernel"
            )
        info = SharedInfo(
            num_shared=S,
            intermediate=I_s,
            encoding=scheme.encoding,
            num_modules=1,
            tensor_names=frozenset(ln.shared_tensor_names()),
            unsupported_reason=reason,
        )
        return info, (scheme, resolved)

    def _config_expects_shared(self) -> bool:
        return True

    def moe_layers(self) -> list[MoELayerInfo]:
        return [v[0] for _, v in sorted(self._layers.items())]

    def layer(self, layer_index: int) -> MoELayerInfo:
        return self._entry(layer_index)[0]

    def _entry(self, layer_index: int):
        try:
            return self._layers[layer_index]
        except KeyError:
            raise CheckpointError(
                f"{self.source.id}: layer {layer_index} is not an MoE layer; MoE layers are {sorted(self._layers)}"
            ) from None

    def _config_where(self) -> str:
        """config.json of the source, as error messages name it."""
        root = getattr(self.source, "root", None)
        return str(root / "config.json") if root is not None else f"{self.source.id}: config.json"

    def model_facts(self) -> ModelFacts:
        sizes = naming.config_sizes(self.config, self._config_where())
        layers = self.moe_layers()
        E = layers[0].num_experts
        top_k = sizes.top_k
        if top_k is None:
            raise CheckpointError(
                f"{self.source.id}: config.json has no num_experts_per_tok (or n_activated_experts / "
                "num_experts_per_token); the router's top-k is needed"
            )
        if not 1 <= top_k <= E:
            raise CheckpointError(f"{self.source.id}: config top-k {top_k} is not in 1..num_experts={E}")
        norm = naming.cfg_get(self.config, "norm_topk_prob")
        shared = next((l.shared for l in layers if l.shared is not None), None)
        return ModelFacts(
            activation=naming.activation_from_config(self.config),
            top_k=int(top_k),
            routed_scaling_factor=naming.routed_scaling_factor(self.config),
            num_experts=E,
            num_shared=shared.num_shared if shared else 0,
            shared_intermediate=shared.intermediate if shared else None,
            model_type=naming.model_type(self.config),
            norm_topk_prob=None if norm is None else bool(norm),
        )

    # ------------------------------------------------------------------ data
    def _scalar(self, name: str, invert: bool, where: str, rescale: tuple[float, float] | None = None) -> float:
        # The preflight reads every expert's scalars and the conversion reads them again with the
        # expert: keep the raw values (a few floats per expert) instead of a second tiny read each.
        cache = self.__dict__.setdefault("_scalar_values", {})
        v = cache.get(name)
        if v is None:
            v = cache[name] = self.source.first_value(name)
        if rescale is not None:
            if not (math.isfinite(v) and v > 0):
                raise ScaleError(f"{where}: {self._where(name)} = {v!r}; a scale must be finite and > 0")
            a, b = rescale
            t = torch.tensor(v, dtype=torch.float32) * torch.tensor(a, dtype=torch.float32)
            return float(t / torch.tensor(b, dtype=torch.float32))
        if invert:
            if not (math.isfinite(v) and v > 0):
                raise ScaleError(
                    f"{where}: {self._where(name)} = {v!r}; this divisor (compressed-tensors stores 1/scale) "
                    "must be finite and > 0"
                )
            # fp32 reciprocal (correctly rounded), what vLLM computes from the divisor
            return float(torch.tensor(v, dtype=torch.float32).reciprocal())
        if not (math.isfinite(v) and v > 0):
            raise ScaleError(f"{where}: {self._where(name)} = {v!r}; a scale must be finite and > 0")
        return v

    #: (canonical element, stored dtype) pairs whose `_read_projection` is a pure reinterpretation
    _IDENTITY_WEIGHTS = {("e2m1", "U8"), ("e2m1", "I8"), ("e4m3", "F8_E4M3"), ("bf16", "BF16")}

    def weight_byte_ranges(self, layer_index: int, expert: int, role: str):
        """The stored weight's ``(file, offset, nbytes)`` when this reader returns
        it unchanged: ``direct_weight_bytes`` set, per-expert (not fused)
        tensors, and a stored dtype the canonical one only reinterprets."""
        if not self.direct_weight_bytes:
            return None
        info, ln, res = self._entry(layer_index)
        if "_fused" in res or not 0 <= expert < info.num_experts:
            return None
        r = res.get((expert, role))
        if r is None:
            return None
        name = r.names["weight"]
        element = get_row(self.scheme.encoding).weight.element
        if (element, self._hdr(name)[0]) not in self._IDENTITY_WEIGHTS:
            return None
        return self.source.tensor_data_range(name)

    def _read_projection(self, scheme: Scheme, r: Resolved, where: str, weights: bool = True) -> ProjectionTensors:
        row = get_row(scheme.encoding)
        # weights=False: a meta tensor with the dtype and shape a real read gives, put through the same
        # reinterpretation below, so validate() checks it the same way (the caller reads the bytes itself)
        w = self.source.get_tensor(r.names["weight"]) if weights else self.source.meta_tensor(r.names["weight"])
        if row.weight.element == Element.BF16:
            w = w.to(torch.bfloat16)
        elif row.weight.element == "e2m1":
            w = w.view(torch.uint8)
        else:  # e4m3
            w = w.view(torch.float8_e4m3fn) if w.dtype != torch.float8_e4m3fn else w
        scale = None
        if "scale" in r.names:
            s = self.source.get_tensor(r.names["scale"])
            if row.weight.block_scaled:
                # fp32 as stored (a bf16 scale widens exactly); a squeezed grid gets its size-1 dims back
                s = s.float().reshape(row.weight.scale_shape(r.out, r.k))
            elif row.weight.scale_encoding == "ue8m0":
                s = s.view(torch.uint8)
                if r.scale_block is not None:
                    R, C = r.scale_block
                    g = row.weight.scale_group
                    s = s.repeat_interleave(R, 0)[: r.out].repeat_interleave(C // g, 1)[:, : r.k // g].contiguous()
            else:
                s = s.view(torch.float8_e4m3fn) if s.dtype != torch.float8_e4m3fn else s
                if scheme.stored_scale_group:
                    rep = scheme.stored_scale_group // row.weight.scale_group
                    s = s.view(torch.uint8).repeat_interleave(rep, 1).view(torch.float8_e4m3fn)
            scale = s
        g = i = None
        if "global" in r.names:
            g = self._scalar(r.names["global"], scheme.param("global").invert, where, scheme.param("global").rescale)
        if "input" in r.names:
            i = self._scalar(r.names["input"], scheme.param("input").invert, where, scheme.param("input").rescale)
        return ProjectionTensors(weight=w, scale=scale, global_scale=g, input_scale=i)

    def read_expert(self, layer_index: int, expert: int, *, weights: bool = True) -> ExpertTensors:
        """``weights=False`` (only where `weight_byte_ranges` gives ranges):
        the weights are meta tensors of the right dtype and shape (not read);
        scales and scalars are read and checked as usual."""
        info, ln, res = self._entry(layer_index)
        if not 0 <= expert < info.num_experts:
            raise CheckpointError(
                f"{self.source.id}: layer {layer_index} has experts 0..{info.num_experts - 1}, not {expert}"
            )
        where = f"{self.source.id}: layer {layer_index} expert {expert}"
        if "_fused" in res:
            if not weights:
                raise CheckpointError(f"{where}: fused experts have no direct weight reads (weights=False)")
            et = self._read_fused(info, res["_fused"], expert)
        else:
            et = ExpertTensors(
                *(
                    self._read_projection(self.scheme, res[(expert, role)], f"{where} {role}", weights)
                    for role in naming.ROLES
                )
            )
        return self._finish(et, info, where)

    def _finish(self, et: ExpertTensors, info: MoELayerInfo, where: str) -> ExpertTensors:
        """Hook for readers that transform after reading (the quantizing reader)."""
        et.validate(self.scheme.encoding, info.hidden, info.intermediate, where)
        return et

    def _read_fused(self, info: MoELayerInfo, names: tuple[str, str], expert: int) -> ExpertTensors:
        gname, dname = names
        gu = self.source.get_slice(gname)[expert : expert + 1][0]
        dn = self.source.get_slice(dname)[expert : expert + 1][0]
        I = info.intermediate
        return ExpertTensors(
            gate=ProjectionTensors(gu[:I].to(torch.bfloat16).contiguous()),
            up=ProjectionTensors(gu[I:].to(torch.bfloat16).contiguous()),
            down=ProjectionTensors(dn.to(torch.bfloat16).contiguous()),
        )

    def read_expert_scalars(self, layer_index: int, expert: int) -> ExpertScalars:
        info, ln, res = self._entry(layer_index)
        if "_fused" in res or (self.scheme.param("global") is None and self.scheme.param("input") is None):
            return ExpertScalars()
        where = f"{self.source.id}: layer {layer_index} expert {expert}"
        vals: dict[str, float | None] = {}
        for role in naming.ROLES:
            r = res[(expert, role)]
            for key, label in (("global", "global"), ("input", "input")):
                p = self.scheme.param(key)
                vals[f"{role}_{label}"] = (
                    self._scalar(r.names[key], p.invert, f"{where} {role}", p.rescale) if key in r.names else None
                )
        return ExpertScalars(**vals)

    def read_shared(self, layer_index: int) -> list[ExpertTensors] | None:
        info, ln, res = self._entry(layer_index)
        sh = res["_extra"]["shared"]
        if sh is None:
            return None
        scheme, resolved = sh
        where = f"{self.source.id}: layer {layer_index} shared experts"
        et = ExpertTensors(*(self._read_projection(scheme, resolved[r], f"{where} {r}") for r in naming.ROLES))
        et.validate(scheme.encoding, info.hidden, info.shared.total_intermediate, where)
        return [et]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of float tensor `t` is finite. A sum carries any NaN or inf through (inf - inf
    is NaN), so one reduction at memory speed settles the common case; only a non-finite sum (a NaN or inf,
    or finite values whose sum overflows) pays for the element-wise ``isfinite`` (about 15x slower)."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def non_finite_message(what: str, source: torch.Tensor, hint: str, written: torch.Tensor | None = None) -> str:
    """One line for a float weight holding NaN or inf: `what` (where, tensor name), how many values are bad,
    the first one's index (multi-dimensional and flat) and source value, and `hint`. `written` (default
    `source`): the tensor found non-finite, when it is a cast of `source` (the bf16 row's BF16 weight)."""
    written = source if written is None else written
    bad = ~torch.isfinite(written)
    flat = int(bad.flatten().nonzero()[0])
    first = [int(i) for i in torch.unravel_index(torch.tensor(flat), bad.shape)]
    value = float(source.flatten()[flat])
    over = "" if not math.isfinite(value) else f" (finite in {source.dtype}, but beyond BF16's range: inf in BF16)"
    return (f"{what} ({source.dtype}) holds {int(bad.sum())} non-finite value(s); first at {first} = {value!r} "
            f"(flat index {flat}){over}. {hint}")


def quant_config_of(source) -> dict:
    """The quantization config as a dict ({} when none)."""
    q = source.quant_config
    return q if isinstance(q, dict) else {}


def ignore_list(qc: Mapping[str, Any], *keys: str) -> tuple[str, ...]:
    for k in keys:
        v = qc.get(k)
        if isinstance(v, (list, tuple)):
            return tuple(str(x) for x in v)
    return ()
