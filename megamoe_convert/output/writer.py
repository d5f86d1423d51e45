"""Former home of the writer, the temp-folder protocol and verify: names kept importable.

The three jobs this file once held now live in one module each:

* ``shard_writer``: the streaming safetensors writer and its byte helpers;
* ``temp_folder``: the temp folder, its journal, and the final swap;
* ``megamoe_runtime.load.verify``: `verify_output` (a serve-only install verifies
  a folder without the converter).

Code in this package imports from those modules; this one only re-exports,
so callers written against ``megamoe_convert.output.writer`` keep working.
"""
from __future__ import annotations

from megamoe_runtime.files.digests import file_digest, hash_file, safetensors_digests
from megamoe_runtime.format.manifest import PASSTHROUGH_ROLE
from megamoe_runtime.load.verify import VerifyReport, verify_output

from .output_dir import JOURNAL_NAME, TMP_MARKER, OutputError, temp_dir_for, write_temp_marker
from .shard_writer import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    ST_METADATA,
    PlannedTensor,
    ShardWriter,
    copy_source_bytes,
    format_bytes,
    json_bytes,
    parse_size,
    plan_shards,
    safetensors_header,
    sha256_file,
    start_writeback,
    tensor_bytes,
    write_bytes_atomic,
)
from .temp_folder import Journal, check_output_target, finalize_output, prepare_temp_dir

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE", "OutputError", "parse_size", "format_bytes", "PlannedTensor", "plan_shards",
    "safetensors_header", "ShardWriter", "tensor_bytes", "copy_source_bytes", "sha256_file", "file_digest",
    "safetensors_digests",
    "write_bytes_atomic", "json_bytes", "temp_dir_for", "check_output_target", "prepare_temp_dir", "finalize_output", "Journal",
    "VerifyReport", "verify_output", "PASSTHROUGH_ROLE", "INDEX_NAME", "JOURNAL_NAME", "TMP_MARKER", "OutputError",
]
