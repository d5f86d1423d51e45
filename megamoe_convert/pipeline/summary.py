"""What a conversion reports: `ConvertSummary` (the CLI prints it, ``--json`` dumps it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megamoe_runtime.format.formats import Row
from megamoe_runtime.format.manifest import PASSTHROUGH_ROLE

from .shared import shared_decisions


@dataclass
class ConvertSummary:
    out: str
    source: str
    format: str
    row: str
    ep_size: int
    layers: int
    experts: int  # routed experts summed over layers
    bytes_in: int
    bytes_out: int
    #: the conversion itself (convert() called to OUT renamed into place): Python's and torch's start-up
    #: and imports before it are not counted
    seconds: float
    files: int
    repaired_experts: int = 0
    resumed_files: int = 0
    #: of bytes_in: the input of the finished files a resume kept from the interrupted run (not processed now)
    bytes_kept: int = 0
    warnings: list[str] = field(default_factory=list)
    #: the shared-expert decisions, one per distinct decision: layers, precision, requested, reason, note
    shared: list[dict] = field(default_factory=list)
    #: megamoe.json ``source.recipe``: the source's activation recipe and what the kernel does instead
    recipe: dict | None = None

    @property
    def bytes_processed(self) -> int:
        """The input bytes this run read and converted: all of them, less what a resume kept."""
        return max(0, self.bytes_in - self.bytes_kept)

    @property
    def gb_per_s(self) -> float:
        """Throughput over the bytes this run processed (a resume's kept files are not counted)."""
        return self.bytes_processed / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"out": self.out, "source": self.source, "format": self.format, "row": self.row,
                "ep_size": self.ep_size, "layers": self.layers, "experts": self.experts,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "seconds": round(self.seconds, 3),
                "gb_per_s": round(self.gb_per_s, 3), "files": self.files,
                "repaired_experts": self.repaired_experts, "resumed_files": self.resumed_files,
                "bytes_kept": self.bytes_kept, "bytes_processed": self.bytes_processed,
                "warnings": self.warnings, "shared": self.shared, "recipe": self.recipe}


def summary_of_output(out: Path, source, reader, row: Row, plans, slots_by_file, ep_size: int) -> ConvertSummary:
    """The summary of a conversion found complete in OUT (an interrupted run's swap just finished)."""
    from megamoe_runtime.format.manifest import read_manifest

    m = read_manifest(out)
    total = sum(lp.source_bytes for lp in plans) + sum(
        s.planned.nbytes for slots in slots_by_file.values() for s in slots if s.role == PASSTHROUGH_ROLE)
    return ConvertSummary(
        out=str(out), source=str(source.id), format=reader.format_name, row=row.name, ep_size=ep_size,
        layers=len(plans), experts=sum(lp.info.num_experts for lp in plans), bytes_in=total,
        bytes_out=sum(f.size for f in m.files.values()) + (out / "megamoe.json").stat().st_size,
        seconds=0.0, files=len(m.files) + 1, resumed_files=len(m.files), bytes_kept=total,
        warnings=["completed from an interrupted earlier run of the same conversion: only its final rename "
                  "was left"], shared=shared_decisions(plans), recipe=m.source.recipe)


__all__ = ["ConvertSummary", "summary_of_output"]
