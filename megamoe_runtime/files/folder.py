"""Paths inside a converted folder: a name the manifest lists must resolve inside that folder.

A converted folder is a unit (megamoe.json plus the files it lists). A symlink that leaves it (a shard or the
manifest pointing at some other file on the machine) would make `verify` vouch for, and `open_checkpoint` serve,
bytes that are not part of the output, so both refuse it. Symlinks that stay inside the folder are allowed.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Type, Union

from ..errors import CheckpointError, MegaMoEError

__all__ = ["inside_folder"]


def inside_folder(root: Union[str, os.PathLike], name: str, error: Type[MegaMoEError] = CheckpointError) -> Path:
    """``root / name``, refused (`error` naming the path and its target) when it resolves outside ``root``."""
    root = Path(root)
    path = root / name
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise error(f"{path}: resolves to {real}, outside the folder {real_root} (a symlink leaving the "
                    "converted folder); megamoe only reads files that are part of the output")
    return path
