"""Every ``MEGAMOE_*`` environment variable, declared once: its type, its default and what it sets.

The package reads these variables only through `get` / `value`, each call reading the environment anew
(a test or a benchmark may set one between two calls). A name that is not declared here raises, so a
new knob cannot appear without its line in `KNOBS` and in the table of docs/ENVIRONMENT.md
(``python -m megamoe_runtime.knobs`` prints it; tests/runtime/test_knobs.py keeps the page equal to it
and fails on a module reading a ``MEGAMOE_*`` variable any other way).

Floor 0: imports nothing of the package, so the converter and every runtime floor may import it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["Knob", "KNOBS", "get", "value", "markdown_table"]


@dataclass(frozen=True)
class Knob:
    """One environment variable. ``kind`` turns its text into a value (`value`); ``default`` is the text
    used when it is unset, or None where the reading code decides (``default_doc`` says how)."""

    name: str
    area: str
    kind: Callable[[str], Any]
    default: Optional[str]
    doc: str
    choices: tuple[str, ...] = ()
    default_doc: str = ""

    @property
    def type_label(self) -> str:
        if self.choices:
            return " \\| ".join(f"`{c}`" for c in self.choices)
        return {str: "text", int: "integer", float: "number"}[self.kind]

    @property
    def default_label(self) -> str:
        return f"`{self.default}`" if self.default is not None else self.default_doc


_ON_OFF = ("0", "1")

KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("MEGAMOE_BACKEND", "serving", str, None,
         "the backend the transformers and vLLM integrations build layers with when the config names none",
         choices=("auto", "deepgemm", "triton", "reference"), default_doc="`auto` (follows the device)"),
    Knob("MEGAMOE_VERIFY", "serving", str, None,
         "the checks a load through the transformers and vLLM integrations makes when the config names none: "
         "`headers` validates every header and destination before the first byte, `checksums` also hashes every "
         "loaded tensor against the manifest", choices=("none", "headers", "checksums"), default_doc="`headers`"),
    Knob("MEGAMOE_THP", "serving", str, "0",
         "`1` asks Linux for transparent huge pages on a layer's CPU storage (faster first load when huge "
         "pages are free, slower when the kernel must compact memory for them)", choices=_ON_OFF),
    Knob("MEGAMOE_KERNEL_CACHE", "serving", str, None,
         "the kernel cache (`megamoe-convert warm`) the transformers integration and the vLLM plugin copy into "
         "triton's cache before the first forward; `off` copies none", default_doc="`FOLDER/kernel-cache` when the folder has one"),
    Knob("MEGAMOE_AUTOREGISTER", "serving", str, "1",
         "`0` keeps the start-up hook (site-packages/megamoe-autoregister.pth) from registering the megamoe "
         "quantization method when transformers loads its models; `from_pretrained` on a megamoe output then "
         "needs `import megamoe_runtime.integrations.transformers` first", choices=_ON_OFF),
    Knob("MEGAMOE_CHECK_ROUTING", "serving", str, "0",
         "`1` checks every eager forward's topk_ids on any backend as the reference backend does (each in "
         "-1..num_experts-1, no expert twice in a token) at the cost of one host sync; the triton and deepgemm "
         "backends do not check them otherwise (docs/NUMERICS.md#routing-ids)", choices=_ON_OFF),
    Knob("MEGAMOE_LOAD_THREADS", "loading", int, None,
         "threads reading one large tensor from a file", default_doc="the cores, at most 8"),
    Knob("MEGAMOE_LOAD_GPU_CHUNK_MB", "loading", float, None,
         "MiB per pinned chunk of a reader that loads into GPU memory", default_doc="`16`"),
    Knob("MEGAMOE_LOAD_DMA", "loading", str, "0",
         "`1` loads large tensors on CUDA by DMA straight from the page cache, beside the copying readers",
         choices=_ON_OFF),
    Knob("MEGAMOE_LOAD_DMA_PIECE_MB", "loading", float, "64",
         "MiB of the page cache pinned at a time by a DMA load (rounded to pages)"),
    Knob("MEGAMOE_LOAD_DMA_SHARE", "loading", float, "0.5",
         "fraction of each large read done by DMA, clamped to [0, 1]; the copying readers do the rest"),
    Knob("MEGAMOE_LOAD_DMA_THREADS", "loading", int, "2",
         "threads pinning page-cache pieces for DMA, clamped to [1, 8]"),
    Knob("MEGAMOE_CONVERT_DIRECT", "converting", str, "1",
         "`0`, `false` or `no` writes the converted shards through the page cache instead of with O_DIRECT"),
    Knob("MEGAMOE_PROGRESS_INTERVAL", "converting", float, "10",
         "seconds between two progress lines when stderr is not a terminal (negative: 0; not a number: 10)"),
    Knob("MEGAMOE_TRITON_MMA", "triton", str, "auto",
         "the triton backend's MMA for the MX rows: `fp8` runs them on FP8 tensor cores (misses the exact "
         "bar); `auto` and `bf16` keep the exact bf16 path", choices=("auto", "fp8", "bf16")),
    Knob("MEGAMOE_TRITON_KORDER", "triton", str, None,
         "K order of the triton backend's bf16 GEMMs when `KernelConfig.k_order` names none",
         choices=("frag", "split"), default_doc="`frag`"),
    Knob("MEGAMOE_TRITON_DECODE", "triton", str, None,
         "forces the E2M1/E4M3 decode of both triton kernels", choices=("fold", "plain"),
         default_doc="per row and token regime"),
    Knob("MEGAMOE_TRITON_SCALES", "triton", str, None,
         "how the triton kernels load block scales when `KernelConfig.scale_load` names none",
         choices=("words", "bytes", "ahead"), default_doc="`bytes`"),
    Knob("MEGAMOE_TRITON_L1GU", "triton", str, None,
         "`1` runs the triton L1 as one gate/up dot, `0` (or `false`, `no`, empty) as two, when the config "
         "names neither", default_doc="per row and token regime"),
    Knob("MEGAMOE_BLOCK8_L2", "triton", str, None,
         "the block-FP8 row's prefill L2: `gluon` (the Gluon kernel, the same bytes, where it applies) or `triton` "
         "(block8's), over every tile's `Block8Config.l2_gluon`", choices=("triton", "gluon"),
         default_doc="each tile's `l2_gluon` (on for prefill)"),
    Knob("MEGAMOE_TRITON_WTILE", "triton", int, None,
         "rows per tile of the weight arrangement a layer derives for the triton backend after a load; `0` "
         "keeps the converted layout", default_doc="`16`"),
    Knob("MEGAMOE_TRITON_PDL", "triton", str, "1",
         "`1` launches the triton backend's forward kernels with programmatic dependent launch on Hopper and "
         "later GPUs (each waits for the previous kernel before touching memory: the same bits; docs/KERNELS.md "
         "\"Programmatic dependent launch\"), `0` launches them plainly", choices=("0", "1")),
)}


def _knob(name: str) -> Knob:
    try:
        return KNOBS[name]
    except KeyError:
        raise KeyError(f"{name} is no declared megamoe knob; declare it in megamoe_runtime/knobs.py "
                       f"(declared: {', '.join(KNOBS)})") from None


def get(name: str) -> Optional[str]:
    """The variable's text as set (empty included), None when it is unset."""
    _knob(name)
    return os.environ.get(name)


def value(name: str) -> Any:
    """The variable's text, or its declared default when unset, as the knob's type; None when unset and
    the default is left to the reading code. Bad text raises the type's ValueError."""
    knob = _knob(name)
    text = os.environ.get(name, knob.default)
    return None if text is None else knob.kind(text)


def markdown_table() -> str:
    """The table of docs/ENVIRONMENT.md, generated from `KNOBS`."""
    lines = ["| variable | area | values | default | what it sets |", "|---|---|---|---|---|"]
    lines += [f"| `{k.name}` | {k.area} | {k.type_label} | {k.default_label} | {k.doc} |" for k in KNOBS.values()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(markdown_table(), end="")
