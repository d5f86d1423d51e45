"""How the converter writes a byte count for people: one format for the progress line, the summaries and
the resume log. Torch-free and importing nothing of the package, so the command line can use it before torch
loads and the output floor can use it without reaching up to the command line."""
from __future__ import annotations


def format_bytes(n: float) -> str:
    """The converter's one byte format (decimal units, 2 decimals), torch-free."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"  # pragma: no cover
