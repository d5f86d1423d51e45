"""`megamoe-convert` with a planted crash, for tests that need a real killed process.

    python tests/convert/crashing_cli.py STEP N[:SECONDS] <megamoe-convert arguments...>

runs the CLI with ``convert(..., on_step=...)`` injected: at the N-th step
named STEP (``output_dir.STEP_*``: ``tensor``, ``synced``, ``complete``,
``old-moved``, ``new-moved``, ``cleaned``) the process ends with
``os._exit(CRASH_EXIT_CODE)``: no cleanup, no finally blocks, like ``kill -9``.
With ``:SECONDS`` it sleeps there that long instead and carries on (a run
that is still going while a test starts a second one or sends a signal).

``CRASHING_CLI_WRITE_DELAY=SECONDS`` slows the shard writer threads down
(each tensor piece they write sleeps that long first; the header, written by
the caller, is not slowed): a run whose writer threads are busy when a signal
comes, as on a slow disk.
"""
import os
import sys

CRASH_EXIT_CODE = 99


def main() -> None:
    import megamoe_convert.pipeline.convert as conv
    from megamoe_convert.cli.main import main as cli

    delay = float(os.environ.get("CRASHING_CLI_WRITE_DELAY", "0") or 0)
    if delay:
        import time

        from megamoe_convert.output import shard_writer

        def slowed(real):
            def write(*a, **k):
                time.sleep(delay)
                return real(*a, **k)
            return write

        shard_writer._Region.put = slowed(shard_writer._Region.put)

    step, spec = sys.argv[1], sys.argv[2]
    n, _, sleep = spec.partition(":")
    seen = [0]

    def on_step(name: str) -> None:
        if name == step:
            seen[0] += 1
            if seen[0] == int(n):
                if sleep:
                    import time

                    print(f"crashing_cli: pausing at {step} #{n}", file=sys.stderr, flush=True)
                    time.sleep(float(sleep))
                else:
                    os._exit(CRASH_EXIT_CODE)

    real = conv.convert
    conv.convert = lambda *a, **k: real(*a, on_step=on_step, **k)
    cli(sys.argv[3:], prog_name="megamoe-convert")


if __name__ == "__main__":
    main()
