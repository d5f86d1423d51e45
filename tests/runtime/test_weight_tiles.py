"""The tiled in-memory weight arrangement (`megamoe_runtime.format.weight_tiles`) and the layer's handling of it:
derived in place after a load, restored before the next load writes, invisible to loaders, the dry run and
the reference backend."""
from __future__ import annotations

import pytest
import torch

import megamoe_runtime as mr
from megamoe_runtime.backends.reference import ReferenceBackend
from megamoe_runtime.errors import LayoutError
from megamoe_runtime.format import weight_tiles
from megamoe_runtime.layer.experts import DeepGemmMegaMoEExperts
from megamoe_runtime.load.raw_load import load_raw_checkpoint


def _bytes(E, N, kb, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (E, N, kb), generator=g, dtype=torch.uint8).view(dtype)


def _bits_by_definition(b: torch.Tensor) -> torch.Tensor:
    """E2M1 bytes with the bits of each little-endian 32-bit word placed one by one as
    ``E2M1_WORD_BITS`` says (natural bit n at stored bit E2M1_WORD_BITS[n])."""
    w = b.reshape(-1, 4).to(torch.int64)
    word = w[:, 0] | (w[:, 1] << 8) | (w[:, 2] << 16) | (w[:, 3] << 24)
    out = torch.zeros_like(word)
    for n, at in enumerate(weight_tiles.E2M1_WORD_BITS):
        out |= ((word >> n) & 1) << at
    return torch.stack([(out >> (8 * i)) & 0xFF for i in range(4)], 1).to(torch.uint8).reshape(b.shape)


def _tiled_by_definition(w: torch.Tensor, wt: int, run: int) -> torch.Tensor:
    """The arrangement written out element by element (docs/LAYOUT.md, "Tiled weights in memory"): byte i of
    row r in K block b sits at ((r // wt) * nblk + b) * wt * run + (r % wt) * run + i of the expert; E2M1
    bytes also store the bits of every 32-bit word in the tiled order."""
    E, N, kb = w.shape
    nblk = kb // run
    src = w.view(torch.uint8)
    out = torch.empty(E, N * kb, dtype=torch.uint8)
    for r in range(N):
        for b in range(nblk):
            at = ((r // wt) * nblk + b) * wt * run + (r % wt) * run
            out[:, at:at + run] = src[:, r, b * run:(b + 1) * run]
    if w.dtype != torch.float8_e4m3fn:
        out = _bits_by_definition(out)
    return out.view(E, N, kb)


def test_e2m1_bit_order_is_a_permutation_of_five_moves():
    assert sorted(weight_tiles.E2M1_WORD_BITS) == list(range(32))
    for to_tiled in (True, False):
        moves = weight_tiles.e2m1_bit_moves(to_tiled)
        assert len(moves) == 5
        masks = [m for _, m in moves]
        assert sum(masks) == 0xFFFFFFFF and all(a & b == 0 for i, a in enumerate(masks) for b in masks[i + 1:])
    w = torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    t = weight_tiles.permute_e2m1_bits(w, True)
    assert torch.equal(t.view(torch.uint8), _bits_by_definition(w.view(torch.uint8)))
    assert torch.equal(weight_tiles.permute_e2m1_bits(t, False), w)
    # int64 words are two int32 words: no bit crosses between them
    assert torch.equal(weight_tiles.permute_e2m1_bits(w.view(torch.int64), True).view(torch.int32), t)
    with pytest.raises(LayoutError, match="int32 or int64"):
        weight_tiles.permute_e2m1_bits(w.view(torch.uint8), True)


def test_layout_doc_states_the_bit_order():
    """docs/LAYOUT.md spells the table out for readers of the in-memory arrangement: it must be this one."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "LAYOUT.md").read_text()
    line = next(ln for ln in doc.splitlines() if ln.strip().startswith("stored:"))
    assert tuple(int(x) for x in line.split(":", 1)[1].replace("|", " ").split()) == weight_tiles.E2M1_WORD_BITS


@pytest.mark.parametrize("dtype,run", [(torch.uint8, 64), (torch.int8, 64), (torch.float8_e4m3fn, 128)])
@pytest.mark.parametrize("wt", [8, 16, 32])
def test_tiled_copy_matches_the_definition_and_inverts(dtype, run, wt):
    w = _bytes(3, 64, 3 * run, dtype)
    t = weight_tiles.tiled_copy(w, wt)
    assert t.dtype == w.dtype and t.shape == w.shape
    assert torch.equal(t.view(torch.uint8), _tiled_by_definition(w, wt, run))
    assert torch.equal(weight_tiles.untiled_copy(t, wt).view(torch.uint8), w.view(torch.uint8))
    # negative control: another tile size is another arrangement
    assert not torch.equal(weight_tiles.tiled_copy(w, wt * 2).view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("scratch", [None, 1])
def test_in_place_passes_keep_the_storage(scratch, monkeypatch):
    if scratch is not None:  # one expert per chunk, and a chunk count that does not divide E
        monkeypatch.setattr(weight_tiles, "SCRATCH_BYTES", scratch)
        monkeypatch.setattr(weight_tiles, "_BIT_SLICE_WORDS", 96)  # bit-permutation slices that do not divide
    w = _bytes(5, 32, 128, torch.uint8, seed=1)
    want = weight_tiles.tiled_copy(w, 16)
    orig, ptr = w.clone(), w.data_ptr()
    weight_tiles.tile_in_place(w, 16)
    assert w.data_ptr() == ptr and torch.equal(w, want)
    weight_tiles.untile_in_place(w, 16)
    assert w.data_ptr() == ptr and torch.equal(w, orig)


def test_untileable_shapes_and_dtypes_are_refused():
    with pytest.raises(LayoutError, match="cannot be tiled by 24 rows"):
        weight_tiles.tiled_copy(_bytes(1, 32, 64, torch.uint8), 24)
    with pytest.raises(LayoutError, match="cannot be tiled"):
        weight_tiles.tiled_copy(_bytes(1, 32, 96, torch.uint8), 16)  # 96 bytes is no whole number of 64-byte runs
    with pytest.raises(LayoutError, match="bfloat16"):
        weight_tiles.run_bytes(torch.zeros(1, 16, 64, dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="contiguous"):
        weight_tiles.tiled_copy(_bytes(2, 32, 64, torch.uint8)[:, ::2], 16)


def test_no_scratch_moves_no_byte(monkeypatch):
    w = _bytes(2, 32, 64, torch.uint8, seed=2)
    orig = w.clone()

    def no_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(weight_tiles.torch, "empty", no_memory)
    with pytest.raises(weight_tiles.ScratchError, match="scratch"):
        weight_tiles.tile_in_place(w, 16)
    assert torch.equal(w, orig)


# --------------------------------------------------------------------------- the layer


class _TilingReference(ReferenceBackend):
    """The reference backend asking for tiled weights, as the triton backend does on a GPU: the layer must
    tile after loads, restore before them, and the reference must still compute from the right bytes."""

    def __init__(self, wt: int = 16):
        super().__init__()
        self.wt = wt

    def weight_tiles(self, spec, device) -> int:
        return self.wt


@pytest.fixture
def no_scratch_memory(monkeypatch):
    """Calling it makes the in-place passes' scratch allocation (int64) fail as CUDA out of memory would;
    ``monkeypatch.undo()`` ends it."""
    real_empty = torch.empty

    def no_scratch(*a, dtype=None, **k):
        if dtype is torch.int64:
            raise torch.OutOfMemoryError("simulated")
        return real_empty(*a, dtype=dtype, **k)

    return lambda: monkeypatch.setattr(weight_tiles.torch, "empty", no_scratch)


FMT = "modelopt-mxfp4"
SIZES = dict(intermediate=256)  # two K blocks in the down projection too


def _inputs(spec, T=6):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, spec.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[:spec.top_k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, spec.top_k, generator=g), dim=1)
    return x, w, ids


def test_layer_tiles_after_load_and_forward_is_unchanged(ckpts):
    _, out = ckpts.converted(FMT, **SIZES)
    ck = mr.open_checkpoint(out)
    plain = ck.build_layer(0, backend="reference")
    tiled = ck.build_layer(0, backend=_TilingReference())
    assert plain.weight_tiles == 0 and tiled.weight_tiles == 16
    for name in ("l1_weight", "l2_weight"):
        want = weight_tiles.tiled_copy(getattr(plain, name).detach(), 16)
        assert torch.equal(getattr(tiled, name).view(torch.uint8), want.view(torch.uint8)), name
    x, w, ids = _inputs(plain.spec)
    assert torch.equal(tiled(x, w, ids), plain(x, w, ids))
    # negative control: the same bytes taken for the converted layout give another output
    tiled.weight_tiles = 0
    assert not torch.equal(tiled(x, w, ids), plain(x, w, ids))


def test_reload_keeps_storage_and_rederives(ckpts, layer_bytes):
    _, out = ckpts.converted(FMT, **SIZES)
    ck = mr.open_checkpoint(out)
    layer = ck.build_layer(0, backend=_TilingReference())
    snap, before, gen = layer.storage_snapshot, layer_bytes(layer), layer.load_generation
    ck.load_layer(layer)
    assert layer.storage_snapshot == snap and layer.weight_tiles == 16 and layer.load_generation == gen + 1
    after = layer_bytes(layer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_dry_run_sees_the_converted_layout_and_moves_nothing(ckpts, layer_bytes):
    _, out = ckpts.converted(FMT, **SIZES)
    ck = mr.open_checkpoint(out)
    layer = ck.build_layer(0, backend=_TilingReference())
    before = layer_bytes(layer)
    rep = mr.verify_reload(layer, out)
    assert rep.ok, rep.problems()
    assert layer.weight_tiles == 16
    after = layer_bytes(layer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_partial_raw_reload_leaves_no_expert_tiled(ckpts):
    """A raw (vLLM-style) reload of ONE expert: the first write restores the converted layout of every
    expert, so the experts it does not touch are not left in the tiled arrangement."""
    src, out = ckpts.converted(FMT, **SIZES)
    ck = mr.open_checkpoint(out)
    ref = ck.build_layer(0, backend="reference")
    layer = ck.build_layer(0, backend=_TilingReference())
    spec = layer.spec
    from megamoe_runtime.files.file_io import SafetensorsFile
    from megamoe_runtime.layer.loaders import parse_expert_weight_name

    last = spec.num_experts - 1
    refs = []
    for p in sorted(src.glob("*.safetensors")):
        with SafetensorsFile(p) as f:
            refs += [(p, r) for r in map(parse_expert_weight_name, f.entries)
                     if r is not None and r.prefix == layer.prefix and r.expert_id == last]
    assert refs
    for p, r in refs:
        with SafetensorsFile(p) as f:
            layer.weight_loader(None, f.tensor(r.name).clone(), r.name, r.shard_id, last)
        assert layer.weight_tiles == 0  # restored before the first byte was written
    layer.finish_load()
    assert layer.weight_tiles == 16
    x, w, ids = _inputs(spec)
    assert torch.equal(layer(x, w, ids), ref(x, w, ids))


def test_raw_checkpoint_load_tiles_at_the_end(ckpts):
    src, out = ckpts.converted(FMT, **SIZES)
    ck = mr.open_checkpoint(out)
    ref = ck.build_layer(0, backend="reference")
    layer = DeepGemmMegaMoEExperts(ck.layer_spec(0), backend=_TilingReference(), prefix=ref.prefix, layer_index=0)
    load_raw_checkpoint(layer, src, strict=False)
    assert layer.weight_tiles == 16
    x, w, ids = _inputs(layer.spec)
    assert torch.equal(layer(x, w, ids), ref(x, w, ids))


def test_no_scratch_keeps_the_converted_layout(ckpts, monkeypatch, no_scratch_memory):
    _, out = ckpts.converted(FMT, **SIZES)
    ck = mr.open_checkpoint(out)
    plain = ck.build_layer(0, backend="reference")
    layer = ck.allocate_layer(0, backend=_TilingReference())
    no_scratch_memory()
    with pytest.warns(UserWarning, match="converted layout"):
        ck.load_layer(layer)
    monkeypatch.undo()
    assert layer.weight_tiles == 0 and layer.unusable_reason is None
    x, w, ids = _inputs(plain.spec)
    assert torch.equal(layer(x, w, ids), plain(x, w, ids))


def test_state_dict_holds_the_converted_layout(ckpts):
    _, out = ckpts.converted(FMT, **SIZES)
    ck = mr.open_checkpoint(out)
    plain = ck.build_layer(0, backend="reference")
    tiled = ck.build_layer(0, backend=_TilingReference())
    sd = tiled.state_dict()
    for name in ("l1_weight", "l2_weight"):
        assert torch.equal(sd[name].view(torch.uint8), getattr(plain, name).view(torch.uint8)), name
    other = ck.allocate_layer(0, backend=_TilingReference())
    other.load_state_dict(sd)
    assert other.weight_tiles == 16
    x, w, ids = _inputs(plain.spec)
    assert torch.equal(other(x, w, ids), plain(x, w, ids))


def test_a_load_failing_midway_on_a_tiled_layer(ckpts, monkeypatch):
    """A read failing after writes began: the layer (restored to the converted layout before the first write)
    is unusable; the next good load makes it usable, tiled and equal to a fresh build."""
    from megamoe_runtime.errors import LayerUnusableError
    from megamoe_runtime.files import file_io

    _, out = ckpts.converted(FMT, **SIZES)
    ck = mr.open_checkpoint(out)
    plain = ck.build_layer(0, backend="reference")
    layer = ck.build_layer(0, backend=_TilingReference())
    real, calls = file_io.read_file_into, {"n": 0}

    def flaky(path, offset, nbytes, dst):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(5, "Input/output error")
        return real(path, offset, nbytes, dst)

    monkeypatch.setattr(file_io, "read_file_into", flaky)
    with pytest.raises(LayerUnusableError, match="Input/output error"):
        ck.load_layer(layer)
    assert layer.weight_tiles == 0
    x, w, ids = _inputs(plain.spec)
    with pytest.raises(LayerUnusableError):
        layer(x, w, ids)
    monkeypatch.setattr(file_io, "read_file_into", real)
    ck.load_layer(layer)
    assert layer.weight_tiles == 16 and layer.unusable_reason is None
    assert torch.equal(layer(x, w, ids), plain(x, w, ids))


def test_no_scratch_to_restore_refuses_the_load_and_keeps_the_layer(ckpts, layer_bytes, monkeypatch,
                                                                   no_scratch_memory):
    """Without memory to restore the converted layout, a load is refused before its first write: the layer keeps
    its tiled bytes, its flag and its usability."""
    _, out = ckpts.converted(FMT, **SIZES)
    ck = mr.open_checkpoint(out)
    plain = ck.build_layer(0, backend="reference")
    layer = ck.build_layer(0, backend=_TilingReference())
    before = layer_bytes(layer)
    no_scratch_memory()
    with pytest.raises(weight_tiles.ScratchError, match="scratch"):
        ck.load_layer(layer)
    monkeypatch.undo()
    after = layer_bytes(layer)
    assert layer.weight_tiles == 16 and layer.unusable_reason is None
    assert all(torch.equal(before[k], after[k]) for k in before)
    x, w, ids = _inputs(plain.spec)
    assert torch.equal(layer(x, w, ids), plain(x, w, ids))
