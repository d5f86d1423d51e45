from __future__ import annotations

"""Error types. Every message names the tensor, layer or expert and the
offending values, so a user can find the defect without a debugger."""


class MegaMoEError(ValueError):
    """Base of every error megamoe raises on bad input."""


class FormatError(MegaMoEError):
    """Unknown or unsupported number format / feature-matrix row."""


class LayerSpecError(MegaMoEError):
    """A layer spec breaks a rule of its row (sizes, activation, shared experts)."""


class LayoutError(MegaMoEError):
    """A tensor does not have the shape, dtype or strides a layout rule requires."""


class ManifestError(MegaMoEError):
    """megamoe.json is missing, malformed or of a version this code cannot read."""


class CheckpointError(MegaMoEError):
    """A checkpoint file or tensor is missing, truncated or inconsistent."""


class OutputError(MegaMoEError):
    """The output folder cannot be written as asked (exists, not ours,
    overlaps the source, locked by a running conversion, stale temp folder,
    resume of a different conversion), or a folder to verify is not one.
    Defined here, not in the converter, so that ``megamoe_runtime.load.verify``
    raises the same class a serve-only install can catch."""


class ScaleError(MegaMoEError):
    """A scale is NaN, zero, negative, 0xFF (E8M0 NaN) or disagrees with its pair."""


class LoadCheckError(CheckpointError):
    """A load was refused before its first byte: ``problems`` lists every check that failed (spec or semantics
    differences, a replaced folder, a missing/truncated/inconsistent file, a checksum mismatch)."""

    def __init__(self, message: str, problems: list[str] | None = None, differences: dict | None = None):
        super().__init__(message)
        self.problems = list(problems or [message])
        #: field -> (layer's value, checkpoint's value) for semantics that differ
        self.differences = dict(differences or {})


class LayerUnusableError(MegaMoEError):
    """A load failed after it had started writing: the layer holds a mix of two checkpoints and refuses to run
    until a load succeeds."""


class ReloadError(MegaMoEError):
    """A reload would not write every parameter byte exactly once, or rebinds storage."""


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here (missing package or unsupported GPU)."""


class DigestUnavailableError(MegaMoEError):
    """A checksum of an algorithm this machine cannot compute (its package is not installed)."""


def install_hint(extra: str) -> str:
    """How to add one of megamoe's optional extras (``gpu``, ``transformers``, ``vllm``), the way README's
    install section does it: megamoe is installed from its clone, not from a package index."""
    return f"pip install -e '.[{extra}]' in the megamoe clone"
