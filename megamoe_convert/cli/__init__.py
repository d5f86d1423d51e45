"""The command line: ``megamoe-convert`` and what it shows.

Owns the click commands (`main`: convert, inspect, verify, synth, demo, ...), the progress line on stderr
(`progress`), ``demo`` and the short generation it runs (`demo`, `demo_generate`), ``verify --against``
(`against`) and ``warm`` (`warm`). `main` imports no torch before a command runs (tests/convert/cli/test_cli.py).

The converter's top floor (docs/ARCHITECTURE.md#converter-floors). May import: the runtime, `readers`,
`output`, `pipeline`, `testing`, and its own modules (no circle). Never the package's `__init__`
(tests/test_import_floors.py).
"""
