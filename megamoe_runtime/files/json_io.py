"""The one guarded JSON reader: every JSON file or header megamoe reads goes through here.

Python's json module will happily build a 10**5-deep list (and then raise RecursionError), turn a
5000-digit number into a ValueError that names no file, or keep the last of two duplicate keys. A
megamoe input is a contract, so here a JSON text is refused, with an error naming the file, when it is
larger than ``limits.MAX_JSON_BYTES`` (or the caller's bound), nests deeper than ``limits.MAX_JSON_DEPTH``,
has an integer of more than ``limits.MAX_INT_DIGITS`` digits, holds a non-finite number (``NaN``/``Infinity``,
which Python's json writes by default, or a float literal that overflows: not JSON, and the strict writers of the
converter and the manifest digest would fail on it later with a bare ValueError), repeats a key within an object, is not
UTF-8, or is not JSON. Depth is measured before parsing, in time linear in the text and memory bounded
by a fixed chunk, so no hostile text reaches the recursive parser. The error type is the caller's (a
ManifestError for megamoe.json, a CheckpointError for a header), always a MegaMoEError.
"""
from __future__ import annotations

import itertools
import json
import math
import operator
import os
import re
from pathlib import Path
from typing import Any, Optional, Type, Union

from ..errors import MegaMoEError
from .limits import MAX_INT_DIGITS, MAX_JSON_BYTES, MAX_JSON_DEPTH

__all__ = ["JsonError", "parse_json", "read_json", "json_depth"]


class JsonError(MegaMoEError):
    """A JSON file is unreadable, malformed, duplicated a key or exceeds a stated limit."""


_CHUNK = 1 << 20
#: a string literal once escaped backslashes and quotes are gone (no alternation: never backtracks)
_STRING = re.compile(rb'"[^"]*"')
#: every byte that is not a bracket, deleted before the depth count
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
#: '[' and '{' -> 2, ']' and '}' -> 0: the depth after k brackets is (sum of the first k) - k
_STEP = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")


def json_depth(raw: bytes) -> int:
    """Maximum object/array nesting depth of JSON text `raw`, without parsing it (brackets inside string
    literals do not count). Linear time in C-level loops and memory bounded by a 1 MiB chunk whatever the input;
    pure Python (no torch), so it runs unchanged under a TorchDispatchMode such as the reload dry run's."""
    # escapes pair left to right, as bytes.replace scans: drop escaped backslashes first, then escaped quotes;
    # every quote left delimits a string (in valid JSON; invalid text is refused by the parser anyway)
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    depth = best = 0
    inside = False  # whether the chunk starts inside a string literal
    for i in range(0, len(text), _CHUNK):
        chunk = text[i:i + _CHUNK]
        quotes = chunk.count(b'"')
        if inside:  # skip to the closing quote
            q = chunk.find(b'"')
            chunk = chunk[q + 1:] if q >= 0 else b""
        ends_inside = inside != (quotes % 2 == 1)
        if ends_inside:  # drop the tail after the opening quote of the unterminated string
            chunk = chunk[:chunk.rfind(b'"')]
        inside = ends_inside
        brackets = _STRING.sub(b"", chunk).translate(None, _NOT_BRACKET)
        if brackets:
            best = max(best, max(map(operator.sub, itertools.accumulate(brackets.translate(_STEP), initial=depth),
                                     itertools.count())))
            opens = brackets.count(b"[") + brackets.count(b"{")
            depth += opens - (len(brackets) - opens)
    return best


class _Refused(Exception):
    """Internal: a hook refused the text (duplicate key, long integer); carries the message."""


class _DupKey(Exception):
    """Internal: an object repeated a key; carries the key."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DupKey(k)
        out[k] = v
    return out


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits (limit {MAX_INT_DIGITS}, megamoe_runtime.files.limits)")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"a non-finite number {text:.50} (JSON numbers are finite)")
    return value


def _constant(text: str) -> float:
    raise _Refused(f"a non-finite number {text} (not JSON; JSON numbers are finite)")


def parse_json(raw: Union[bytes, str], where: str, *, error: Type[MegaMoEError] = JsonError,
               max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH, what: str = "JSON",
               key_name: str = "key") -> Any:
    """Parse JSON text `raw` under the stated limits; `error` naming `where` on any defect. `what` names the
    text in messages ("safetensors header"), `key_name` what an object key is ("tensor name")."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > max_bytes:
        raise error(f"{where}: {what} of {len(raw)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: garbage {what} (not valid UTF-8 JSON: {e})") from None
    depth = json_depth(raw)
    if depth > max_depth:
        raise error(f"{where}: {what} nests {depth} levels deep (limit {max_depth}, megamoe_runtime.files.limits)")
    try:
        return json.loads(text, object_pairs_hook=_pairs, parse_int=_int, parse_float=_float,
                          parse_constant=_constant)
    except _DupKey as e:
        raise error(f"{where}: duplicate {key_name} {e.args[0]!r:.200} in the {what}") from None
    except _Refused as e:
        raise error(f"{where}: {what} refused: {e.args[0]}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise error(f"{where}: garbage {what} (not valid JSON: {e})") from None


def read_json(path: Union[str, os.PathLike], *, error: Type[MegaMoEError] = JsonError,
              expect: Optional[type] = dict, max_bytes: int = MAX_JSON_BYTES, what: str = "JSON") -> Any:
    """Read and parse the JSON file `path` under the stated limits (see the module docstring): never reads more
    than `max_bytes` + 1 bytes. `expect` (default dict) is the required top-level type; None accepts any.
    `error` naming the file on any defect, including an OSError while reading."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) > max_bytes:
        raise error(f"{path}: {what} file is larger than the limit of {max_bytes} bytes")
    data = parse_json(raw, str(path), error=error, max_bytes=max_bytes, what=what)
    if expect is not None and not isinstance(data, expect):
        raise error(f"{path}: expected a JSON {'object' if expect is dict else expect.__name__}, "
                    f"found {type(data).__name__}")
    return data
