"""What a `--resume` costs: resume times as ratios to a fresh conversion, one process.

    python bench/resume.py                   # 4 MoE layers, Qwen3-30B-A3B-like shape (~1.4 GB in)
    python bench/resume.py --layers 8 --workdir /mnt/fast

A resume keeps a finished file without reading it when the journal saw it
closed with the status (inode, size, mtime, ctime) it has now, on the same
boot, and re-derives nothing from a source whose files' status is the one
journaled (`temp_folder.check_kept_files`, `source_unverified`). Where that
cannot be proved it falls back to the exact checks: kept files re-hashed
(after a restart), their tensors re-derived from the source and compared (a
source file touched, or written just before the interrupted run read it).
Measured, each best of ``--repeat``, against a fresh conversion of the same
source (page cache warm for the source; the shards are written with
O_DIRECT, so a re-hash reads them from disk):

* ``fresh``: a conversion from nothing;
* ``resume at 50%``: stopped (planted ``on_step``) after half the tensors, then ``resume=True``;
* ``resume at 50%, after a restart``: the same with another boot id (every kept file re-hashed);
* ``resume at 50%, source re-derived``: the same with a source too recent to trust (the tensors of the
  kept files re-derived and compared, as every resume did before);
* ``resume complete``: stopped after the journal's ``complete`` record (only the swap left).

The source is built, then left alone for `temp_folder.RACY_NS` (2 s), as any
real source is. Prints a Markdown section for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path


class _Stop(BaseException):
    pass


def _stop_at(step: str, n: int):
    seen = [0]

    def on_step(name: str) -> None:
        if name == step:
            seen[0] += 1
            if seen[0] >= n:
                raise _Stop()
    return on_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="quark-mxfp4")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None)
    a = ap.parse_args()

    import megamoe_convert.pipeline.convert as conv
    import megamoe_convert.output.temp_folder as tf
    from megamoe_convert.testing import synth
    from megamoe_convert.output.output_dir import temp_dir_for

    work = Path(tempfile.mkdtemp(prefix="megamoe-bench-resume-", dir=a.workdir or Path.cwd()))
    try:
        src = synth.build_synthetic_checkpoint(work / "src", a.format, num_layers=a.layers, hidden=a.hidden,
                                               intermediate=a.intermediate, num_experts=a.experts, top_k=8)
        time.sleep(tf.RACY_NS / 1e9)  # a source older than the racy window, as a real one is
        out = work / "out"
        ref = conv.convert(src, out)
        n_tensors = sum(1 for _ in __import__("megamoe_runtime").manifest.read_manifest(out).tensors)
        shutil.rmtree(out)

        def fresh() -> float:
            t = time.perf_counter()
            conv.convert(src, out)
            dt = time.perf_counter() - t
            shutil.rmtree(out)
            return dt

        def resumed(step: str, n: int, mode: str = "") -> float:
            try:
                conv.convert(src, out, on_step=_stop_at(step, n))
            except _Stop:
                pass
            saved = tf.boot_id, tf.RACY_NS
            if mode == "restart":
                tf.boot_id = lambda: "another-boot"
            elif mode == "rederive":
                tf.RACY_NS = 1 << 62
            try:
                t = time.perf_counter()
                conv.convert(src, out, resume=True)
                dt = time.perf_counter() - t
            finally:
                tf.boot_id, tf.RACY_NS = saved
            shutil.rmtree(out)
            assert not temp_dir_for(out).exists()
            return dt

        rows = {
            "fresh": min(fresh() for _ in range(a.repeat)),
            "resume at 50%": min(resumed("tensor", n_tensors // 2) for _ in range(a.repeat)),
            "resume at 50%, after a restart": min(resumed("tensor", n_tensors // 2, "restart")
                                                  for _ in range(a.repeat)),
            "resume at 50%, source re-derived": min(resumed("tensor", n_tensors // 2, "rederive")
                                                    for _ in range(a.repeat)),
            "resume complete": min(resumed("complete", 1) for _ in range(a.repeat)),
        }
        gb = ref.bytes_in / 1e9
        print(f"\n### --resume ({a.format}, {a.layers} layers, hidden {a.hidden}, intermediate "
              f"{a.intermediate}, {a.experts} experts: {gb:.2f} GB in)\n")
        print(f"`python bench/resume.py --layers {a.layers}` on {platform.node()} ({os.cpu_count()} CPUs), "
              "page cache warm, best of {a.repeat}:\n".replace("{a.repeat}", str(a.repeat)))
        print("| run | seconds | vs fresh |\n|---|---|---|")
        for k, v in rows.items():
            print(f"| {k} | {v:.2f} | {v / rows['fresh']:.2f}x |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
