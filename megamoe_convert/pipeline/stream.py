"""The streaming pass: layer by layer, a few experts at a time.

A rank's routed experts are packed into small reused buffers of a few
experts each (`Run.chunk_buffers`): every expert is read, checked, repaired
if asked and ``copy_``-ed (or read directly, ``direct``) into place, and each
finished chunk is queued to the shard writers as the next consecutive piece
of its four routed tensors (`ShardWriter.open_parts`: written at its planned
offset, hashed in order on background threads) while the next chunk is read.
The small per-expert tensors (NVFP4 alphas) and the shared expert are written
whole once the layer is done. Why chunks rather than whole-layer buffers:
fresh memory is expensive (each first-touched 4 KiB page costs a fault, about
1-2.5 us on a VM), and a whole layer's buffers would be 350 MB of it per run;
a few 24 MiB chunks are touched once and reused for the rest of the run, and
the peak RSS does not grow with the layer. On ``--resume`` the finished files'
tensors are re-derived and compared instead of written (`Run.check`).
"""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch

from megamoe_runtime import knobs
from megamoe_runtime.errors import CheckpointError, MegaMoEError
from megamoe_runtime.files import digests
from megamoe_runtime.files.digests import SHA256
from megamoe_runtime.format import layout
from megamoe_runtime.format.formats import Row, get_row
from megamoe_runtime.format.manifest import PASSTHROUGH_ROLE, to_stored
from megamoe_runtime.format.roles import KERNEL_ROLES, is_shared_role, shared_role
from megamoe_runtime.load.load_checks import FILE_KEY, RANK_KEY

from . import checks
from .direct import DirectWeights
from ..output.output_dir import STEP_TENSOR, Log, StepHook
from .plan import LayerPlan, Progress, Slot, SourceChangedError, report_file, report_where
from ..output.shard_writer import ST_METADATA, CopyBuffers, DirectIO, ShardWriter, copy_source_bytes, tensor_bytes
from .shared import shared_to_precision
from ..readers.common import all_finite, non_finite_message
from ..readers.source import CheckpointSource
from ..output.temp_folder import Journal


#: float dtypes a shared-expert weight may be stored in (checked for NaN / inf: `_prepare_shared`)
_FLOAT_WEIGHTS = (torch.bfloat16, torch.float16, torch.float32)
#: threads blake3 may use within one large tensor (sha256 is sequential)
HASH_THREADS = 1
#: write the shards' page-aligned bytes with O_DIRECT where the file system takes it (`ShardWriter`);
#: ``MEGAMOE_CONVERT_DIRECT=0`` writes through the page cache instead (an output to be loaded right
#: away then stays cached; a file system where O_DIRECT is slow)
DIRECT_WRITES = True


def _direct_writes() -> bool:
    """`DIRECT_WRITES`, unless ``MEGAMOE_CONVERT_DIRECT=0`` turns it off for this process."""
    return DIRECT_WRITES and knobs.value("MEGAMOE_CONVERT_DIRECT") not in ("0", "false", "no")


def read_threads() -> int:
    """Threads that read and pack routed experts: the cores this process may
    run on (its affinity, so ``taskset`` is honoured), at most 4 (the hash and
    write threads need cores too, and the page cache copy saturates first)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


class Run:
    """Mutable state of one streaming pass.

    Tensors are queued to their shard writers (hash and write on background
    threads) and their manifest entries recorded in queue order once done.
    Routed experts go through `NUM_BUFFER_SETS` chunk buffers of about
    `CHUNK_BYTES` each, used in turn: chunk k+1 is read and packed while
    chunks k and k-1 are still being hashed and written."""

    NUM_BUFFER_SETS = 3
    #: packed bytes per chunk buffer (at least one expert)
    CHUNK_BYTES = 24 << 20

    def __init__(self, tmp: Path, journal: Journal, slots_by_file: dict[str, list[Slot]],
                 done_files: dict[str, dict], total: int, progress: Progress | None,
                 on_step: StepHook | None = None, checksum: str = SHA256):
        self.tmp = tmp
        self.checksum = checksum
        self.on_step = on_step
        self.check_done = False  # resume: re-derive the finished files' tensors and compare (`check`)
        self.checked = 0
        self.journal = journal
        self.slots_by_file = slots_by_file
        self.done_files = done_files  # name -> journal record (size, sha256, digest, tensors)
        self.writers: dict[str, ShardWriter] = {}
        self.entries: dict[str, dict] = {}
        self.total = total
        self.done_bytes = 0
        self.kept_bytes = 0  # of done_bytes: the input of finished files a resume keeps (`skip`), not processed
        self.progress = progress
        self._buffers: dict = {}
        self._turn = 0  # which buffer set the next layer packs into
        # (slot, pending digest or piece, buffer set or -1, "write" | "check" (resume) | "piece")
        self._queued: list[tuple[Slot, object, int, str]] = []
        self._check_pool = None
        self._side = None
        self._readers = None
        self._direct: DirectIO | None = None
        self._directs: dict[int, tuple[layout.KernelTensors, DirectWeights]] = {}  # `direct_weights`
        self.passthrough: PassthroughCopy | None = None  # `start_passthrough`
        self.read_threads = read_threads()
        #: hash threads per shard writer: two where two cores are ours (`ShardWriter` hash lanes), else one
        self.hash_lanes = min(2, self.read_threads)

    def advance(self, n: int) -> None:
        self.done_bytes += n
        if self.progress:
            self.progress(min(self.done_bytes, self.total), self.total)

    def skip(self, n: int) -> None:
        """`advance` over input this run does not process: it belongs to files an interrupted run finished
        and this resume keeps (the summary's throughput counts only the bytes processed)."""
        self.kept_bytes += n
        self.advance(n)

    def needed(self, slot: Slot) -> bool:
        return slot.file not in self.done_files

    def writer(self, fname: str, steps: bool = True) -> ShardWriter:
        """`fname`'s shard writer, made on first use; `steps` False: it reports
        no ``tensor`` steps itself (`PassthroughCopy` replays them in order)."""
        w = self.writers.get(fname)
        if w is None:
            self.journal.confirm(f"creating {fname}")  # the temp folder is still this run's
            slots = self.slots_by_file[fname]
            meta = dict(ST_METADATA)
            if slots[0].ep_rank is not None:  # an expert file names itself (the loader checks it)
                meta.update({FILE_KEY: fname, RANK_KEY: str(slots[0].ep_rank)})
            w = ShardWriter(self.tmp / fname, [s.planned for s in slots], meta,
                            on_step=self.on_step if steps else None,
                            algorithm=self.checksum, hash_threads=HASH_THREADS, hash_lanes=self.hash_lanes,
                            direct_io=self.direct_io())
            self.writers[fname] = w
        return w

    def direct_io(self) -> DirectIO | None:
        """The staging buffers and device-write thread shared by this run's
        shard writers (`_direct_writes()`), made on first use."""
        if self._direct is None and _direct_writes():
            self._direct = DirectIO()
        return self._direct

    def finish_tensor(self, slot: Slot, checksum: str) -> None:
        self.entries.setdefault(slot.file, {})[slot.key] = slot.entry(checksum, self.checksum).to_dict()
        w = self.writers[slot.file]
        if len(self.entries[slot.file]) == len(w.plan):  # its last tensor is hashed and written
            size, fsha = w.close()
            del self.writers[slot.file]
            rec = {"name": slot.file, "size": size, "sha256": fsha, "digest": w.digest_kind,
                   "tensors": self.entries.pop(slot.file)}
            rec["stat"] = self.journal.record_file(slot.file, size, fsha, rec["tensors"], w.digest_kind)
            self.done_files[slot.file] = rec

    def write(self, slot: Slot, tensor: torch.Tensor, buffer_set: int = -1) -> None:
        """Queue `tensor` (which lives in kernel buffer set `buffer_set`, -1 for
        none) for `slot`; its entry is recorded once hashed and written."""
        stored, _ = to_stored(tensor, slot.storage)
        if tuple(tensor.stride()) != slot.kernel_strides:
            raise MegaMoEError(f"{slot.key}: kernel tensor strides {list(tensor.stride())} do not match the plan "
                               f"{list(slot.kernel_strides)} ({slot.storage})")
        self._queued.append((slot, self.writer(slot.file).write_async(slot.planned.name, stored), buffer_set,
                             "write"))

    def open_parts(self, slot: Slot) -> tuple:
        """Start streaming `slot`'s tensor in consecutive pieces (`put`), to its
        shard writer (a file still to write) or, on resume, to a checking hasher."""
        if self.needed(slot):
            return ("write", self.writer(slot.file).open_parts(slot.planned.name))
        if self._check_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._check_pool = ThreadPoolExecutor(1, thread_name_prefix="megamoe-check")
        return ("check", digests.new_hasher(self.checksum))

    def put(self, sink: tuple, slot: Slot, tensor: torch.Tensor, buffer_set: int) -> None:
        """Queue the next piece of `slot` (`tensor`: the kernel view of some
        consecutive experts, living in chunk buffer `buffer_set`)."""
        if tuple(tensor.stride()) != slot.kernel_strides or tuple(tensor.shape[1:]) != tuple(slot.kernel_shape[1:]):
            raise MegaMoEError(f"{slot.key}: kernel piece {list(tensor.shape)} strides {list(tensor.stride())} do not "
                               f"match the plan {list(slot.kernel_shape)} {list(slot.kernel_strides)} ({slot.storage})")
        stored, _ = to_stored(tensor, slot.storage)
        kind, target = sink
        data = tensor_bytes(stored)
        fut = target.put(data) if kind == "write" else self._check_pool.submit(target.update, data)
        self._queued.append((slot, fut, buffer_set, "piece"))

    def finish_parts(self, sink: tuple, slot: Slot) -> None:
        """All pieces of `slot` are queued: its entry (or resume check) follows them."""
        kind, target = sink
        if kind == "write":
            self._queued.append((slot, target.finish(), -1, "write"))
        else:
            self._queued.append((slot, self._check_pool.submit(target.hexdigest), -1, "check"))

    def check(self, slot: Slot, tensor: torch.Tensor, buffer_set: int = -1) -> None:
        """On resume: the tensor re-derived from the current source must be the
        one the interrupted run wrote into its finished file (journal checksum).
        Hashed on a background thread like a write; compared in `settle`."""
        stored, _ = to_stored(tensor, slot.storage)
        if self._check_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._check_pool = ThreadPoolExecutor(1, thread_name_prefix="megamoe-check")
        data, alg = tensor_bytes(stored), self.checksum
        self._queued.append((slot, self._check_pool.submit(lambda: digests.digest_bytes(alg, data).hex()),
                             buffer_set, "check"))

    def check_bytes(self, slot: Slot, got: str) -> None:
        want = self.done_files[slot.file]["tensors"][slot.key].get(self.checksum)
        if got != want:
            where = f"layer {slot.layer} " if slot.layer is not None else ""
            raise SourceChangedError(
                f"--resume refused: the source changed since the interrupted run: {where}tensor {slot.key!r} of "
                f"the finished file {slot.file} would now be {self.checksum} {got[:16]}..., the interrupted run "
                f"wrote {str(want)[:16]}... (same sizes and mtimes, different bytes); the output would mix old and "
                f"new source bytes. Pass --overwrite to discard {self.tmp} and convert again")
        self.checked += 1

    def settle(self, buffer_set: int | None = None) -> None:
        """Record finished tensors in queue order: all of them (`buffer_set`
        None), or up to the last one using `buffer_set` (its memory is then
        free to reuse); also any already done beyond that."""
        if buffer_set is None:
            upto = len(self._queued)
        else:
            upto = max((i + 1 for i, q in enumerate(self._queued) if q[2] == buffer_set), default=0)
        i = 0
        while i < len(self._queued) and (i < upto or self._queued[i][1].done()):
            i += 1
        done, self._queued = self._queued[:i], self._queued[i:]
        for slot, digest, _, kind in done:
            if kind == "check":
                self.check_bytes(slot, digest.result())
            elif kind == "write":
                self.finish_tensor(slot, digest.result())
            else:
                digest.result()  # a piece: re-raise a write or hash error

    def chunk_buffers(self, row: Row, E_l: int, H: int, I: int) -> tuple[int, layout.KernelTensors]:
        """(set index, kernel tensors for up to `chunk_experts` experts) to pack
        the next chunk into. Sets are allocated once per shape and reused: no
        allocation or page faults after the first few chunks. Every byte of the
        part used is overwritten by the expert writes. Pieces still queued from
        the set's previous use are waited for first."""
        g = self.chunk_experts(row, E_l, H, I)
        key = (row.name, g, H, I)
        if key not in self._buffers:
            self.settle()  # a different layer shape: let the old ones go
            self._buffers.clear()
            self._directs.clear()
            self._buffers[key] = [None] * self.NUM_BUFFER_SETS
        k = self._turn
        self._turn = (self._turn + 1) % self.NUM_BUFFER_SETS
        self.settle(k)
        sets = self._buffers[key]
        if sets[k] is None:
            sets[k] = layout.allocate_kernel_tensors(row, g, H, I)
        return k, sets[k]

    def direct_weights(self, reader, bset: int, buf: layout.KernelTensors) -> DirectWeights:
        """The `DirectWeights` of chunk buffer set `bset` (all of `buf`, the
        set as `chunk_buffers` gave it): one per set while its buffers live, so
        the iovec lists of each expert slot are built once per run."""
        got = self._directs.get(bset)
        if got is None or got[0] is not buf or got[1].reader is not reader:
            got = self._directs[bset] = (buf, DirectWeights(reader, buf))
        return got[1]

    def chunk_experts(self, row: Row, E_l: int, H: int, I: int) -> int:
        """Experts per chunk buffer: about `CHUNK_BYTES` of packed experts, and at
        least one per reader thread (so a chunk keeps every reader busy)."""
        itemsize = {"l1_weight": row.weight.kernel_dtype.itemsize, "l2_weight": row.weight.kernel_dtype.itemsize}
        per_expert = sum(math.prod(shape) * itemsize.get(role, 4)  # scales are int32
                         for role, shape in layout.kernel_shapes(row, 1, H, I).items())
        return max(1, min(E_l, max(self.read_threads, self.CHUNK_BYTES // max(per_expert, 1))))

    def map_experts(self, fn, experts: range) -> list[tuple[int, object]]:
        """``[(e, fn(e))]`` in expert order, the experts dealt round-robin over
        `read_threads` threads (this one included). The positional reads and most
        torch ops release the GIL, so a chunk's experts are read and packed on
        several cores. Every call finishes before this returns; then the failure
        of the lowest expert, if any, is raised, so errors do not depend on timing."""
        n = min(self.read_threads, len(experts))
        if n <= 1:
            return [(e, fn(e)) for e in experts]

        def share(k: int) -> list[tuple[int, object, BaseException | None]]:
            out = []
            for e in experts[k::n]:
                try:
                    out.append((e, fn(e), None))
                except Exception as exc:  # reported in expert order below
                    out.append((e, None, exc))
                    break
            return out

        if self._readers is None:
            from concurrent.futures import ThreadPoolExecutor

            self._readers = ThreadPoolExecutor(self.read_threads - 1, thread_name_prefix="megamoe-read")
        futs = [self._readers.submit(share, k) for k in range(1, n)]
        results = share(0)
        for f in futs:
            results += f.result()
        results.sort(key=lambda t: t[0])
        for e, _, exc in results:
            if exc is not None:
                raise exc
        return [(e, got) for e, got, _ in results]

    def side_pool(self):
        """One extra worker thread for per-layer work that overlaps the main loop."""
        if self._side is None:
            from concurrent.futures import ThreadPoolExecutor

            self._side = ThreadPoolExecutor(1, thread_name_prefix="megamoe-layer")
        return self._side

    def close_side_pool(self) -> None:
        if self._side is not None:
            self._side.shutdown(wait=True)
            self._side = None
        if self._readers is not None:
            self._readers.shutdown(wait=True)
            self._readers = None

    def start_passthrough(self, source: CheckpointSource) -> None:
        """Start copying the pass-through files still to write on their own
        thread (`PassthroughCopy`); `copy_passthrough` records them."""
        if self.passthrough is None:
            self.passthrough = PassthroughCopy(source, self)

    def abort(self) -> None:
        if self.passthrough is not None:  # its thread uses writers and buffers that go below
            self.passthrough.stop()
        self.close_side_pool()
        for w in self.writers.values():
            w.abort()
        self.close()

    def close(self) -> None:
        if self._check_pool is not None:
            self._check_pool.shutdown(wait=True)
            self._check_pool = None
        if self._direct is not None:  # every writer is closed or aborted by now
            self._direct.close()
            self._direct = None


def convert_layer(reader, row: Row, lp: LayerPlan, ep_size: int, run: Run, journaled: dict | None,
                   log: Log) -> dict:
    """Write one layer's tensors (the ranks whose files are not finished yet)
    and return its record (repairs, shared conversion), journaled once."""
    info = lp.info
    E_l = lp.spec.experts_per_rank
    report_where(run.progress, f"layer {info.index} ({info.prefix})")
    needed = [r for r in range(ep_size) if any(run.needed(s) or run.check_done for s in lp.slots.get(r, []))]
    if not needed and journaled is not None:
        run.skip(lp.source_bytes)
        return {"repairs": journaled["repairs"], "shared": journaled["shared"]}
    mismatched = {e for e, _, _ in lp.scalar_report.mismatches}
    repairs: list[dict] = []
    where = f"MoE layer {info.index} ({info.prefix})"

    # The shared experts (read, checked, re-encoded, packed) are prepared on a
    # second thread while this one reads the routed experts: torch ops and
    # positional reads release the GIL, so the two overlap on two cores.
    shared_fut = None
    if lp.spec.shared is not None:
        shared_fut = run.side_pool().submit(_prepare_shared, reader, lp, run, needed, where)
    try:
        return _convert_routed(reader, row, lp, ep_size, run, log, needed, mismatched, repairs, where, shared_fut)
    finally:
        if shared_fut is not None and not shared_fut.done():
            shared_fut.cancel()
            try:  # an error elsewhere: let the side thread finish before the source closes
                shared_fut.result()
            except BaseException:
                pass


def _prepare_shared(reader, lp: LayerPlan, run: Run, needed: list[int], where: str
                    ) -> tuple[layout.KernelTensors | None, dict]:
    """One layer's fused shared expert, packed (None if no rank needs it), and its record."""
    info = lp.info
    sh = info.shared
    sexperts = reader.read_shared(info.index)
    if not sexperts:
        raise CheckpointError(f"{where}: config declares shared experts but the reader found none")
    for i, ex in enumerate(sexperts):
        ex.validate(sh.encoding, info.hidden, sh.total_intermediate // len(sexperts),
                    f"{where} shared expert {i}")
        for role, p in ex.projections():
            checks.check_block_scales(p, get_row(sh.encoding), f"{where} shared expert {i} {role} scale",
                                      lambda role=role: checks.named_shared(info, role, "scale",
                                                                            reader.source))
            if p.weight.dtype in _FLOAT_WEIGHTS and not all_finite(p.weight):  # BF16 shared experts, any reader
                name = checks.named_shared(info, role, "weight", reader.source)
                raise CheckpointError(non_finite_message(
                    f"{where} shared expert {i} {role} weight{name}", p.weight,
                    f"The shared expert is copied or re-encoded ({sh.encoding} -> {lp.spec.shared.precision}), "
                    "which would serve the NaN / inf or hide it: fix the source"))
    converted, shared_rec = shared_to_precision(sexperts, sh.encoding, lp.spec.shared.precision)
    shared_kt = None
    if any(run.needed(s) or run.check_done for r in needed for s in lp.slots.get(r, [])
           if is_shared_role(s.role)):
        shared_kt = layout.pack_shared(lp.spec.shared.precision, converted)
    return shared_kt, shared_rec


def _convert_routed(reader, row: Row, lp: LayerPlan, ep_size: int, run: Run, log: Log, needed: list[int],
                    mismatched: set, repairs: list, where: str, shared_fut) -> dict:
    """The routed experts of one layer, rank by rank (see `convert_layer`)."""
    info = lp.info
    E_l = lp.spec.experts_per_rank
    shared_kt, shared_rec = None, {}
    # progress: expert k's share of the layer's source bytes, in integers whose sum is exactly
    # source_bytes (int(source_bytes / E) per expert dropped the remainder: a run ended short of 100%)
    E = max(info.num_experts, 1)

    def share(k: int) -> int:
        return lp.source_bytes * k // E
    for r in range(ep_size):
        lo = r * E_l
        if r not in needed:
            for e in sorted(mismatched & set(range(lo, lo + E_l))):  # reports only
                _, rr = checks.requantize_gate_up(reader.read_expert(info.index, e), f"{where} expert {e}")
                repairs.append({"expert": e, **rr})
            run.skip(share(lo + E_l) - share(lo))
            continue
        alpha = torch.zeros(E_l, 2, dtype=torch.float32)
        l2g = torch.zeros(E_l, dtype=torch.float32)
        slots = [s for s in lp.slots.get(r, []) if run.needed(s) or run.check_done]
        files = list(dict.fromkeys(s.file for s in slots))
        if files:
            report_file(run.progress, ", ".join(files))
        routed = {s.role: (s, run.open_parts(s)) for s in slots if s.role in KERNEL_ROLES}
        c0 = lo
        while c0 < lo + E_l:
            bset, buf = run.chunk_buffers(row, E_l, info.hidden, info.intermediate)
            c1 = min(lo + E_l, c0 + buf.num_experts)
            kt = buf.experts(0, c1 - c0)
            direct = run.direct_weights(reader, bset, buf)
            pack = functools.partial(_pack_expert, reader, row, info, kt, direct, c0, mismatched, where)
            for e, got in run.map_experts(pack, range(c0, c1)):  # in expert order, the first failure raised
                et, rr = got
                if rr is not None:
                    repairs.append({"expert": e, **rr})
                if row.weight.has_global_scale:
                    alpha[e - lo, 0] = et.gate.global_scale
                    alpha[e - lo, 1] = et.up.global_scale
                    l2g[e - lo] = et.down.global_scale
                del et, got
                run.advance(share(e + 1) - share(e))
            pieces = kt.named()
            for role, (slot, sink) in routed.items():
                run.put(sink, slot, pieces[role], bset)
            c0 = c1
        for role, (slot, sink) in routed.items():
            run.finish_parts(sink, slot)
        tensors = {}
        if row.weight.has_global_scale:
            tensors["l1_alpha"] = alpha
            tensors["l2_global_scale"] = l2g
        if shared_fut is not None:
            shared_kt, shared_rec = shared_fut.result()
            shared_fut = None
        if shared_kt is not None:
            tensors.update({shared_role(k): v for k, v in shared_kt.named().items()})
        for slot in slots:
            if slot.role in routed:
                continue
            if run.needed(slot):
                run.write(slot, tensors[slot.role])
            elif run.check_done:
                run.check(slot, tensors[slot.role])
        del tensors
    if shared_fut is not None:  # no rank wrote anything this time (all finished earlier)
        shared_kt, shared_rec = shared_fut.result()
    rec = {"repairs": repairs, "shared": shared_rec}
    run.journal.record_layer(info.index, rec)
    zeroed = [r for r in repairs if r["zeroed_blocks"]]
    if zeroed:
        log(f"warning: {where}: requantizing w1/w3 onto the larger weight_scale_2 pushed "
            f"{sum(r['zeroed_blocks'] for r in zeroed)} block scale(s) of {len(zeroed)} expert(s) below the E4M3 "
            f"range (they now dequantize to 0; first: expert {zeroed[0]['expert']}, "
            f"max relative change {zeroed[0]['max_rel_change']:.3g})")
    return rec


def _pack_expert(reader, row: Row, info, kt: layout.KernelTensors, direct: DirectWeights, c0: int,
                 mismatched: set, where: str, e: int):
    """Read, check (and repair if asked) expert `e` into chunk slot ``e - c0``:
    (its ExpertTensors with scalars, the repair record or None). Runs on any of
    the run's reader threads: it writes only its own slot."""
    # the requantize repair needs the weights in hand: those experts take the read_expert path
    if e not in mismatched and direct.read(info.index, e, e - c0):
        et = reader.read_expert(info.index, e, weights=False)  # meta weights: dtype/shape still checked
        checks.check_expert(et, row, info, e, reader.source, weights=direct.weights(row, e - c0))
        layout.write_expert_scales(row, kt, e - c0, et, where=f"{where} expert {e}")
        return et, None
    et = reader.read_expert(info.index, e)
    checks.check_expert(et, row, info, e, reader.source)
    rr = None
    if e in mismatched:
        et, rr = checks.requantize_gate_up(et, f"{where} expert {e}")
    layout.write_expert(row, kt, e - c0, et, where=f"{where} expert {e}")
    return et, rr


class _Stopped(MegaMoEError):
    """The run stopped (`PassthroughCopy.stop`) before this tensor was copied."""


class PassthroughCopy:
    """The pass-through tensors of the files still to write, copied from the
    start of the streaming pass on a thread of their own, beside the MoE
    layers, instead of after the last one.

    Why: copied last, they would be a tail of the conversion in which one
    thread reads, hashes and hands on 16 MiB at a time and the disk is busy
    half the time, and the disk would idle while the plan is made; beside the
    layers the same work fills the cores' and the disk's idle moments
    (docs/bench-log/convert.md).

    Only the bytes move early. Each tensor's ``tensor`` step, progress and
    manifest entry (and so the journal record of its file) are still made on
    the converting thread after the last layer, in plan order (`finish`):
    the N-th step is the same tensor as with a sequential copy, so a crash
    planted there leaves the same journal, and an unjournaled file is
    rewritten on ``--resume`` whatever part of it was written. Errors are
    raised in plan order too, except a refusal of bad input (a NaN or inf
    in a plain float tensor, `checks.passthrough_checked`; a truncated
    source file): `raise_refusal`, called between layers, raises it as soon
    as the copy finds it, since the run ends there and its temp folder goes
    (nothing is left to resume). Its writers are made here, on the calling
    thread, and used only by the copy thread until `finish` has its result."""

    def __init__(self, source: CheckpointSource, run: Run):
        import threading
        from concurrent.futures import Future

        self.run = run
        #: name -> dtype of the pass-through tensors whose values are checked as they are copied
        self.checked = checks.passthrough_checked({s.planned.name: s.planned.dtype for slots in
                                                   run.slots_by_file.values() for s in slots
                                                   if s.role == PASSTHROUGH_ROLE})
        self.refusal: MegaMoEError | None = None  # bad input the copy found (`raise_refusal`)
        self.jobs: list[tuple[Slot, Path, int, int, Future]] = []  # slot, path, offset, nbytes, its checksum
        for fname, slots in run.slots_by_file.items():
            if not slots or slots[0].role != PASSTHROUGH_ROLE or fname in run.done_files:
                continue
            run.writer(fname, steps=False)
            for slot in slots:
                th = source.tensor_header(slot.planned.name)
                path = source.file_of(slot.planned.name)
                fh = source.file_header(path)
                self.jobs.append((slot, path, 8 + fh.header_len + th.begin, th.nbytes, Future()))
        self._stop = threading.Event()
        self._thread = None
        if self.jobs:
            self._thread = threading.Thread(target=self._copy, name="megamoe-passthrough", daemon=True)
            self._thread.start()

    def _copy(self) -> None:
        buffers = CopyBuffers()  # one pair for every pass-through tensor
        for i, (slot, path, pos, n, fut) in enumerate(self.jobs):
            try:
                chunks = self.checked_chunks(slot, path, pos, copy_source_bytes(path, pos, n, None, buffers))
                fut.set_result(self.run.writers[slot.file].write_chunks(slot.planned.name,
                                                                         self._until_stopped(chunks)))
            except BaseException as exc:  # raised by `finish` in plan order; nothing after it is copied
                if isinstance(exc, MegaMoEError) and not isinstance(exc, _Stopped):
                    self.refusal = exc
                for *_, f in self.jobs[i:]:
                    f.set_exception(exc)
                return

    def checked_chunks(self, slot: Slot, path: Path, pos: int, chunks):
        """`chunks` of `slot`'s source bytes, checked for NaN / inf on the way where its tensor is one
        `checks.passthrough_checked` names."""
        dtype = self.checked.get(slot.planned.name)
        if dtype is None:
            return chunks
        return checks.finite_passthrough_chunks(chunks, dtype, slot.planned.name, path, pos, slot.planned.shape)

    def raise_refusal(self) -> None:
        """Raise the bad input the copy has found so far, if any."""
        if self.refusal is not None:
            raise self.refusal

    def _until_stopped(self, chunks):
        for c in chunks:
            if self._stop.is_set():
                raise _Stopped("stopped before the pass-through copy was complete")
            yield c

    def finish(self, fname: str) -> None:
        """Record `fname`'s tensors in plan order (their bytes copied by now or
        next): the ``tensor`` step, progress and entry of each."""
        for slot, _, _, n, fut in self.jobs:
            if slot.file != fname:
                continue
            digest = fut.result()
            self.run.advance(n)
            if self.run.on_step is not None:
                self.run.on_step(STEP_TENSOR)
            self.run.finish_tensor(slot, digest)

    def stop(self) -> None:
        """Stop the copy at its next chunk and wait for its thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


def copy_passthrough(source: CheckpointSource, run: Run) -> None:
    """Record (or, on resume, check) the pass-through files in plan order;
    their bytes are copied by `PassthroughCopy` (`Run.start_passthrough`,
    started here if it was not yet)."""
    run.start_passthrough(source)
    buffers = CopyBuffers()  # resume checks
    for fname, slots in run.slots_by_file.items():
        if not slots or slots[0].role != PASSTHROUGH_ROLE:
            continue
        report_file(run.progress, fname)
        if fname in run.done_files:
            if not run.check_done:
                run.skip(sum(s.planned.nbytes for s in slots))
                continue
            for slot in slots:  # resume: the finished file's bytes must still be the source's
                path, pos, n = source.tensor_data_range(slot.planned.name)
                h = digests.new_hasher(run.checksum)
                for chunk in run.passthrough.checked_chunks(slot, path, pos,
                                                            copy_source_bytes(path, pos, n, run.advance, buffers)):
                    h.update(chunk)
                run.check_bytes(slot, h.hexdigest())
            continue
        run.passthrough.finish(fname)
    run.passthrough.join()


__all__ = ["HASH_THREADS", "PassthroughCopy", "Run", "convert_layer", "copy_passthrough"]
