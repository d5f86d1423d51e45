"""The import floors of the two packages (docs/ARCHITECTURE.md#floors): every module imports only its own
floor or the floors below it, nothing imports in a circle, and no module imports another module's private
name. Read from the source with ``ast``, lazy imports inside functions included (they run, just later),
and imports under ``if TYPE_CHECKING:`` too: they never run, but a module that must name another to be
read is tied to it all the same (the loaders declare the `LoadTarget` protocol they need instead of
annotating with the layer class that imports them).

The negative controls run the same check on the real sources with one planted import each: an upward
import, a circle and a private name must each be reported.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("megamoe_runtime", "megamoe_convert")

#: bottom first. A runtime module's floor is the first name under ``megamoe_runtime``; the package's own
#: ``__init__`` (the lazy public surface) sits above every floor, and the converter above the whole runtime.
FLOORS = (
    ("errors", "testing", "knobs"),
    ("files",),
    ("format",),
    ("backends",),
    ("layer",),
    ("load",),
    ("integrations",),
)
TOP = len(FLOORS)  # megamoe_runtime/__init__.py
#: the converter's floors, bottom first, all above the runtime: a converter module's floor is the first name
#: under ``megamoe_convert``; the package's ``__init__`` (the public API) and ``__main__`` sit above them all.
CONVERTER_FLOORS = (
    ("readers",),
    ("output",),
    ("pipeline",),
    ("testing",),
    ("cli",),
)
CONVERTER = TOP + 1
CONVERTER_TOP = CONVERTER + len(CONVERTER_FLOORS)
FLOOR_NAMES = {name: i for i, names in enumerate(FLOORS) for name in names}
CONVERTER_FLOOR_NAMES = {name: CONVERTER + i for i, names in enumerate(CONVERTER_FLOORS) for name in names}
#: a dotted module path written as a string (a backend registry entry, ``importlib.import_module``)
MODULE_STRING = re.compile(r"^(megamoe_runtime|megamoe_convert)(\.\w+)+(:\w+)?$")


def module_sources(root: Path = REPO) -> dict[str, tuple[str, bool]]:
    """dotted module name -> (source, is_package) for every module of both packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path.read_text(), is_pkg)
    return out


def floor_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] == "megamoe_convert":
        if parts == ["megamoe_convert"] or parts[1:] == ["__main__"]:
            return CONVERTER_TOP
        return CONVERTER_FLOOR_NAMES.get(parts[1])
    if parts == ["megamoe_runtime"]:
        return TOP
    return FLOOR_NAMES.get(parts[1])


def imports_of(module: str, source: str, is_pkg: bool, modules) -> tuple[list, list]:
    """([(target module, imported name or None, line)], [(alias bound to a module, line)]) of one module."""
    tree = ast.parse(source)
    package = module if is_pkg else module.rpartition(".")[0]
    edges, module_aliases = [], []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = package.split(".")[:len(package.split(".")) - (n.level - 1)]
                target = ".".join(base + ([n.module] if n.module else []))
            else:
                target = n.module or ""
            if target.split(".")[0] not in PACKAGES:
                continue
            for a in n.names:
                sub = f"{target}.{a.name}"
                if sub in modules:
                    edges.append((sub, None, n.lineno))
                    module_aliases.append((a.asname or a.name, n.lineno))
                else:
                    edges.append((target, a.name, n.lineno))
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] in PACKAGES:
                    edges.append((a.name, None, n.lineno))
                    if a.asname:
                        module_aliases.append((a.asname, n.lineno))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and MODULE_STRING.match(n.value):
            target = n.value.split(":")[0]
            while target not in modules and "." in target:  # "pkg.mod.attr" names an attribute of pkg.mod
                target = target.rpartition(".")[0]
            edges.append((target, None, n.lineno))
    return edges, module_aliases


def floor_problems(modules: dict[str, tuple[str, bool]]) -> list[str]:
    """Every upward import, circle and cross-module private name, one line each."""
    problems = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, (src, is_pkg) in modules.items():
        mine = floor_of(mod)
        if mine is None:
            problems.append(f"{mod}: not on a floor (add its package to FLOORS and docs/ARCHITECTURE.md#floors)")
            continue
        edges, aliases = imports_of(mod, src, is_pkg, modules)
        package = mod if is_pkg else mod.rpartition(".")[0]
        for target, name, line in edges:
            if target not in modules:
                problems.append(f"{mod}:{line}: imports {target}, which is no module of the repository")
                continue
            if target != mod:
                graph[mod].add(target)
            theirs = floor_of(target)
            if theirs is not None and theirs > mine:
                problems.append(f"{mod}:{line}: imports {target}{'.' + name if name else ''} from a floor above "
                                f"its own ({_floor_label(theirs)} above {_floor_label(mine)})")
            if name is not None and name.startswith("_") and not name.startswith("__"):
                problems.append(f"{mod}:{line}: imports the private name {name} of {target}")
            leaf = target.rpartition(".")[2]
            if name is None and leaf.startswith("_") and not leaf.startswith("__") \
                    and target.rpartition(".")[0] != package:
                problems.append(f"{mod}:{line}: imports the private module {target} from outside its package")
        bound = {a for a, _ in aliases}
        for n in ast.walk(ast.parse(src)):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in bound \
                    and n.attr.startswith("_") and not n.attr.startswith("__"):
                problems.append(f"{mod}:{n.lineno}: uses the private name {n.value.id}.{n.attr}")
    problems += [f"import circle: {' -> '.join(c + [c[0]])}" for c in _circles(graph)]
    return problems


def _floor_label(i: int) -> str:
    if i < TOP:
        return "/".join(FLOORS[i])
    if i == TOP:
        return "megamoe_runtime/__init__"
    if i < CONVERTER_TOP:
        return "megamoe_convert." + "/".join(CONVERTER_FLOORS[i - CONVERTER])
    return "megamoe_convert/__init__"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as one cycle's members."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_import_goes_down_with_no_circle_and_no_private_name():
    assert floor_problems(module_sources()) == []


def test_every_floor_package_says_what_it_owns_and_may_import():
    for pkg, floors in (("megamoe_runtime", FLOORS), ("megamoe_convert", CONVERTER_FLOORS)):
        for names in floors:
            for name in names:
                path = REPO / pkg / name
                if path.is_dir():
                    doc = ast.get_docstring(ast.parse((path / "__init__.py").read_text())) or ""
                    assert "May import" in doc, f"{pkg}/{name}/__init__.py: say what it may import"


def test_every_converter_module_is_in_a_floor_package():
    """The converter keeps no module beside its floors: only the public API and ``python -m`` sit at the top."""
    top = sorted(p.name for p in (REPO / "megamoe_convert").glob("*.py"))
    assert top == ["__init__.py", "__main__.py"], top
    for names in CONVERTER_FLOORS:
        for name in names:
            assert (REPO / "megamoe_convert" / name / "__init__.py").is_file(), name


def _planted(module: str, line: str, *, lazy: bool = True) -> dict[str, tuple[str, bool]]:
    mods = module_sources()
    src, is_pkg = mods[module]
    if lazy:  # inside a function: the check must see imports that run late, too
        line = "\n\ndef _planted():\n    " + line + "\n"
    mods[module] = (src + "\n" + line + "\n", is_pkg)
    return mods


@pytest.mark.parametrize("module,line,expected", [
    # upward: the format contract reaching for the checkpoint opener, lazily
    ("megamoe_runtime.format.layout", "from ..load.checkpoint import Checkpoint",
     "megamoe_runtime.format.layout:.*imports megamoe_runtime.load.checkpoint.Checkpoint from a floor above "
     r"its own \(load above format\)"),
    # upward: a backend importing the layer it is handed
    ("megamoe_runtime.backends.reference", "from megamoe_runtime.layer.experts import DeepGemmMegaMoEExperts",
     "imports megamoe_runtime.layer.experts.DeepGemmMegaMoEExperts from a floor above its own"),
    # the runtime importing the converter
    ("megamoe_runtime.files.folder", "import megamoe_convert.cli.main", r"megamoe_convert\.cli above files"),
    # the converter's floors: the output transaction reaching up to the pipeline that drives it
    ("megamoe_convert.output.temp_folder", "from ..pipeline.plan import LayerPlan",
     r"megamoe_convert.output.temp_folder:.*imports megamoe_convert.pipeline.plan.LayerPlan from a floor above "
     r"its own \(megamoe_convert.pipeline above megamoe_convert.output\)"),
    # a reader reaching up to the output floor
    ("megamoe_convert.readers.base", "from ..output.shard_writer import plan_shards",
     r"imports megamoe_convert.output.shard_writer.plan_shards from a floor above its own"),
    # the pipeline importing the command line (its progress display)
    ("megamoe_convert.pipeline.stream", "from ..cli.progress import ProgressDisplay",
     r"megamoe_convert.cli above megamoe_convert.pipeline"),
    # test support is no dependency of the pipeline
    ("megamoe_convert.pipeline.convert", "from ..testing import synth",
     r"megamoe_convert.testing above megamoe_convert.pipeline"),
    # a floor module importing the package's public API, which imports the floors
    ("megamoe_convert.cli.main", "import megamoe_convert",
     r"megamoe_convert.cli.main:.*imports megamoe_convert from a floor above its own"),
    # a circle inside the pipeline: the plan calling back into the run that executes it
    ("megamoe_convert.pipeline.plan", "from .run import run_conversion",
     "import circle: .*megamoe_convert.pipeline.plan -> megamoe_convert.pipeline.run"),
    # a circle on one floor: the loaders calling back into the layer module (the old layer <-> loaders knot)
    ("megamoe_runtime.layer.loaders", "from .experts import DeepGemmMegaMoEExperts",
     "import circle: megamoe_runtime.layer.experts -> megamoe_runtime.layer.loaders"),
    # the old triton knot: mma8 taking moe's names again
    ("megamoe_runtime.backends.triton.mma8", "from .moe import moe_forward",
     "import circle: .*megamoe_runtime.backends.triton.mma8 -> megamoe_runtime.backends.triton.moe"),
    # a private name across modules (the old temp_folder -> output_dir._fsync_dir)
    ("megamoe_convert.output.temp_folder", "from .output_dir import _fsync_dir",
     "megamoe_convert.output.temp_folder:.*imports the private name _fsync_dir of megamoe_convert.output.output_dir"),
    # the same through a module alias
    ("megamoe_runtime.backends.triton.mma8", "from . import l1\n    l1._requant", "uses the private name l1._requant"),
    # a registry string is an import too
    ("megamoe_runtime.format.roles", "_X = 'megamoe_runtime.load.reload:verify_reload'",
     "imports megamoe_runtime.load.reload from a floor above its own"),
])
def test_negative_controls_are_reported(module, line, expected):
    problems = floor_problems(_planted(module, line))
    assert any(re.search(expected, p) for p in problems), problems


def test_typing_only_imports_close_a_circle_too():
    """The old knot in its last form: the loaders annotating the layer they are handed with the class of
    the module that imports them. It never runs, and it is still a circle."""
    mods = _planted("megamoe_runtime.layer.loaders",
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .experts import DeepGemmMegaMoEExperts\n",
                    lazy=False)
    assert "import circle: megamoe_runtime.layer.experts -> megamoe_runtime.layer.loaders -> " \
           "megamoe_runtime.layer.experts" in floor_problems(mods)


@pytest.mark.parametrize("module", ["megamoe_runtime.newfloor.thing", "megamoe_convert.loose"])
def test_a_module_off_the_floors_is_reported(module):
    mods = module_sources()
    mods[module] = ("X = 1\n", False)
    assert any(f"{module}: not on a floor" in p for p in floor_problems(mods))
