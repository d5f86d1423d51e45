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


class ScaleError(MegaMoEError):
    """A scale is NaN, zero, negative, 0xFF (E8M0 NaN) or disagrees with its pair."""


class ReloadError(MegaMoEError):
    """A reload would not write every parameter byte exactly once, or rebinds storage."""


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here (missing package or unsupported GPU)."""


class DigestUnavailableError(MegaMoEError):
    """A checksum of an algorithm this machine cannot compute (its package is not installed)."""
