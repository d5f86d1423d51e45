"""`megamoe-convert warm`: compile a converted folder's triton kernels once, into a kernel cache that ships.

A module of its own (cli.py registers it with one line): the command only parses its options and hands the
work to `megamoe_runtime.integrations.warm.build_cache`, which holds the writer lock of the folder it writes
(the converter's lock file, `megamoe_runtime.files.writer_lock`): a `convert` (or its `--overwrite` swap) and a
second `warm` or `build_cache` on the folder the cache is built in are refused while this runs, and it is
refused while they run (docs/KERNELS.md#cold-start).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from megamoe_runtime.errors import MegaMoEError

_DEFAULT_TOKENS = "1,2,3,4,8,16,17,32,33,64,65,128,129,256,257,512,513,1024,1025,2048,2049,4096,4097"


def _fail(msg: str, as_json: bool, code: int = 2) -> None:
    click.echo(f"error: {msg}", err=True)
    if as_json:
        click.echo(json.dumps({"ok": False, "exit_code": code, "error": msg}, indent=2))
    sys.exit(code)


@click.command("warm", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option("--cache", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Kernel cache folder to create, or an existing one (built for this triton, GPU architecture "
                   "and Python) to add to. Default: FOLDER/kernel-cache, which the transformers integration "
                   "finds by itself.")
@click.option("--tokens", default=_DEFAULT_TOKENS, show_default=True,
              help="Token counts per forward to compile for, comma-separated (a server's prompt lengths and "
                   "batch sizes; counts not listed still run, compiling at first use).")
@click.option("--jobs", type=click.IntRange(min=1, max=64), default=4, show_default=True,
              help="Worker processes compiling side by side (each loads one layer per distinct layer spec "
                   "on the GPU).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (only JSON).")
def warm(folder, cache, tokens, jobs, as_json):
    """Compile every triton kernel FOLDER's layers launch into a kernel cache, once, on the GPU kind it serves.

    A fresh machine's first token otherwise waits for triton to compile the kernels it needs. This runs
    one layer of each distinct layer spec, loaded from FOLDER, at each token count, with triton's cache
    pointed into the kernel cache; ship the folder with the model or bake it into the image. Loading
    FOLDER through transformers copies FOLDER/kernel-cache (or MEGAMOE_KERNEL_CACHE) into triton's cache
    before the first forward. A cache built with another triton, GPU architecture or Python is not used
    (one warning; the kernels compile at first use): rebuild it where the image changes.

    \b
    Examples:
      megamoe-convert warm ./out                              # -> ./out/kernel-cache
      megamoe-convert warm ./out --tokens 1,8,64,512 --jobs 8
      megamoe-convert warm ./out --cache /opt/kernels && MEGAMOE_KERNEL_CACHE=/opt/kernels python serve.py

    One run at a time writes a folder: while this builds FOLDER/kernel-cache it holds the converter's lock on
    FOLDER, so `convert ... FOLDER --overwrite` and a second `warm FOLDER` are refused (exit 2, naming this
    process), and this is refused while they run. A lock left by a killed run is taken over.

    Exit codes: 0 built, 2 bad input (not a converted folder, an --ep-size > 1 folder, no GPU or triton,
    --cache not a compatible kernel cache, a worker failed, the folder locked by another run), 3 internal
    error.
    """
    from megamoe_runtime.integrations.warm import build_cache, parse_tokens

    log = lambda m: click.echo(m, err=True)  # noqa: E731
    try:
        toks = parse_tokens(tokens)
        res = build_cache(folder, cache, toks, jobs=jobs, log=log)  # under the folder's writer lock
    except MegaMoEError as e:
        _fail(str(e), as_json)
    except OSError as e:
        _fail(f"{type(e).__name__}: {e}", as_json)
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        click.echo(f"kernel cache {res['cache']}: {res['entries']} kernels ({res['new_entries']} new) for "
                   f"{res['gpu']} ({res['capability']}), triton {res['triton']}, {len(res['tokens'])} token counts, "
                   f"{res['seconds']} s in {res['jobs']} worker(s)")
