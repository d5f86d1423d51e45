"""The source-format facts the raw loader reads (megamoe_runtime.format.source_formats)."""
from __future__ import annotations

import pytest

from megamoe_runtime.format import source_formats as sf
from megamoe_runtime.layer import loaders

#: the raw loader's suffix table as it was written out by hand before issue 12 (a behaviour guard)
_SUFFIX_KINDS_BEFORE = {
    "weight": ("weight", False),
    "weight_packed": ("weight", False),
    "weight_scale": ("scale", False),
    "scale": ("scale", False),
    "weight_scale_2": ("global_scale", False),
    "weight_global_scale": ("global_scale", True),
    "input_scale": ("input_scale", False),
    "input_scale_2": ("input_scale", False),
    "input_global_scale": ("input_scale", True),
    "weight_scale_inv": ("scale", False),  # the fp8_block row's multiplier (added with that row)
}
_FORMAT_SUFFIXES_BEFORE = {
    "modelopt": ("weight_scale_2", "weight_scale", "weight", "input_scale"),
    "compressed-tensors": ("weight_global_scale", "input_global_scale", "weight_packed", "weight_scale", "weight"),
    "quark": ("weight_scale_2", "weight_scale", "weight", "input_scale_2"),
    "deepseek-v4": ("weight", "scale"),
    "mx": ("weight_scale", "weight"),
    "bf16": ("weight",),
    "fp8-block": ("weight", "weight_scale_inv"),
}


def test_suffix_meanings_are_what_the_raw_loader_always_used():
    assert sf.SUFFIX_KINDS == _SUFFIX_KINDS_BEFORE
    assert loaders.SUFFIX_KINDS is sf.SUFFIX_KINDS
    assert loaders._FORMAT_SUFFIXES == _FORMAT_SUFFIXES_BEFORE
    assert list(loaders._FORMAT_SUFFIXES) == list(_FORMAT_SUFFIXES_BEFORE)  # the order "valid:" lists them in


def test_projection_vocabulary():
    assert {sf.SHARD_OF_ROLE[r] for r in sf.PROJECTION_ROLES.values()} == set(loaders.SHARD_IDS)
    assert set(sf.PROJECTION_PATTERN.split("|")) == set(sf.PROJECTION_ROLES)


def test_a_suffix_with_two_meanings_is_refused():
    a = sf.SourceFamily("a", (sf.SuffixMeaning("weight_scale_2", "global_scale"),))
    b = sf.SourceFamily("b", (sf.SuffixMeaning("weight_scale_2", "global_scale", divisor=True),))
    with pytest.raises(ImportError, match="weight_scale_2"):
        sf._union([a, b])
    with pytest.raises(ValueError, match="kind"):
        sf.SuffixMeaning("x", "bias")


@pytest.mark.parametrize("fmt", list(_FORMAT_SUFFIXES_BEFORE))
def test_params_mapping_lists_each_family_longest_suffix_first(fmt):
    m = loaders.make_expert_params_mapping(1, fmt=fmt)
    want = sorted(_FORMAT_SUFFIXES_BEFORE[fmt], key=len, reverse=True)
    assert [w.rsplit(".", 1)[1] for _, w, _, s in m if s == "w1"] == want
