"""The guarded JSON reader: limits on size, depth and integer digits, duplicate keys, errors naming the file."""
from __future__ import annotations

import json
import random

import pytest

from megamoe_runtime.errors import CheckpointError, ManifestError, MegaMoEError
from megamoe_runtime.files.json_io import JsonError, json_depth, parse_json, read_json
from megamoe_runtime.files.limits import MAX_INT_DIGITS, MAX_JSON_DEPTH


def _depth(o) -> int:
    """Independent reference: nesting depth by recursion over the parsed value."""
    if isinstance(o, dict):
        return 1 + max((_depth(v) for v in o.values()), default=0)
    if isinstance(o, list):
        return 1 + max((_depth(v) for v in o), default=0)
    return 0


def _random_value(rng: random.Random, level: int):
    r = rng.random()
    if level > 7 or r < 0.3:  # strings full of brackets, quotes and backslashes must not count
        return rng.choice([1, -3, 2.5, None, True, "a[\\\"{", "\\\\", 'x"]}', "\\\\\"[", "}", ""])
    if r < 0.65:
        return [_random_value(rng, level + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["[", "k\\", '"{', "]"]) + str(i): _random_value(rng, level + 1)
            for i in range(rng.randint(0, 3))}


def test_depth_matches_a_recursive_reference():
    rng = random.Random(14)
    for _ in range(1500):
        value = _random_value(rng, 0)
        text = json.dumps(value, indent=rng.choice([None, 1]))
        assert json_depth(text.encode()) == _depth(value), text


def test_depth_scan_spans_chunks():
    # a string literal and a nest that straddle the 4 MiB chunk boundary
    pad = "x" * ((1 << 22) - 3)
    value = {"s": pad + "[[[[", "n": [[[[[]]]]]}
    assert json_depth(json.dumps(value).encode()) == 6


def test_accepts_ordinary_json():
    assert parse_json('{"a": [1, 2.5, "x"], "b": {"c": null}}', "t.json") == {"a": [1, 2.5, "x"], "b": {"c": None}}
    deep = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert _depth(parse_json(deep, "t.json")) == MAX_JSON_DEPTH
    assert parse_json("[" + "9" * MAX_INT_DIGITS + "]", "t.json") == [int("9" * MAX_INT_DIGITS)]


@pytest.mark.parametrize("text,match", [
    ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), f"nests {MAX_JSON_DEPTH + 1} levels deep"),
    ("[" * 200_000, "nests 200000 levels deep"),
    ("[" + "7" * (MAX_INT_DIGITS + 1) + "]", f"integer of {MAX_INT_DIGITS + 1} digits"),
    ('{"n": -' + "1" * 5000 + "}", "integer of 5000 digits"),
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('{"x": {"a": 1, "a": 1}}', "duplicate key 'a'"),
    ("{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not valid UTF-8"),
    ('{"eps": NaN}', "non-finite number NaN"),
    ('[Infinity]', "non-finite number Infinity"),
    ('[-Infinity]', "non-finite number -Infinity"),
    ('[1e400]', "non-finite number 1e400"),
])
def test_refusals_name_the_file(text, match):
    with pytest.raises(JsonError, match=match) as e:
        parse_json(text, "some/dir/thing.json")
    assert str(e.value).startswith("some/dir/thing.json: ")
    assert isinstance(e.value, MegaMoEError)


def test_read_json_bounds_size_and_type(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"a": "' + "x" * 100 + '"}')
    assert read_json(p)["a"] == "x" * 100
    with pytest.raises(ManifestError, match=r"config\.json: JSON file is larger than the limit of 50 bytes"):
        read_json(p, error=ManifestError, max_bytes=50)
    p.write_text("[1]")
    with pytest.raises(CheckpointError, match=r"config\.json: expected a JSON object, found list"):
        read_json(p, error=CheckpointError)
    assert read_json(p, expect=None) == [1]
    with pytest.raises(JsonError, match="missing.json: cannot read"):
        read_json(tmp_path / "missing.json")


HOSTILE = {
    "deep": "'[' * 20_000_000",
    "digits": "'[' + '9' * 20_000_000 + ']'",
    "quotes": "'[' + '\"\\\\\\\\\"' * 5_000_000 + '[' * 100 + ']'",
}


def test_hostile_text_refused_in_bounded_memory(bounded_python):
    """20 MB of hostile JSON of each kind refused under a 1.4 GiB address-space cap (torch alone takes about
    650 MiB): the depth scan never reaches the recursive parser and works in fixed-size chunks. The negative
    control shows the cap is real: a 1.4 GiB allocation in the same process fails."""
    code = ["from megamoe_runtime.files.json_io import parse_json, JsonError"]
    for kind, expr in sorted(HOSTILE.items()):
        code += [f"raw = ({expr}).encode()",
                 "try:\n    parse_json(raw, 'hostile.json')\nexcept JsonError as e:\n"
                 f"    print('REFUSED {kind}', str(e)[:120])", "del raw"]
    code += ["try:\n    bytearray(1400 << 20)\nexcept MemoryError:\n    print('CAPPED')"]
    r = bounded_python("\n".join(code))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert [ln.split()[1] for ln in lines[:-1]] == sorted(HOSTILE), r.stdout
    assert all(ln.split()[2] == "hostile.json:" for ln in lines[:-1]), r.stdout
    assert "nests 20000000 levels" in lines[0] and "integer of 20000000 digits" in lines[1] and "nests 101 levels" in lines[2], r.stdout
    assert lines[-1] == "CAPPED"


@pytest.mark.parametrize("header,match", [
    (b'{"t": {"dtype": "U8", "shape": [2], "data_offsets": [0, ' + b"2" * 5000 + b"]}}", "integer of 5000 digits"),
    (b'{"t": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests 5001 levels deep"),
])
def test_hostile_safetensors_header_names_the_file(tmp_path, header, match):
    """The issue's tracebacks: a 5000-digit integer or deep nesting in a safetensors header was a ValueError /
    RecursionError naming no file; now a CheckpointError naming it, from the one header parser."""
    import struct

    from megamoe_runtime.files.safetensors_header import parse_safetensors_header

    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    with pytest.raises(CheckpointError, match=match) as e:
        parse_safetensors_header(p)
    assert str(e.value).startswith(f"{p}: ")
