#!/usr/bin/env python
"""What the start-up hook (site-packages/megamoe-autoregister.pth) costs: at every interpreter start, and
once when transformers loads its models.

    python bench/startup_hook.py --python /path/to/venv/bin/python --rounds 30

``--python`` is an interpreter with megamoe installed (``pip install .`` or ``pip install -e .``: both put the
.pth into its site-packages). Three figures, medians over the rounds (each round is a fresh process):

* the hook at start-up: ``-X importtime``'s cumulative microseconds of the modules the .pth line imports
  (`megamoe_runtime`, `megamoe_runtime.integrations`, `megamoe_runtime.integrations.autoregister`);
* ``python -c pass`` wall time, as context for the first figure;
* the registration's price in a process that imports transformers' models: the import of megamoe's
  transformers integration timed inside a process that has imported ``transformers.modeling_utils``
  (with ``MEGAMOE_AUTOREGISTER=0``, so the hook leaves it to the timed import), once as it runs and once
  with the garbage collector off: after transformers has loaded, a full collection of its millions of
  objects tends to fall inside whatever allocates next, and that pass would run a little later anyway.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HOOK_MODULES = ("megamoe_runtime", "megamoe_runtime.integrations", "megamoe_runtime.integrations.autoregister")


def _importtime(python: str) -> tuple[float, list[str]]:
    """Cumulative µs of the hook's own modules in one fresh ``-c pass``, and every module they pulled in."""
    err = subprocess.run([python, "-X", "importtime", "-c", "pass"], capture_output=True, text=True,
                         check=True).stderr
    rows = []  # (name, cumulative µs, indent): importtime lists a module's imports before it, indented deeper
    for line in err.splitlines():
        parts = line.split("|")
        if not line.startswith("import time:") or len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        name = parts[2].rstrip()
        rows.append((name.strip(), int(parts[1]), len(name) - len(name.lstrip())))
    top = next((r for r in rows if r[0] == HOOK_MODULES[-1]), None)
    if top is None:
        raise SystemExit(f"{python}: the hook did not run at start-up (is megamoe installed there, with the .pth?)")
    # the modules importtime lists before the hook's line at deeper indentation are what it pulled in
    i = rows.index(top)
    pulled = []
    for name, _, indent in reversed(rows[:i]):
        if indent <= top[2]:
            break
        pulled.append(name)
    return float(top[1]), sorted(pulled)


def _wall(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="an interpreter with megamoe installed")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGAMOE_AUTOREGISTER")}
    hook_us, pulled = [], []
    for _ in range(args.rounds):
        us, pulled = _importtime(args.python)
        hook_us.append(us)
    print(f"# {args.python}; medians of {args.rounds} fresh processes")
    print(f"hook at start-up (-X importtime, cumulative): {statistics.median(hook_us) / 1000:.2f} ms "
          f"(min {min(hook_us) / 1000:.2f}); modules it imported: {', '.join(pulled) or 'none besides its own'}")
    pas = [_wall([args.python, "-c", "pass"], env) for _ in range(args.rounds)]
    print(f"python -c pass: {statistics.median(pas) * 1000:.1f} ms wall (context)")
    rounds = max(3, args.rounds // 5)
    for gc_off in (False, True):
        ms = [_registration_ms(args.python, env, gc_off) for _ in range(rounds)]
        print(f"registration at transformers' import ({rounds} rounds, {'gc off' if gc_off else 'as it runs'}): "
              f"{statistics.median(ms):.0f} ms (min {min(ms):.0f})")


def _registration_ms(python: str, env: dict, gc_off: bool) -> float:
    code = ("import gc, time, transformers.modeling_utils\n"
            + ("gc.disable()\n" if gc_off else "")
            + "t = time.perf_counter(); import megamoe_runtime.integrations.transformers\n"
            "print((time.perf_counter() - t) * 1000)")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "MEGAMOE_AUTOREGISTER": "0"}).stdout
    return float(out.split()[-1])

if __name__ == "__main__":
    main()
