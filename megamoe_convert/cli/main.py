"""`megamoe-convert`: convert | inspect | verify | demo.

Exit codes (every command):
  0    success
  1    verification failed (`verify` found a mismatch, a missing file or a flipped byte;
       `demo`: that, or a served layer missed its calc_diff threshold vs the source)
  2    bad input or usage (unreadable/unsupported checkpoint, failed checks,
       OUT already exists, bad option, a --shared-precision the row cannot fuse)
  3    internal error: an exception megamoe did not expect (a bug, never a verdict
       on the input): one line on stderr naming it and the file its traceback was
       written to (``megamoe-convert-crash-*.txt`` in the temp folder), `_internal_error`
  130  interrupted by SIGINT (Ctrl-C); 143 stopped by SIGTERM (`convert` prints where
       the unfinished run is and the exact command that resumes it)

Progress bars and logs go to stderr, results to stdout; `--json` prints one
JSON object on stdout (and nothing else there) instead of the human summary,
errors included: ``{"ok": false, "exit_code": 2, "error": "..."}``.
"""
from __future__ import annotations

import time

#: when this command started (before torch and the converter are imported): the summary's "since start"
_STARTED = time.perf_counter()

import json  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import tempfile  # noqa: E402
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

# torch warns "Failed to initialize NumPy: No module named 'numpy'" (once, when its
# dispatch-mode machinery first touches numpy) on a machine without numpy; megamoe never
# needs numpy, so that exact warning is noise. Installed before anything imports torch.
warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy: No module named 'numpy'",
                        category=UserWarning)

import click  # noqa: E402

from megamoe_runtime.errors import MegaMoEError  # noqa: E402

from megamoe_runtime.files.digests import DEFAULT_CHECKSUM  # noqa: E402  (torch-free)

if TYPE_CHECKING:  # pragma: no cover
    from ..pipeline.inspection import InspectReport

# Nothing above imports torch: `--help`, `--version` and usage errors answer at
# once; each command imports what it needs (torch among it) when it runs.


def parse_size(text):
    from ..output.shard_writer import parse_size as parse

    return parse(text)


from ..output.units import format_bytes  # noqa: E402  (torch-free)
from .progress import ProgressDisplay  # noqa: E402  (torch-free)

def _hub_options(f):
    """--cache-dir, --token, --local-files-only: named as huggingface_hub's CLI and library name them;
    used only when SRC is a hub repo id (what `source.open_source` passes to snapshot_download)."""
    f = click.option("--local-files-only", is_flag=True, default=None,
                     help="Hub repos: use the local cache only, never the network (as HF_HUB_OFFLINE=1).")(f)
    f = click.option("--token", default=None, metavar="TOKEN",
                     help="Hub repos: the access token for private or gated repos (default: HF_TOKEN, or the "
                          "token `hf auth login` saved). Never printed.")(f)
    f = click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Hub repos: the cache folder to read and download into (default: HF_HUB_CACHE, or "
                          "huggingface_hub's ~/.cache/huggingface/hub).")(f)
    return f


_EXIT_OK, _EXIT_VERIFY_FAILED, _EXIT_BAD_INPUT, _EXIT_INTERNAL = 0, 1, 2, 3
_EXIT_SIGINT, _EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM  # 130, 143: the shell's convention


def _json_mode() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.params.get("as_json"))


def _fail(msg: str, code: int = _EXIT_BAD_INPUT, as_json: bool | None = None, **extra) -> None:
    """'error: msg' on stderr and exit `code`; under --json also the error as
    JSON on stdout (the only thing there), with `extra` fields. `as_json`: whether
    --json was given, where no command's context says it (a usage error)."""
    click.echo(f"error: {msg}", err=True)
    if _json_mode() if as_json is None else as_json:
        click.echo(json.dumps({"ok": False, "exit_code": code, "error": msg, **extra}, indent=2))
    sys.exit(code)


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt is for SIGINT,
    so the run unwinds (writers stopped, lock released) instead of dying."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def _signal_name_code(signum: int) -> tuple[str, int]:
    return ("SIGINT (Ctrl-C)", _EXIT_SIGINT) if signum == signal.SIGINT else ("SIGTERM", _EXIT_SIGTERM)


class _Interrupts:
    """The SIGINT/SIGTERM handlers of a guarded command. The first signal unwinds the run (KeyboardInterrupt /
    `_Terminated`: writers stopped, lock released, the resume command printed). A second one ends the process
    at once with its exit code (`os._exit`): waiting for writer threads on a slow disk is what the user
    refuses by signalling again. That is safe at any point, as a ``kill -9`` is: the temp folder is resumable
    and the kernel drops the locks; the renames of the final swap hold signals until they are done
    (`output_dir._signals_deferred`)."""

    def __init__(self, message=None):
        self.first: int | None = None
        self.message = message  # signal name -> (message, extra): what is left and how to continue

    def install(self) -> dict:
        return {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def handle(self, signum, frame):
        if self.first is None:
            self.first = signum
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise _Terminated()
        self.hard_exit(signum)

    def hard_exit(self, signum: int) -> None:
        import os

        name, code = _signal_name_code(signum)
        try:
            msg = self.message(name)[0] if self.message else f"interrupted by {name}"
            sys.stderr.write(f"error: a second signal: stopping now without waiting for the writers; {msg}\n")
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(code)


def _progress(label: str, no_progress: bool) -> ProgressDisplay:
    """The stderr progress display of `convert` / `verify`: a bar redrawn in place on a terminal, one
    plain line every few seconds otherwise (CI and k8s logs; ``MEGAMOE_PROGRESS_INTERVAL``), none with
    --no-progress."""
    return ProgressDisplay(label, "off" if no_progress else "auto", stream=sys.stderr)


def _run_guarded(fn, interrupted=None, io_failed=None):
    """Run fn(); MegaMoEError / OSError -> 'error: ...', exit 2; Ctrl-C -> exit
    130, SIGTERM -> 143, with `interrupted(signal name)` -> (message, extra
    JSON fields) saying what is left and how to continue; `io_failed(OSError)`
    likewise for a failed read or write (a full disk, an I/O error)."""
    main_thread = threading.current_thread() is threading.main_thread()
    guard = _Interrupts(interrupted)
    if main_thread:
        old = guard.install()
    try:
        return fn()
    except MegaMoEError as e:
        _fail(str(e))
    except OSError as e:
        msg, extra = io_failed(e) if io_failed else (f"{type(e).__name__}: {e}", {})
        _fail(msg, _EXIT_BAD_INPUT, **extra)
    except (KeyboardInterrupt, _Terminated) as e:
        name, code = _signal_name_code(signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM)
        guard.first = guard.first or (signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM)
        msg, extra = interrupted(name) if interrupted else (f"interrupted by {name}", {})
        _fail(msg, code, **extra)
    finally:
        # after an interruption the handlers stay: a signal while Python joins the writer threads at exit
        # ends the process at once (`_Interrupts.hard_exit`)
        if main_thread and guard.first is None:
            for sig, h in old.items():
                signal.signal(sig, h)


def _resume_command(ctx: click.Context) -> str:
    """The command line that continues this `convert` run: its own arguments
    and non-default options, plus --resume."""
    words = ["megamoe-convert", ctx.info_name or "convert"]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if isinstance(param, click.Argument):
            words.append(str(value))
            continue
        if param.name == "resume" or value == param.default or value is None:
            continue
        if param.name == "token":  # a secret is never printed: the resumed run needs HF_TOKEN or a login
            words += ["--token", "$HF_TOKEN"]
            continue
        opt = max(param.opts, key=len)
        if getattr(param, "is_flag", False):
            if value:
                words.append(opt)
        else:
            words += [opt, str(value)]
    words.append("--resume")
    return shlex.join(words)


def _out_and_temp_folder(out: Path) -> tuple[Path, Path]:
    """OUT as convert resolved it (as given where it cannot be resolved) and its temp folder: where an
    interrupted or failed run left its work."""
    from ..output.output_dir import resolve_out, temp_dir_for

    try:
        o = resolve_out(out)
    except MegaMoEError:
        o = Path(out)
    return o, temp_dir_for(o)


def _convert_interrupted(ctx: click.Context, out: Path):
    """What an interrupted `convert` prints: where its work is and the command that continues it."""
    def message(name: str):
        from ..output.output_dir import is_megamoe_output

        o, tmp = _out_and_temp_folder(out)
        if tmp.is_dir():
            cmd = _resume_command(ctx)
            return (f"interrupted by {name}; nothing was written under {o}. The unfinished conversion is in {tmp}; "
                    f"continue it with:\n  {cmd}", {"interrupted": name, "temp_folder": str(tmp),
                                                   "resume_command": cmd})
        if is_megamoe_output(o):
            return (f"interrupted by {name} after the conversion had finished: {o} is complete",
                    {"interrupted": name, "out": str(o)})
        return (f"interrupted by {name} before anything was written; run the same command again",
                {"interrupted": name})
    return message


def _convert_io_failed(ctx: click.Context, out: Path):
    """What a `convert` stopped by an OSError prints: the error with the file it names (the shard writer
    names the file a failed write was for), and, when the temp folder is there, that it stays and the
    command that continues once the cause (a full disk: free space) is gone."""
    def message(e: OSError):
        import errno

        o, tmp = _out_and_temp_folder(out)
        what = f"{type(e).__name__}: {e}"
        if e.filename is None:
            what += f" (no file named; the run was writing into {tmp})"
        if not tmp.is_dir():
            return what, {}
        cmd = _resume_command(ctx)
        when = "once space is free" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "once that is fixed"
        return (f"{what}. Nothing was written under {o}; {tmp} remains and keeps the finished files: {when}, "
                f"continue with:\n  {cmd}", {"temp_folder": str(tmp), "resume_command": cmd,
                                              **({"file": str(e.filename)} if e.filename else {})})
    return message


def _save_traceback(e: BaseException) -> str | None:
    """Write ``e``'s traceback, with the version and command line, to a new file in the temp folder; its path,
    or None (the traceback then goes to stderr) where no file can be written."""
    import os
    import traceback

    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        from importlib.metadata import version

        from ..output.output_dir import this_command  # the command line with a --token value hidden

        text = (f"megamoe-convert {version('megamoe')}, Python {sys.version.split()[0]}\n"
                f"command: {shlex.join(this_command()['argv'])}\n\n{text}")
    except Exception:  # noqa: BLE001 - the traceback matters, the header does not
        pass
    try:
        fd, path = tempfile.mkstemp(prefix="megamoe-convert-crash-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    except OSError:
        sys.stderr.write(text)
        return None


def _internal_error(e: BaseException, as_json: bool) -> None:
    """An exception no handler expected (a bug): exit 3 with one line naming it and where its traceback is,
    never 1 (`verify`'s "verification failed") nor a bare traceback a script cannot tell from a verdict."""
    what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    what = what.splitlines()[0][:300]
    where = _save_traceback(e)
    msg = (f"internal error (a bug in megamoe, not a verdict on the input): {what}; the traceback is in "
           + (f"{where}: please report it with that file" if where else "the lines above: please report it"))
    click.echo(f"error: {msg}", err=True)
    if as_json:
        click.echo(json.dumps({"ok": False, "exit_code": _EXIT_INTERNAL, "error": msg, "traceback": where},
                              indent=2))
    sys.exit(_EXIT_INTERNAL)


#: the name every message gives the command (also under ``python -m megamoe_convert``)
_PROG = "megamoe-convert"


def _usage_line(group: click.Group, e: click.UsageError, argv: list[str]) -> str:
    """A usage error (missing argument, bad option value, unknown option or command) as one line naming the
    command, the problem and where its help is: ``megamoe-convert convert: missing argument OUT (see
    megamoe-convert convert --help)``, not click's four lines (usage, "Try --help", blank, error)."""
    names, c = [], e.ctx
    while c is not None and c.parent is not None:
        names.append(c.info_name or "")
        c = c.parent
    if e.ctx is None:  # an option's missing value is reported by the parser, before a context exists
        names = [next((a for a in argv if a in group.commands), "")]
    path = " ".join([_PROG, *reversed([n for n in names if n])])
    if isinstance(e, click.MissingParameter) and e.param is not None:
        p = e.param
        what = (f"missing argument {p.human_readable_name}" if isinstance(p, click.Argument)
                else f"missing option {max(p.opts, key=len)}")
    elif isinstance(e, click.NoSuchOption):
        what = f"no such option {e.option_name}" + (
            f" (did you mean {' or '.join(e.possibilities)}?)" if e.possibilities else "")
    else:
        what = " ".join(e.format_message().split()).rstrip(".")
        if what[:1].isupper() and what[1:2].islower():
            what = what[0].lower() + what[1:]
    return f"{path}: {what} (see {path} --help)"


class _Group(click.Group):
    """Usage errors (unknown option, bad value, missing argument) are one line on stderr
    (`_usage_line`, through `_fail`), exit 2, and answer in JSON on stdout too
    when the command line asks for --json. Ctrl-C before a command's own
    handling starts (parsing, importing torch) exits 130 with one line, as
    every interruption does, not click's ``Aborted!`` with 1. An exception no
    command handled exits 3 (`_internal_error`); a MegaMoEError that got past
    its command's handling is still bad input (2)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode:
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        as_json = "--json" in argv
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:
            _fail(_usage_line(self, e, argv), e.exit_code, as_json=as_json)
        except click.ClickException as e:
            e.show()
            if as_json:
                click.echo(json.dumps({"ok": False, "exit_code": e.exit_code, "error": e.format_message()},
                                      indent=2))
            sys.exit(e.exit_code)
        except (click.exceptions.Abort, KeyboardInterrupt) as e:
            if not isinstance(e, KeyboardInterrupt) and not isinstance(e.__cause__, KeyboardInterrupt):
                click.echo("Aborted!", err=True)
                sys.exit(1)
            msg = "interrupted by SIGINT (Ctrl-C) while starting; nothing was written"
            click.echo(f"error: {msg}", err=True)
            if as_json:
                click.echo(json.dumps({"ok": False, "exit_code": _EXIT_SIGINT, "error": msg,
                                       "interrupted": "SIGINT (Ctrl-C)"}, indent=2))
            sys.exit(_EXIT_SIGINT)
        except OSError as e:  # click's own: a closed stdout (`| head`) ends quietly
            import errno

            if e.errno != errno.EPIPE:
                _internal_error(e, as_json)
            sys.exit(1)
        except MegaMoEError as e:
            click.echo(f"error: {e}", err=True)
            if as_json:
                click.echo(json.dumps({"ok": False, "exit_code": _EXIT_BAD_INPUT, "error": str(e)}, indent=2))
            sys.exit(_EXIT_BAD_INPUT)
        except Exception as e:  # noqa: BLE001 - the point: anything no command expected
            _internal_error(e, as_json)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="megamoe", prog_name="megamoe-convert")
def main() -> None:
    """Convert MoE checkpoints into DeepGEMM MegaMoE kernel layout, once, offline.

    \b
    Examples:
      megamoe-convert demo
      megamoe-convert inspect nvidia/Some-Model-NVFP4
      megamoe-convert convert nvidia/Some-Model-NVFP4 ./out --ep-size 8
      megamoe-convert verify ./out
      megamoe-convert synth ./src --layers 16 --experts 64 --hidden 2048   # a large source to try

    Exit codes: 0 ok, 1 verification failed, 2 bad input or usage, 3 internal error (a
    bug: its traceback's file is named), 130 Ctrl-C, 143 SIGTERM.
    """


# --------------------------------------------------------------------------- convert


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("src")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit); hub repos only.")
@_hub_options
@click.option("--format", "fmt", default=None,
              help="Force the source format (e.g. modelopt-nvfp4, quark-mxfp4, ct-nvfp4, deepseek-v4, unquantized; "
                   "an unknown name lists them all); default: detect from the quantization config.")
@click.option("--quantize", type=click.Choice(["mxfp4", "mxfp8", "nvfp4", "fp8_block"]), default=None,
              help="Quantize an unquantized (BF16/FP16/FP32) checkpoint with the reference quantizers.")
@click.option("--ep-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Write one set of expert shards per EP rank, each holding only that rank's experts.")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest shard, e.g. 5GB, 500MB, 1GiB (a single larger tensor gets its own shard).")
@click.option("--on-scale-mismatch", type=click.Choice(["error", "requantize"]), default="error", show_default=True,
              help="NVFP4 w1/w3 weight_scale_2 disagreement: refuse, or re-encode both halves onto the larger "
                   "scale (block scales rescaled, nibbles unchanged; the change is reported).")
@click.option("--allow-missing-input-scales", is_flag=True,
              help="NVFP4: experts without a w2 input scale take the max of the others for a2 "
                   "(default: refuse, a2 must be the max over ALL experts).")
@click.option("--l2-activation-scale", type=float, default=None,
              help="NVFP4, uncalibrated checkpoints only (e.g. --quantize nvfp4): the global L2 activation scale "
                   "a2 (amax of the expert intermediate / 2688, from your own calibration). Refused when the "
                   "checkpoint's w2 input scales determine a2.")
@click.option("--shared-precision", type=click.Choice(["auto", "mxfp8", "bf16"]), default="auto", show_default=True,
              help="Precision of the fused shared experts. auto: their own encoding when the row fuses it, else "
                   "the row's first fusable precision (the summary and megamoe.json say which and why). The nvfp4 "
                   "row fuses both: mxfp8 for vLLM's DeepGEMM fork (nvfp4_mega_moe), bf16 for newer upstream "
                   "DeepGEMM (fp4_fp4_mega_moe) and the fork. A precision the row cannot fuse is refused.")
@click.option("--accept-activation-change", is_flag=True,
              help="Convert a checkpoint whose activations the kernel quantizes more coarsely than the producer "
                   "did (weight-only W4A16 exports, FP8 activations on the nvfp4 row); recorded in megamoe.json.")
@click.option("--checksum", type=click.Choice(["sha256", "blake3"]), default=DEFAULT_CHECKSUM, show_default=True,
              help="Algorithm of the manifest's tensor checksums and file digests. blake3 hashes several times "
                   "faster per core; verifying a blake3 folder needs the blake3 package; sha256 needs nothing extra.")
@click.option("--overwrite", is_flag=True,
              help="Replace OUT if it is a megamoe output (or empty), only once the new output is complete; any "
                   "other folder is refused. Also discards an interrupted run's .OUT.megamoe-tmp.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from .OUT.megamoe-tmp with the same options "
                                             "(other ones are named and refused): finished shards are kept (re-hashed "
                                             "if touched or after a restart; their tensors re-derived from the source "
                                             "and compared if its files' status changed); a changed source is "
                                             "refused.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option("--no-progress", is_flag=True,
              help="No progress display (default: a bar on a terminal, else one line every 10 s on stderr; "
                   "MEGAMOE_PROGRESS_INTERVAL sets the seconds).")
def convert(src, out, revision, cache_dir, token, local_files_only, fmt, quantize, ep_size, max_shard_size, on_scale_mismatch,
            allow_missing_input_scales, l2_activation_scale, shared_precision, accept_activation_change, checksum,
            overwrite, resume, as_json, no_progress):
    """Convert checkpoint SRC (local folder or hub repo id) into OUT.

    Checks everything first (every expert present, shapes and dtypes against
    the config and the row's size rules, scales finite and > 0, NVFP4 w1/w3
    scale agreement, a2 = max over all experts), then writes kernel-layout
    shards, the pass-through tensors, the config files and `megamoe.json` into
    `.OUT.megamoe-tmp` beside OUT and renames it at the end.

    \b
    Examples:
      megamoe-convert convert ./Qwen3-30B-A3B-NVFP4 ./qwen3-megamoe
      megamoe-convert convert nvidia/DeepSeek-R1-NVFP4 ./r1 --revision main --ep-size 8
      megamoe-convert convert ./model-bf16 ./out --quantize mxfp4 --max-shard-size 2GB
      megamoe-convert convert ./model-bf16 ./out --quantize nvfp4 --l2-activation-scale 0.002
      megamoe-convert convert ./glm-nvfp4 ./out --on-scale-mismatch requantize --json
      megamoe-convert convert ./r1-nvfp4 ./out --shared-precision bf16   # for upstream fp4_fp4_mega_moe
      megamoe-convert convert ./src ./out --resume      # after an interrupted run
      megamoe-convert convert ./w4a16-nvfp4 ./out --accept-activation-change --l2-activation-scale 0.002
      megamoe-convert convert ./src ./out --checksum sha256   # verifiable without the blake3 package
      megamoe-convert convert org/private-model ./out --token hf_xxx --cache-dir /data/hf
      megamoe-convert convert org/model ./out --local-files-only   # from the cache, never the network

    OUT may not overlap SRC or contain the working directory; its missing
    parent folders are created. One run per OUT at a time (a lock beside it,
    `.OUT.megamoe-lock`); a run killed at any point is finished, undone or
    resumed by the next one, and Ctrl-C / SIGTERM print the exact command
    that resumes it.

    Exit codes: 0 converted, 2 bad input or usage (nothing is left under OUT),
    3 internal error, 130 / 143 interrupted by Ctrl-C / SIGTERM (OUT untouched).
    """
    bar = _progress("converting", no_progress)
    bar.stage("loading torch and the converter")  # a first line at once: the import takes seconds
    try:
        max_bytes = parse_size(max_shard_size)  # (shard_writer imports torch)
    except MegaMoEError as e:
        bar.close(False)
        raise click.BadParameter(str(e), param_hint="--max-shard-size")

    def run():
        from ..pipeline.convert import convert as do_convert

        ok = False
        try:
            s = do_convert(src, out, revision=revision, format=fmt, quantize=quantize, ep_size=ep_size,
                              max_shard_size=max_bytes, on_scale_mismatch=on_scale_mismatch,
                              allow_missing_input_scales=allow_missing_input_scales, overwrite=overwrite,
                              resume=resume, progress=bar, log=lambda m: click.echo(m, err=True),
                              shared_precision=shared_precision, l2_activation_scale=l2_activation_scale,
                              accept_activation_change=accept_activation_change,
                              checksum=checksum, cache_dir=cache_dir, token=token,
                              local_files_only=local_files_only)
            ok = True
            return s
        finally:
            bar.close(ok)

    ctx = click.get_current_context()
    s = _run_guarded(run, _convert_interrupted(ctx, out), _convert_io_failed(ctx, out))
    if as_json:
        click.echo(json.dumps(s.to_dict(), indent=2))
        return
    _print_summary(s)


def _print_summary(s) -> None:
    click.echo(f"converted {s.source} ({s.format} -> row {s.row}) into {s.out}")
    per = s.experts // s.layers if s.layers and s.experts % s.layers == 0 else None
    experts = f"{per} per layer ({s.experts} in all)" if per is not None else f"{s.experts} in all"
    click.echo(f"  MoE layers: {s.layers}   routed experts: {experts}   ep_size: {s.ep_size}   files: {s.files}"
               + (f"   resumed files: {s.resumed_files}" if s.resumed_files else ""))
    click.echo(f"  bytes in: {format_bytes(s.bytes_in)}   bytes out: {format_bytes(s.bytes_out)}")
    kept = getattr(s, "bytes_kept", 0)
    click.echo(f"  time: {s.seconds:.2f} s converting (checks, reads, writes, rename), "
               f"{time.perf_counter() - _STARTED:.2f} s since the command started (imports included)   "
               f"throughput: {s.gb_per_s:.2f} GB/s"
               + (f" (over the {format_bytes(s.bytes_in - kept)} processed by this run; {format_bytes(kept)} "
                  "kept from the earlier run)" if kept else ""))
    act = (s.recipe or {}).get("activations")
    if act:
        src, ker = act["source"]["description"], act["kernel"]["description"]
        click.echo(f"  activations: {act['relation']}: source {src} -> kernel {ker}"
                   + (f" (accepted with {act['accepted_with']})" if act.get("accepted_with") else ""))
    if (s.recipe or {}).get("weights"):
        click.echo(f"  weights: {s.recipe['weights']}")
    if s.repaired_experts:
        click.echo(f"  requantized w1/w3 pairs: {s.repaired_experts} (details in megamoe.json layers[].repairs)")
    for d in s.shared:
        if d["precision"] is None:
            click.echo(f"  shared experts (layers {d['layers']}): not fused: {d['reason']}")
            continue
        click.echo(f"  shared experts (layers {d['layers']}): fused as {d['precision']} ({d['reason']})")
        if d["note"]:
            click.echo(f"    {d['note']}")
    out, src = shlex.quote(str(s.out)), shlex.quote(str(s.source))
    click.echo(f"next: megamoe-convert verify {out} --against {src}   (the served layers against the source)")
    click.echo(f"      transformers: AutoModelForCausalLM.from_pretrained({str(s.out)!r})   (the installed package "
               f"registers megamoe with transformers; docs/ENGINES.md#transformers)")
    click.echo(f"      vLLM: vllm serve {out} --load-format megamoe")


# --------------------------------------------------------------------------- inspect


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("src")
@click.option("--revision", default=None, help="Hub revision; hub repos only.")
@_hub_options
@click.option("--format", "fmt", default=None, help="Force the source format; default: detect.")
@click.option("--quantize", type=click.Choice(["mxfp4", "mxfp8", "nvfp4", "fp8_block"]), default=None,
              help="As for convert: the row an unquantized checkpoint would be quantized to.")
@click.option("--ep-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="EP size to check divisibility and size the output for.")
@click.option("--shared-precision", type=click.Choice(["auto", "mxfp8", "bf16"]), default="auto", show_default=True,
              help="As for convert: the precision fused shared experts would be written in.")
@click.option("--accept-activation-change", is_flag=True,
              help="As for convert: a coarser activation recipe is accepted, not a problem.")
@click.option("--l2-activation-scale", type=float, default=None,
              help="As for convert: the a2 an uncalibrated NVFP4 checkpoint would be given.")
@click.option("--on-scale-mismatch", type=click.Choice(["error", "requantize"]), default="error", show_default=True,
              help="As for convert: with requantize, NVFP4 w1/w3 weight_scale_2 disagreements are listed as the "
                   "repairs convert would make, not as problems.")
@click.option("--allow-missing-input-scales", is_flag=True,
              help="As for convert: experts without a w2 input scale are a repair (a2 = max of the others), "
                   "not a problem.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout (with ok and exit_code).")
def inspect(src, revision, cache_dir, token, local_files_only, fmt, quantize, ep_size, shared_precision, accept_activation_change, l2_activation_scale,
            on_scale_mismatch, allow_missing_input_scales, as_json):
    """Describe checkpoint SRC without converting it.

    Format and row, MoE layers, experts, shapes, shared experts (fusable or
    why not), the NVFP4 scale agreement report (w1/w3 weight_scale_2, a2),
    problems that would stop `convert`, and the estimated output size. Reads
    safetensors headers and the scalar scale tensors only. Exit 2 when the
    checkpoint cannot be converted as it is.

    \b
    Examples:
      megamoe-convert inspect ./Qwen3-30B-A3B-NVFP4
      megamoe-convert inspect nvidia/DeepSeek-R1-NVFP4 --ep-size 8 --json
      megamoe-convert inspect ./model-bf16 --quantize nvfp4
      megamoe-convert inspect ./r1-nvfp4 --shared-precision bf16
      megamoe-convert inspect ./w4a16-nvfp4 --accept-activation-change --l2-activation-scale 0.002
      megamoe-convert inspect ./glm-nvfp4 --on-scale-mismatch requantize   # preview the repaired run
      megamoe-convert inspect org/model --local-files-only --cache-dir /data/hf

    Exit codes: 0 convertible, 2 bad input (problems listed) or usage, 3 internal error.
    """
    from ..pipeline.inspection import inspect_checkpoint

    rep = _run_guarded(lambda: inspect_checkpoint(src, revision=revision, format=fmt, quantize=quantize,
                                                  ep_size=ep_size, shared_precision=shared_precision,
                                                  accept_activation_change=accept_activation_change,
                                                  l2_activation_scale=l2_activation_scale,
                                                  on_scale_mismatch=on_scale_mismatch,
                                                  allow_missing_input_scales=allow_missing_input_scales,
                                                  cache_dir=cache_dir, token=token,
                                                  local_files_only=local_files_only))
    if as_json:
        click.echo(json.dumps(rep.to_dict(), indent=2))
    else:
        _print_inspect(rep)
    if not rep.ok:
        sys.exit(_EXIT_BAD_INPUT)


def _print_inspect(rep: "InspectReport") -> None:
    click.echo(f"source: {rep.source}  ({rep.files} safetensors file(s), {format_bytes(rep.bytes)} on disk; "
               f"bytes in: {format_bytes(rep.tensor_bytes)} of tensors, as convert counts them)")
    click.echo(f"format: {rep.format}  ->  row {rep.row}")
    click.echo(rep.activations)
    m = rep.model
    act = m["activation"]
    click.echo(f"model: {m['model_type']}  experts {m['num_experts']}  top_k {m['top_k']}  "
               f"routed_scaling_factor {m['routed_scaling_factor']}  activation {act['kind']}"
               + (f" clamp {act['clamp']}" if act.get("clamp") is not None else ""))
    click.echo(f"MoE layers: {len(rep.layers)}")
    for group in rep.layer_groups:
        click.echo(f"  layers {group['layers']}: hidden {group['hidden']}, intermediate {group['intermediate']}, "
                   f"{group['num_experts']} experts")
    for role, shp in rep.shapes.items():
        click.echo(f"  {role}: weight {shp['weight']}" + (f", scale {shp['scale']}" if shp["scale"] else ""))
    click.echo(f"shared experts: {_shared_line(rep.shared)}")
    if rep.scales:
        sc = rep.scales
        bad = sc.get("unchecked_layers") or []
        if sc["pairs"]:
            click.echo(f"scale agreement: {sc['mismatched_pairs']} of {sc['pairs']} w1/w3 {sc['tensor']} pairs differ "
                       f"(max relative difference {sc['max_rel_diff']:.3g}, tolerance {sc['tolerance']:g})"
                       + (f"; layers {_layer_ranges_text(bad)} not checked (a scale is unreadable, see problems)"
                          if bad else ""))
        else:
            click.echo(f"scale agreement: not checked: layers {_layer_ranges_text(bad)} have a scale that is not "
                       "finite and > 0 (see problems)" if bad else "scale agreement: no w1/w3 pairs")
        if sc["missing_input_scales"]:
            click.echo(f"  experts without a w2 input scale: {sc['missing_input_scales']}")
    if rep.estimated_expert_bytes is None:
        click.echo(f"estimated output: not estimated: no expert layout at ep_size {rep.ep_size} (see problems); "
                   f"pass-through {format_bytes(rep.passthrough_bytes)}")
    else:
        click.echo(f"estimated output: about {format_bytes(rep.estimated_output_bytes)} "
                   f"(experts {format_bytes(rep.estimated_expert_bytes)}, pass-through "
                   f"{format_bytes(rep.passthrough_bytes)}) with ep_size {rep.ep_size}")
    if rep.recipe and rep.recipe.get("weights"):
        click.echo(f"weights: {rep.recipe['weights']}")
    for r in rep.repairs:
        click.echo(f"repair: {r}")
    if rep.problems:
        click.echo("problems (convert would refuse):")
        for p in rep.problems:
            click.echo(f"  - {p}")
    else:
        click.echo("ok: convertible" + (f" with {len(rep.repairs)} repair(s) listed above" if rep.repairs else ""))


def _layer_ranges_text(indices) -> str:
    from ..pipeline.plan import layer_ranges

    return layer_ranges(list(indices))


def _shared_line(sh: dict) -> str:
    if "present" not in sh:  # differs per layer
        return "; ".join(f"layer {k}: {_shared_line(v)}" for k, v in sh.items())
    if not sh["present"]:
        return "none"
    what = f"{sh['num_shared']} x intermediate {sh['intermediate']} ({sh['source_encoding']})"
    if sh["fused_capable"]:
        why = f" ({sh['precision_reason']}); {sh['flavour_note']}" if sh.get("precision_reason") else ""
        return f"{what} -> fused as {sh['precision']}{why}"
    return f"{what}, not fusable: {sh['reason']}"


# --------------------------------------------------------------------------- verify


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--reload-dry-run", is_flag=True,
              help="Also dry-run a reload of every layer of every EP rank (megamoe_runtime.verify_reload: "
                   "meta stand-ins from the headers, every write intercepted) and prove each parameter byte is "
                   "written exactly once.")
@click.option("--no-progress", is_flag=True,
              help="No progress display (default: a bar on a terminal, else one line every 10 s on stderr).")
@click.option("--against", "against", default=None, metavar="SRC",
              help="Also serve every MoE layer (reference backend, CPU) and compare it with an fp32 MoE computed "
                   "from source checkpoint SRC (a folder or hub repo id, read as the conversion read it): one "
                   "calc_diff per layer, each below its row's threshold (bf16 1e-4, mxfp8/mxfp4 2e-3, nvfp4 2e-2).")
@click.option("--tokens", type=click.IntRange(min=1, max=4096), default=16, show_default=True,
              help="With --against: tokens per layer in the comparison.")
def verify(out, as_json, reload_dry_run, no_progress, against, tokens):
    """Check converted folder OUT against its manifest (and, with --against, its source).

    Manifest schema, version and self-digest, every file present with its size and
    digest, every safetensors header consistent with the manifest, every
    tensor's checksum (sha256 or blake3, as the manifest says; a blake3 folder
    needs the blake3 package). Exit 1 with a report on any mismatch, missing
    file or flipped byte, or (--against) a layer above its threshold.

    \b
    Examples:
      megamoe-convert verify ./qwen3-megamoe
      megamoe-convert verify ./qwen3-megamoe --json
      megamoe-convert verify ./qwen3-megamoe --reload-dry-run
      megamoe-convert verify ./qwen3-megamoe --against ./Qwen3-30B-A3B-NVFP4

    Exit codes: 0 verified, 1 verification failed, 2 OUT is not a megamoe output (no
    folder, or no megamoe.json in it) or its blake3 checksums cannot be computed here,
    3 internal error (a bug in megamoe, not a verification result).
    """
    from megamoe_runtime.format.manifest import MANIFEST_NAME

    if out.is_dir() and not (out / MANIFEST_NAME).exists():
        # bad input, not a failed verification: there is no manifest to verify against
        _fail(f"{out} is not a megamoe output: it has no {MANIFEST_NAME} (the manifest is written last, so an "
              f"interrupted conversion has none either; `megamoe-convert convert SRC OUT` makes one, "
              f"`megamoe-convert inspect {out}` describes a source checkpoint)", _EXIT_BAD_INPUT,
              path=str(out.resolve()))
    bar = _progress("verifying", no_progress)
    bar.stage(f"reading {out}")

    def run():
        from megamoe_runtime.load.verify import verify_output

        ok = False
        try:
            r = verify_output(out, progress=bar)
            ok = True
            return r
        finally:
            bar.close(ok)

    rep = _run_guarded(run)
    # the JSON names the folder absolutely, as convert's does; the text keeps the path as typed
    result = {**rep.to_dict(), "path": str(Path(rep.path).resolve())}
    if reload_dry_run and rep.ok:
        result["reload"] = _reload_dry_run(out)
        if not result["reload"]["ok"]:
            rep.problems.extend(result["reload"]["problems"])
            result["problems"], result["ok"] = rep.problems, False
    if against is not None and rep.ok:
        result["against"] = _verify_against(out, against, tokens, bar_off=no_progress)
        if not result["against"]["ok"]:
            bad = [le for le in result["against"]["layers"] if not le["ok"]]
            rep.problems.extend(f"layer {le['index']} ({le['prefix']}): calc_diff {le['calc_diff']:.2e} against "
                                f"{against} >= threshold {le['threshold']:.0e}" for le in bad)
            result["problems"], result["ok"] = rep.problems, False
    result["exit_code"] = _EXIT_OK if rep.ok else _EXIT_VERIFY_FAILED
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        _print_verify(rep, result.get("reload"), result.get("against"))
    if not rep.ok:
        sys.exit(_EXIT_VERIFY_FAILED)


def _verify_against(out: Path, src: str, tokens: int, bar_off: bool) -> dict:
    """megamoe_convert.cli.against: every layer of OUT served and compared with the fp32 MoE of SRC."""
    from .against import compare_folder_with_source

    if not bar_off:
        click.echo(f"verify: comparing every MoE layer of {out} with {src} ({tokens} tokens) ...", err=True)
    return _run_guarded(lambda: compare_folder_with_source(out, src, tokens=tokens))


def _reload_dry_run(out: Path) -> dict:
    """megamoe_runtime.load.reload.dry_run_checkpoint: every layer of every EP rank
    built on the meta device, loaders run against header-only stand-ins."""
    from megamoe_runtime.load.reload import dry_run_checkpoint

    try:
        reports = dry_run_checkpoint(out)
    except MegaMoEError as e:
        return {"ok": False, "ranks": 0, "layers": 0, "layer_loads": 0, "problems": [f"reload dry run: {e}"]}
    problems = [f"reload dry run, rank {r}: {p}" for r, rep in enumerate(reports) for p in rep.problems()]
    # "layers": the model's MoE layers (each rank loads all of them); "layer_loads": ranks x layers
    return {"ok": not problems and all(rep.ok for rep in reports), "ranks": len(reports),
            "layers": max((len(rep.layers) for rep in reports), default=0),
            "layer_loads": sum(len(rep.layers) for rep in reports), "problems": problems}


def _print_verify(rep, reload: dict | None, against: dict | None = None) -> None:
    for w in rep.warnings:
        click.echo(f"warning: {w}", err=True)
    if against is not None:
        from .against import layer_lines

        click.echo(f"served layers ({against['backend']} backend, {against['tokens']} tokens) vs fp32 MoE from "
                   f"{against['source']} ({against['format']}"
                   + (f", quantized to {against['quantize']}" if against["quantize"] else "") + "):")
        for line in layer_lines(against["layers"]):
            click.echo(f"  {line}")
    if rep.ok:
        click.echo(f"ok: {rep.path}: format_version {rep.format_version}, row {rep.row}, ep_size {rep.ep_size}, "
                   f"{rep.layers} MoE layers; {rep.files_checked} files, {rep.tensors_checked} tensors, "
                   f"{format_bytes(rep.bytes_checked)} checked")
        if against is not None:
            click.echo(f"ok: all {len(against['layers'])} MoE layers match {against['source']} within their row's "
                       "threshold")
        if reload is not None:
            click.echo(f"ok: reload dry run of {reload['layers']} MoE layer(s) on each of {reload['ranks']} EP "
                       f"rank(s) ({reload['layer_loads']} layer loads): every parameter byte written exactly once")
        return
    click.echo(f"FAILED: {rep.path}: {rep.problem_count} problem(s)")
    for p in rep.problems:
        click.echo(f"  - {p}")
    if rep.unlisted:
        click.echo(f"  ... and {rep.unlisted} more (the first {len(rep.problems)} are listed)")


# --------------------------------------------------------------------------- synth


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--format", "fmt", default="modelopt-nvfp4", show_default=True,
              help="Source format to write (any of megamoe_convert.testing.synth.FORMATS: modelopt-nvfp4, quark-mxfp4, "
                   "ct-mxfp8, bf16, deepseek-v4, ...; an unknown name lists them all).")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True, help="MoE layers.")
@click.option("--experts", type=click.IntRange(min=1), default=8, show_default=True,
              help="Routed experts per layer.")
@click.option("--hidden", type=click.IntRange(min=1), default=256, show_default=True,
              help="Hidden size (a multiple of 128 for every row).")
@click.option("--intermediate", type=click.IntRange(min=1), default=256, show_default=True,
              help="Expert intermediate size (a multiple of 128 for every row).")
@click.option("--top-k", type=click.IntRange(min=1), default=2, show_default=True, help="Experts per token.")
@click.option("--shared", type=click.IntRange(min=0), default=0, show_default=True,
              help="Shared experts per layer (DeepSeek style, one MLP of width shared x intermediate).")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Split the source into shards of at most this size with an index, as hub exports are.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--json", "as_json", is_flag=True, help="Print what was built as JSON on stdout.")
def synth(out, fmt, layers, experts, hidden, intermediate, top_k, shared, max_shard_size, seed, as_json):
    """Build a synthetic source checkpoint in OUT, of any size, to try convert on.

    The weights are random (a pure function of the seed, layer and expert)
    and quantized with megamoe's reference quantizers into the format's own
    tensor names, dtypes and quantization config, so `inspect`, `convert`
    (its progress, an interrupted run and `--resume`), `verify` and the
    benchmarks run on it as on a producer's export. Building takes about as
    long as quantizing that many experts (2 cores: roughly 40 s for 300 MB);
    it needs about the source's size in memory.

    \b
    Examples:
      megamoe-convert synth ./src-small
      megamoe-convert synth ./src-4gb --layers 16 --experts 64 --hidden 2048 --intermediate 1024 --max-shard-size 1GB
      megamoe-convert synth ./src-r1ish --format modelopt-nvfp4 --layers 4 --experts 32 --shared 1
      megamoe-convert synth ./src-bf16 --format bf16 && megamoe-convert convert ./src-bf16 ./out --quantize mxfp8

    Exit codes: 0 built, 2 bad option (OUT not empty, unknown format, sizes), 3 internal error.
    """
    from ..testing import synth as synth_mod

    if fmt not in synth_mod.FORMATS:
        raise click.BadParameter(f"unknown synthetic format {fmt!r}; valid: {', '.join(synth_mod.FORMATS)}",
                                 param_hint="--format")
    try:
        max_bytes = parse_size(max_shard_size)
    except MegaMoEError as e:
        raise click.BadParameter(str(e), param_hint="--max-shard-size")
    if top_k > experts:
        raise click.BadParameter(f"--top-k {top_k} is more than --experts {experts}", param_hint="--top-k")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        _fail(f"{out} exists and is not an empty folder; synth writes a new checkpoint (pick another OUT)")
    try:
        synth_mod.check_sizes(fmt, out, num_layers=layers, hidden=hidden, intermediate=intermediate,
                              num_experts=experts, top_k=top_k, shared=shared)
    except MegaMoEError as e:
        _fail(str(e))
    click.echo(f"synth: building a {fmt} checkpoint ({layers} MoE layers x {experts} experts, hidden {hidden}, "
               f"intermediate {intermediate}) in {out} ...", err=True)
    t = time.perf_counter()

    def build():
        # built beside OUT and renamed at the end, as convert does: a failed or interrupted build leaves nothing
        import shutil

        tmp = out.parent / f".{out.name}.synth-tmp"
        if tmp.exists() or tmp.is_symlink():  # not made by this run: never removed by it
            raise MegaMoEError(f"{tmp} exists (left by an interrupted synth, or someone's): synth builds there; "
                               "remove it yourself, or pick another OUT")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        try:
            synth_mod.build_synthetic_checkpoint(
                tmp, fmt, num_layers=layers, hidden=hidden, intermediate=intermediate, num_experts=experts,
                top_k=top_k, shared=shared, seed=seed, max_shard_bytes=max_bytes)
            if out.exists():
                out.rmdir()  # empty (checked above)
            tmp.rename(out)
            return out
        except ValueError as e:  # sizes the format cannot encode
            raise MegaMoEError(f"synth: {e}") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    path = _run_guarded(build)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    size = sum((path / f).stat().st_size for f in files)
    result = {"ok": True, "exit_code": 0, "out": str(path.resolve()), "format": fmt, "layers": layers,
              "experts_per_layer": experts, "hidden": hidden, "intermediate": intermediate, "top_k": top_k,
              "shared": shared, "seed": seed, "files": len(files), "bytes": size,
              "seconds": round(time.perf_counter() - t, 3)}
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"built {result['out']}: {fmt}, {layers} MoE layers x {experts} experts, {len(files)} safetensors "
               f"file(s), {format_bytes(size)} in {result['seconds']:.1f} s")
    click.echo(f"next: megamoe-convert inspect {shlex.quote(str(out))} && "
               f"megamoe-convert convert {shlex.quote(str(out))} ./out" + (" --quantize mxfp8" if synth_mod.ROW_OF.get(fmt) == "bf16" else ""))


# --------------------------------------------------------------------------- demo


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--format", "fmt", default="modelopt-nvfp4", show_default=True,
              help="Synthetic source format to build: any format megamoe_convert.testing.synth supports (modelopt-nvfp4, "
                   "quark-mxfp4, ct-mxfp8, bf16, deepseek-v4, ...; an unknown name lists them all).")
@click.option("--keep", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Build in this folder and keep it (default: a temporary folder, removed afterwards). Run "
                   "again, it replaces what an earlier demo wrote there (its .megamoe-demo.json lists it) and "
                   "refuses to touch anything else.")
@click.option("--ep-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Convert into this many EP rank file sets (the check reads every rank's files).")
@click.option("--tokens", type=click.IntRange(min=1, max=4096), default=16, show_default=True,
              help="Tokens per layer in the forward comparison.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (only JSON).")
def demo(fmt, keep, ep_size, tokens, as_json):
    """End to end on a tiny synthetic checkpoint: build -> convert -> verify -> compare.

    
    The comparison, per MoE layer: the SERVED forward (megamoe_runtime's
    reference backend on the converted kernel-layout bytes, with the kernels'
    activation quantization and roundings) against an independent fp32 MoE
    computed from the SOURCE checkpoint (its experts read through the
    converter's readers and dequantized; no layout code shared). calc_diff
    (DeepGEMM's metric) must stay below the row's threshold (bf16 1e-4,
    mxfp8/mxfp4 2e-3, nvfp4 2e-2); a wrong layout lands far above.
    Needs no download and no GPU.

    
    Examples:
      megamoe-convert demo
      megamoe-convert demo --format quark-mxfp4 --ep-size 2
      megamoe-convert demo --format deepseek-v4 --tokens 64
      megamoe-convert demo --keep ./demo-out --json

    Exit codes: 0 every layer matches, 1 verify failed or a layer missed its
    threshold, 2 bad input or usage, 3 internal error.
    """
    from ..testing import synth

    if fmt not in synth.FORMATS:
        raise click.BadParameter(f"unknown synthetic format {fmt!r}; valid: {', '.join(synth.FORMATS)}",
                                 param_hint="--format")
    from .demo import prepare_keep, run_demo

    log = lambda m: click.echo(m, err=True)  # noqa: E731
    if keep is not None:
        result = _run_guarded(lambda: (prepare_keep(keep), run_demo(keep, fmt, ep_size, tokens, log))[1])
    else:
        with tempfile.TemporaryDirectory(prefix="megamoe-demo-") as d:
            result = _run_guarded(lambda: run_demo(Path(d), fmt, ep_size, tokens, log))
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        _print_demo(result, fmt, keep is not None)
    if not result["ok"]:
        sys.exit(_EXIT_VERIFY_FAILED)


def _print_demo(result: dict, fmt: str, kept: bool) -> None:
    s = result["convert"]
    where = result["src"] if kept else "a temporary folder (--keep DIR keeps the files)"
    click.echo(f"demo: built a synthetic {fmt} checkpoint ({result['layers']} MoE layers, "
               f"{result['experts_per_layer']} experts, hidden {result['hidden']}, "
               f"intermediate {result['intermediate']}) in {where}")
    click.echo(f"demo: converted to row {s['row']} in {s['seconds']:.2f} s: {format_bytes(s['bytes_in'])} in, "
               f"{format_bytes(s['bytes_out'])} out, {s['files']} files" + (f" -> {result['out']}" if kept else ""))
    v = result["verify"]
    click.echo(f"demo: verify {'ok' if v['ok'] else 'FAILED'}: {v['files_checked']} files, "
               f"{v['tensors_checked']} tensors checked")
    c = result["compare"]
    click.echo(f"demo: served forward ({c['backend']} backend on the converted bytes, {c['tokens']} tokens) vs "
               "fp32 MoE from the source checkpoint:")
    for r in c["layers"]:
        click.echo(f"demo:   layer {r['index']} ({r['prefix']}, row {r['row']}): calc_diff {r['calc_diff']:.2e} "
                   f"{'<' if r['ok'] else '>='} threshold {r['threshold']:.0e}  {'OK' if r['ok'] else 'FAIL'}")
    n_ok = sum(r["ok"] for r in c["layers"])
    g = result["generate"]
    if "skipped" in g:
        click.echo(f"demo: transformers step skipped: {g['skipped']}")
    else:
        where = g["out"] if kept else "a temporary folder"
        click.echo(f"demo: transformers: converted a tiny {g['model']} with random weights (a {g['source_dtype']} "
                   f"source, so row {g['row']}) into {where}")
        click.echo(f"demo: AutoModelForCausalLM.from_pretrained on it generated {g['tokens']}; transformers on "
                   f"the source: {g['reference_tokens']} {'(identical)' if g['ok'] else '(DIFFERENT)'}")
    if result["ok"]:
        click.echo(f"demo: ok: {n_ok}/{len(c['layers'])} layers match the source")
    else:
        click.echo(f"demo: FAILED: {n_ok}/{len(c['layers'])} layers match the source"
                   + ("" if v["ok"] else ", verify failed"))


from .warm import warm as warm_command  # noqa: E402  (`megamoe-convert warm`: the kernel cache)

main.add_command(warm_command)

if __name__ == "__main__":  # pragma: no cover
    main()
