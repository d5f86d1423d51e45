"""The demo's last step: a real transformers model served from a converted folder, through ``from_pretrained``.

What a user does next after converting, end to end on the CPU: a tiny DeepSeek-V3 (transformers'
architecture, random weights; `megamoe_runtime.integrations.transformers.tiny`) saved as a user's checkpoint,
converted, opened by ``AutoModelForCausalLM.from_pretrained`` with the megamoe integration, and asked for a
few greedy tokens, which must equal transformers' own generation from the source folder. Skipped, saying
how to enable it, when transformers is not installed (it is an optional extra).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

__all__ = ["demo_generate"]

_DEMO_TOKENS = 8


def demo_generate(root: Path, log: Callable[[str], None]) -> dict:
    """{"ok", "model", "source_dtype", "row", "source", "out", "tokens", "reference_tokens"}, or
    {"ok": True, "skipped": why} without transformers."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        from megamoe_runtime.errors import install_hint

        return {"ok": True, "skipped": f"transformers is not installed: {install_hint('transformers')}"}
    import megamoe_runtime.integrations.transformers  # noqa: F401  (registers the megamoe method)
    from megamoe_runtime.integrations.transformers.tiny import save_tiny_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ..pipeline.convert import convert

    src, out = root / "hf-source", root / "hf-converted"
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the demo prints its own summary; transformers' bars add nothing
    hf_logging.disable_progress_bar()
    try:
        save_tiny_model("deepseek_v3", src)
        summary = convert(src, out, log=log)
        ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
        theirs = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    prompt = torch.tensor([[1, 7, 42, 9, 30, 11]])
    gen = dict(max_new_tokens=_DEMO_TOKENS, do_sample=False)
    with torch.no_grad():
        got = ours.generate(prompt, **gen)[0, prompt.shape[1]:].tolist()
        want = theirs.generate(prompt, **gen)[0, prompt.shape[1]:].tolist()
    return {"ok": got == want, "model": "DeepseekV3ForCausalLM", "source_dtype": "bf16",
            "row": summary.row, "source": str(src), "out": str(out), "tokens": got, "reference_tokens": want}
