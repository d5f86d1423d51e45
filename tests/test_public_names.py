"""A module-level public name is one some other file uses: another module of the two packages, a test, a
bench script, an example, a CI job, a tool or a docs page. A name that only its own module uses is private
(``_name``), so a reader sees at once what a module offers and what is its own business.

What counts as a use, read from the source with ``ast`` (and from the text of the non-Python files):
``from M import name``, ``M.name`` through a module bound by an import, ``getattr`` / ``monkeypatch.setattr``
on such a module with the name as a string, a dotted string ``"megamoe_runtime.M:name"`` or
``"megamoe_runtime.M.name"`` (registries, entry points, patch targets), ``from M import *``, and all of these
in Python code a string holds (a test's ``python -c`` subprocess); in the docs, pyproject.toml and the CI
scripts: ``from M import name``, a dotted path, ``leaf.name`` (``layout.expert_tiles``) or the bare name when it
reads as an identifier (has an underscore, capitals after the first letter, or is all capitals). The contracts external code calls are uses too: the public API (``megamoe_runtime.__all__``, the
lazy API of ``megamoe_convert``), the entry points in pyproject.toml, and what a package ``__init__`` lists in
its ``__all__``.

Run as a script to list the names (``python tests/test_public_names.py``).
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("megamoe_runtime", "megamoe_convert")
#: where uses are looked for besides the packages
USERS = ("tests", "bench", "examples", ".ci", "tools", "docs")
USER_FILES = ("README.md", "BENCHMARKS.md", "pyproject.toml")
TEXT_SUFFIXES = {".md", ".toml", ".sh", ".txt", ".cfg", ".yaml", ".yml", ""}
_DOTTED = re.compile(r"\b((?:megamoe_runtime|megamoe_convert)(?:\.\w+)*)(?::(\w+))?")
_FROM_IMPORT = re.compile(r"from\s+((?:megamoe_runtime|megamoe_convert)[\w.]*)\s+import\s+\(?([\w\s,]+)")
_IDENTIFIER_LIKE = re.compile(r"^(?:\w*_\w*|[A-Za-z]\w*[A-Z]\w*|[A-Z][A-Z0-9_]+)$")

def module_files(root: Path = REPO) -> dict[str, Path]:
    """dotted module name -> its file, for every module of both packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _top_level(body):
    """The module's own statements, those under a top-level ``if`` / ``try`` too."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level(part)
        else:
            yield node


def _targets(node):
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)


def defined_names(source: str) -> dict[str, int]:
    """name -> line of every public function, class and constant the module defines at its top level."""
    out: dict[str, int] = {}
    for node in _top_level(ast.parse(source).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [n for t in node.targets for n in _targets(t)]
        elif isinstance(node, ast.AnnAssign):
            names = list(_targets(node.target))
        else:
            continue
        for name in names:
            if not name.startswith("_"):
                out.setdefault(name, node.lineno)
    return out


def _all_of(source: str) -> list[str]:
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                return []
    return []


def _resolve_string(text: str, modules) -> list[tuple[str, str]]:
    """(module, name) for every dotted ``megamoe_*`` path in ``text``."""
    out = []
    for m in _DOTTED.finditer(text):
        path, attr = m.group(1), m.group(2)
        if attr:
            out.append((path, attr))
            continue
        parts = path.split(".")
        for i in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:i]) in modules:
                out.append((".".join(parts[:i]), parts[i]))
                break
    return out


def _code_string_uses(node, modules) -> set[tuple[str, str]]:
    """The uses in Python code a string holds (``python -c CODE`` in a subprocess), an f-string's fields read
    as ``0``; nothing when the string is no such code."""
    if isinstance(node, ast.JoinedStr):
        text = "".join(v.value if isinstance(v, ast.Constant) else "0" for v in node.values)
    elif isinstance(node.value, str):
        text = node.value
    else:
        return set()
    if "import" not in text or not any(pkg in text for pkg in PACKAGES):
        return set()
    try:
        return python_uses(text, None, False, modules)
    except SyntaxError:
        return set()


def python_uses(source: str, module: str | None, is_pkg: bool, modules) -> set[tuple[str, str]]:
    """(module, name) for every name of a package module that this Python file uses."""
    tree = ast.parse(source)
    package = (module if is_pkg else module.rpartition(".")[0]) if module else ""
    bound: dict[str, str] = {}  # local name -> module it is bound to
    uses: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if not package:
                    continue
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in modules:
                continue
            for a in node.names:
                if a.name == "*":
                    uses.update((target, n) for n in defined_names(modules[target].read_text()))
                elif f"{target}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{target}.{a.name}"
                else:
                    uses.add((target, a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    if a.asname:
                        bound[a.asname] = a.name
                    else:
                        bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            uses.update(_resolve_string(node.value, modules))
        if isinstance(node, (ast.Constant, ast.JoinedStr)):
            uses |= _code_string_uses(node, modules)

    def module_of(expr) -> str | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            parent = module_of(expr.value)
            if parent and f"{parent}.{expr.attr}" in modules:
                return f"{parent}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parent = module_of(node.value)
            if parent and f"{parent}.{node.attr}" not in modules:
                uses.add((parent, node.attr))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:  # getattr(mod, "x"), monkeypatch.setattr(mod, "x", v)
            parent, name = module_of(node.args[0]), node.args[1]
            if parent and isinstance(name, ast.Constant) and isinstance(name.value, str):
                uses.add((parent, name.value))
    return uses


def text_uses(text: str, modules, defined: dict[str, dict[str, int]]) -> set[tuple[str, str]]:
    """(module, name) for every name of a package module that a docs page, a CI script or pyproject names."""
    uses = set(_resolve_string(text, modules))
    for m in _FROM_IMPORT.finditer(text):
        if m.group(1) in modules:
            uses.update((m.group(1), n.strip()) for n in m.group(2).split(",") if n.strip())
    words = set(re.findall(r"\w+", text))
    dotted = set(re.findall(r"(\w+)[.:](\w+)", text))
    for mod, names in defined.items():
        leaf = mod.rpartition(".")[2]
        for name in names:
            if (leaf, name) in dotted or (name in words and _IDENTIFIER_LIKE.match(name)):
                uses.add((mod, name))
    return uses


def _user_files(root: Path) -> list[Path]:
    files = [root / f for f in USER_FILES if (root / f).is_file()]
    for d in USERS:
        files += [p for p in sorted((root / d).rglob("*")) if p.is_file() and "__pycache__" not in p.parts
                  and (p.suffix == ".py" or p.suffix in TEXT_SUFFIXES)]
    return files


#: decorators that only wrap a function; any other decorator hands it to a registry (a reader) or the CLI (a command)
_WRAPPERS = {"dataclass", "contextmanager", "lru_cache", "cache", "wraps", "property", "staticmethod", "classmethod",
             "total_ordering", "runtime_checkable", "overload", "final"}


def _decorator_name(d) -> str:
    d = d.func if isinstance(d, ast.Call) else d
    return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")


def _annotation_names(node) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # "Row | str"
        return set(re.findall(r"\w+", node.value))
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {w for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
         for w in re.findall(r"\w+", n.value)}


def _signature_names(fn) -> set[str]:
    """The types a function's callers hand it or get back."""
    a = fn.args
    return _annotation_names(fn.returns).union(*(_annotation_names(x.annotation) for x in (
        *a.posonlyargs, *a.args, *a.kwonlyargs, *(v for v in (a.vararg, a.kwarg) if v))))


def exposed_names(source: str) -> set[str]:
    """Names a module's own public surface hands out, so callers may name them though no file does yet:
    exception classes (callers catch them by type), the types public functions take and return and public
    fields hold, and whatever a decorator registers (a reader, a CLI command)."""
    tree = ast.parse(source)
    out: set[str] = set()
    errors = {"Exception", "BaseException"}
    for node in _top_level(tree.body):
        if isinstance(node, ast.ClassDef) and any(
                (b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")) in errors
                or (b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")).endswith("Error")
                for b in node.bases):
            errors.add(node.name)
            out.add(node.name)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if any(_decorator_name(d) not in _WRAPPERS for d in node.decorator_list):
                out.add(node.name)
            if node.name.startswith("_"):
                continue
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):  # public fields (``x: T`` or ``self.x: T``) and method results
                    target = getattr(item, "target", None)
                    name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "_")
                    if isinstance(item, ast.AnnAssign) and not name.startswith("_"):
                        out |= _annotation_names(item.annotation)
                    elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                        out |= _signature_names(item)
            else:
                out |= _signature_names(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and not node.target.id.startswith("_"):  # a public table's rows
            out |= _annotation_names(node.annotation)
    return out


def contract_names(modules) -> set[tuple[str, str]]:
    """What external code calls by contract: the runtime's lazy exports and every package's ``__all__``."""
    out = set()
    init = modules["megamoe_runtime"].read_text()
    for node in ast.walk(ast.parse(init)):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            out.update((f"megamoe_runtime.{mod}", name) for name, mod in ast.literal_eval(node.value).items())
    for mod, path in modules.items():
        if path.name == "__init__.py":
            out.update((mod, name) for name in _all_of(path.read_text()))
        out.update((mod, name) for name in exposed_names(path.read_text()))
    return out


def unused_public_names(root: Path = REPO) -> dict[str, list[str]]:
    """repository-relative file -> the public names only that file uses, sorted."""
    modules = module_files(root)
    defined = {mod: defined_names(path.read_text()) for mod, path in modules.items()}
    used_by: dict[tuple[str, str], set[str]] = {}
    for mod, path in modules.items():
        for use in python_uses(path.read_text(), mod, path.name == "__init__.py", modules):
            used_by.setdefault(use, set()).add(mod)
    for path in _user_files(root):
        text = path.read_text(errors="replace")
        if path.suffix == ".py":
            try:
                found = python_uses(text, None, False, modules)
            except SyntaxError:  # a fixture written broken on purpose
                found = set()
        else:
            found = text_uses(text, modules, defined)
        for use in found:
            used_by.setdefault(use, set()).add(str(path.relative_to(root)))
    contracts = contract_names(modules)
    out: dict[str, list[str]] = {}
    for mod, names in defined.items():
        for name in names:
            if (mod, name) in contracts or used_by.get((mod, name), set()) - {mod}:
                continue
            out.setdefault(str(modules[mod].relative_to(root)), []).append(name)
    return {f: sorted(n) for f, n in sorted(out.items())}


def test_every_public_name_is_used_outside_its_module():
    found = unused_public_names()
    assert found == {}, f"public names only their own module uses: make them private (_name), or use them elsewhere: {found}"


def test_a_planted_unused_name_is_reported(tmp_path):
    """Negative control on a planted tree: a public helper is reported once the one docs page citing it and the
    one subprocess code calling it stop; the public API, a constant another module imports, the types the API
    takes and returns, an exception and a registered class are not."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "megamoe_runtime" / "__init__.py").write_text("_EXPORTS = {'open': 'a'}\n")
    (tmp_path / "megamoe_convert" / "__init__.py").write_text("")
    (tmp_path / "megamoe_runtime" / "a.py").write_text(
        "def open(x: 'Key') -> 'Handle': pass\ndef helper(): pass\nUSED = 1\nclass Handle: pass\nclass Key: pass\n"
        "class Refused(ValueError): pass\n@registry.add\nclass Registered: pass\n")
    (tmp_path / "megamoe_runtime" / "b.py").write_text("from .a import USED\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "PAGE" ".md").write_text("`a.helper` is cited here.\n")
    assert unused_public_names(tmp_path) == {}
    (tmp_path / "docs" / "PAGE" ".md").write_text("nothing cited\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        'n = 2\ncode = (f"import os; from megamoe_runtime import a; "\n        f"a.helper({n})")\n')
    assert unused_public_names(tmp_path) == {}
    (tmp_path / "tests" / "test_a.py").write_text('code = "helper(2) after the import"\n')  # not code reaching a
    assert unused_public_names(tmp_path) == {"megamoe_runtime/a.py": ["helper"]}


if __name__ == "__main__":
    found = unused_public_names()
    for f, names in found.items():
        print(f"{f}: {len(names)}: {' '.join(names)}")
    print("total", sum(len(n) for n in found.values()), file=sys.stderr)
