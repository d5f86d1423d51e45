"""The output transaction: the only code that creates, writes, renames or removes anything on disk.

Owns where and when bytes may be written (`output_dir`: the target checks, the lock, the ownership mark),
the hidden temp folder with its journal and resume (`temp_folder`), the shard files with their hashes and
the atomic small files (`shard_writer`), the one call that takes a temp folder to the final name (`writer`),
and the byte count people read (`units`). The tool never deletes or overwrites a byte it did not write:
that promise lives here and nowhere else.

Floor 1 of the converter (docs/ARCHITECTURE.md#converter-floors). May import: the runtime, and its own
modules (no circle). Never `readers` (it writes what it is handed, it never reads a checkpoint),
`pipeline`, `testing` or `cli` (tests/test_import_floors.py).
"""
