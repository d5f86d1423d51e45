"""Files, read and written safely: the lowest floor of the runtime.

Owns the limits on every size an input claims (`limits`), the guarded JSON reader (`json_io`), the
safetensors header parser (`safetensors_header`), checksums (`digests`), a tensor's bytes as a buffer
(`tensor_bytes`), reads from files straight into tensors with their worker threads and the page-cache /
O_DIRECT paths (`file_io`, `page_cache_dma`, `work_queue`), file names that must stay inside a folder
(`folder`), and the lock file every megamoe writer of a folder holds (`writer_lock`: the converter's and the
kernel-cache build's). Nothing here knows what the bytes mean.

May import: `megamoe_runtime.errors`, and its own modules (no circle). Never `format`, `backends`,
`layer`, `load` or `integrations` (tests/test_import_floors.py).
"""
