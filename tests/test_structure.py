"""The package's shape: imports point down the layers of docs/ARCHITECTURE.md, never
up and never in a circle (function-level imports included); every module declares
``__all__`` or is private, and the docs name only public paths; nothing of
executorch stays patched after a read command returns."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import threading
import types

import ptdstream

PACKAGE = pathlib.Path(ptdstream.__file__).parent

#: Layers, low to high (docs/ARCHITECTURE.md). A module may import modules of its
#: own layer or lower ones. Longest prefix wins.
LAYERS = {
    # the ground
    "errors": 0, "defaults": 0, "reports": 0, "progress": 0, "timeline": 0, "system": 0,
    "upstream": 0,
    # the pipeline stages, in the order bytes travel (and back: the readers)
    "format": 1, "sources": 1,
    "store": 2,
    "write": 3,
    "manager": 4, "manifest": 4, "check": 4, "pack": 4,
    # the ways in, and the mechanisms they share inside upstream's export
    "save": 5, "weights": 5, "distributed": 5,
    "hooks": 6,
    "weightless": 7,
    "hf": 8, "cli": 8, "demo": 8, "__main__": 8, "_entry": 8,
    "": 9,  # ptdstream/__init__.py: the public API re-exports every layer
}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("").as_posix()
        if "_fb/" in rel + "/":
            continue
        name = rel.replace("/", ".")
        found[name[: -len(".__init__")] if name.endswith(".__init__") else ("" if name == "__init__" else name)] = path
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), -1, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(f"module ptdstream.{module} is in no layer: add it to LAYERS and ARCHITECTURE.md")


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (any scope)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                elif node.module and node.module.startswith("ptdstream"):
                    stem = node.module[len("ptdstream."):] if node.module != "ptdstream" else ""
                else:
                    continue
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module.
                targets = [f"{stem}.{a.name}".lstrip(".") if f"{stem}.{a.name}".lstrip(".") in modules else stem
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name[len("ptdstream."):] for a in node.names if a.name.startswith("ptdstream.")]
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                if target in modules and target != module and not (target == "" and module):
                    graph[module].add(target)
    return graph


def test_every_module_is_in_a_layer_and_imports_point_down():
    modules = _modules()
    upward = []
    for module, targets in _imports(modules).items():
        for target in targets:
            if _layer(target) > _layer(module):
                upward.append(f"ptdstream.{module} (layer {_layer(module)}) imports ptdstream.{target} "
                              f"(layer {_layer(target)})")
    assert upward == []


def test_no_import_cycles():
    graph = _imports(_modules())
    cycles = []
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert cycles == []


def _folder(module: str) -> str:
    """The package folder (or top-level module) a module belongs to: ``write.sink`` -> ``write``."""
    return module.split(".")[0]


def test_no_two_folders_import_each_other():
    """Folders as units (``hooks`` imports ``sources``, so nothing in ``sources`` may import
    ``hooks``), function-level imports counted; cycles of any length are reported."""
    graph: dict[str, set[str]] = {}
    for module, targets in _imports(_modules()).items():
        for target in targets:
            if target and module and _folder(target) != _folder(module):
                graph.setdefault(_folder(module), set()).add(_folder(target))
    cycles = []

    def reaches(start: str, goal: str) -> bool:
        stack, seen = [start], set()
        while stack:
            node = stack.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                stack.extend(graph.get(node, ()))
        return False

    for folder, targets in sorted(graph.items()):
        cycles += [f"{folder} <-> {t}" for t in sorted(targets) if folder < t and reaches(t, folder)]
    assert cycles == []


def test_the_folder_test_sees_a_folder_pair():
    """The folder graph is built from the same import walk: hooks -> sources, never back."""
    graph = _imports(_modules())
    assert any(_folder(t) == "sources" for m, ts in graph.items() if _folder(m) == "hooks" for t in ts)
    assert not any(_folder(t) == "hooks" for m, ts in graph.items() if _folder(m) == "sources" for t in ts)


def test_the_layer_test_sees_function_level_and_relative_imports():
    graph = _imports(_modules())
    assert "sources.cuda" in graph["sources"]  # a function-level relative import in as_source
    assert "format.identity" in graph["format.pte_reader"]
    assert "save" in graph["hooks.install"]


def _declared_all(path: pathlib.Path) -> list[str] | None:
    """The module's top-level ``__all__`` list, or None when it declares none."""
    for node in ast.parse(path.read_text(), str(path)).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None:
            return list(ast.literal_eval(node.value))
    return None


def _bound_names(path: pathlib.Path) -> set[str]:
    """Names bound at the module's top level (``if``/``try`` bodies included)."""
    names: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                for part in (node.body, node.orelse, getattr(node, "finalbody", [])):
                    visit(part)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text(), str(path)).body)
    return names


def _private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".") if part)


def test_every_module_declares_all_or_is_private():
    """Generated flatc code (``*_fb/``) is left out by ``_modules``."""
    missing = [f"ptdstream.{m}".rstrip(".") for m, path in sorted(_modules().items())
               if not _private(m) and _declared_all(path) is None]
    assert missing == []


def test_every_name_in_every_all_is_bound():
    """Checked on the source, so modules needing CUDA or the hf extra count too; the
    package root, whose names load lazily, is checked by import below."""
    modules = _modules()
    unbound = []
    for module, path in sorted(modules.items()):
        names = _declared_all(path)
        if not module or names is None:
            continue
        submodules = {m.rpartition(".")[2] for m in modules if m.rpartition(".")[0] == module}
        unbound += [f"ptdstream.{module}.{n}" for n in names if n not in _bound_names(path) | submodules]
    assert unbound == []


def test_every_module_assigns_all_once():
    """A second ``__all__ = [...]`` silently replaces the first (a merge left one in ``sources.base``)."""
    twice = []
    for module, path in sorted(_modules().items()):
        tree = ast.parse(path.read_text(), str(path))
        count = sum(1 for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                    and any(isinstance(t, ast.Name) and t.id == "__all__"
                            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])))
        if count > 1:
            twice.append(f"ptdstream.{module}".rstrip("."))
    assert twice == []


def _exception_classes(extra: dict[str, str] | None = None) -> dict[str, list[str]]:
    """``{module: [class, ...]}``: every class the package (and ``extra``, ``{module:
    source}``) defines whose bases name an exception (``*Error``, ``Exception``,
    ``BaseException`` or another such class of the package)."""
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in _modules().items()}
    trees.update({m: ast.parse(source) for m, source in (extra or {}).items()})
    known = {"Exception", "BaseException", "KeyboardInterrupt"}
    found: dict[str, list[str]] = {}
    changed = True
    while changed:  # a subclass of a subclass, in any module
        changed = False
        for module, tree in trees.items():
            for node in ast.walk(tree):
                if not isinstance(node, ast.ClassDef) or node.name in found.get(module, []):
                    continue
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & known or any(b.endswith("Error") for b in bases):
                    found.setdefault(module, []).append(node.name)
                    known.add(node.name)
                    changed = True
    return found


def _error_module(module: str) -> bool:
    return module == "errors" or module.endswith(".errors")


def test_every_error_class_lives_in_an_errors_module():
    """``errors.py``, or a way in's (or stage's) own ``errors.py``: nowhere else. A private
    class (``_Refused``: control flow inside one module, caught there) is that module's own."""
    outside = [f"ptdstream.{m}.{c}" for m, classes in sorted(_exception_classes().items())
               if not _error_module(m) for c in classes if not c.startswith("_")]
    assert outside == []


def test_the_error_test_sees_a_class_outside_its_place():
    found = _exception_classes({"weights.planted": "class Odd(BindingError):\n    pass\n"})
    assert "PtdstreamError" in found["errors"] and "BindingError" in found["weightless.errors"]
    assert "RuleError" in found["check.runtime.errors"]  # an Exception subclass, not a PtdstreamError one
    assert found["weights.planted"] == ["Odd"]  # a subclass of a subclass, by name, outside its place
    assert not _error_module("weights.planted") and _error_module("weightless.errors")


def _base_names(node: ast.ClassDef) -> list[str]:
    """The last name of each base of a class: ``nn.Module`` -> ``Module``, ``Generic[T]`` -> ``Generic``."""
    names = []
    for base in node.bases:
        base = base.value if isinstance(base, ast.Subscript) else base
        names.append(base.id if isinstance(base, ast.Name) else getattr(base, "attr", ""))
    return names


def _undocumented(extra: dict[str, str] | None = None) -> list[str]:
    """``module.function`` or ``module.Class.method`` of every public function at a
    module's top level, and every public method of a public top-level class, that has no
    docstring, unless it overrides a documented method of a base class of the package
    (a ``Source``'s ``describe``, a ``Report``'s ``summary``: found by the base's name,
    through any number of classes; the base's contract is its own) or is the ``forward``
    of a torch module. ``extra``: ``{module: source}`` parsed as part of the package."""
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in _modules().items()}
    trees.update({m: ast.parse(source) for m, source in (extra or {}).items()})
    classes: dict[str, list[ast.ClassDef]] = {}
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)

    def inherited(cls: ast.ClassDef, name: str, seen: set[int]) -> bool:
        for base_name in _base_names(cls):
            if base_name == "Module" and name == "forward":
                return True
            for base in classes.get(base_name, []):
                if id(base) in seen:
                    continue
                seen.add(id(base))
                if any(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name
                       and ast.get_docstring(item) for item in base.body):
                    return True
                if inherited(base, name, seen):
                    return True
        return False

    missing = []
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for module, tree in sorted(trees.items()):
        for node in tree.body:
            if isinstance(node, functions) and not node.name.startswith("_") and not ast.get_docstring(node):
                missing.append(f"{module}.{node.name}")
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                missing += [f"{module}.{node.name}.{item.name}" for item in node.body
                            if isinstance(item, functions) and not item.name.startswith("_")
                            and not ast.get_docstring(item) and not inherited(node, item.name, {id(node)})]
    return missing


def test_every_public_function_has_a_docstring():
    """One line where the name does not say it all; an override of a documented method
    of a base class of the package inherits its contract (``_undocumented``)."""
    assert _undocumented() == []


def test_the_docstring_test_sees_a_planted_function():
    planted = ("import torch\n"
               "class Odd(MemorySource):\n"
               "    def describe(self):\n        return ''\n"  # Source.describe is documented
               "    def novel(self):\n        pass\n"
               "class Odder(Odd):\n"
               "    def pieces(self, ring):\n        pass\n"  # Source.pieces, two classes up
               "    def novel(self):\n        pass\n"  # Odd.novel has no docstring to inherit
               "class Net(torch.nn.Module):\n"
               "    def forward(self, x):\n        return x\n"
               "def loose():\n    pass\n"
               "def _private():\n    pass\n")
    found = [m for m in _undocumented({"weights.planted": planted}) if m.startswith("weights.planted.")]
    assert found == ["weights.planted.Odd.novel", "weights.planted.Odder.novel", "weights.planted.loose"]


def test_every_public_error_is_reachable_from_the_package_root():
    """Each ``PtdstreamError`` subclass of an errors module is ``ptdstream.<Name>`` (internal
    errors, which never reach users, derive from ``Exception`` alone)."""
    unreachable = []
    for module, classes in sorted(_exception_classes().items()):
        if not _error_module(module) or module.startswith(("cli.", "check.")):
            continue
        mod = importlib.import_module(f"ptdstream.{module}")
        for name in classes:
            cls = getattr(mod, name)
            if issubclass(cls, ptdstream.PtdstreamError) and getattr(ptdstream, name, None) is not cls:
                unreachable.append(f"ptdstream.{module}.{name}")
    assert unreachable == []


def test_the_package_root_names_resolve():
    missing = [name for name in ptdstream.__all__ if not hasattr(ptdstream, name)]
    assert missing == []
    assert len(set(ptdstream.__all__)) == len(ptdstream.__all__)


ROOT = PACKAGE.parent
_DOTTED = re.compile(r"(?<![\w/.])ptdstream(?:\.[A-Za-z_]\w*)+")
_FROM_IMPORT = re.compile(r"^[ \t]*from[ \t]+(ptdstream(?:\.\w+)*)[ \t]+import[ \t]+(\([^)]*\)|[\w \t,]+)", re.M)


def _doc_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.py"))]


def _named_paths() -> dict[str, list[str]]:
    """Every ``ptdstream.X`` the docs name -> where (``file:line``); ``from ptdstream.X
    import a, b`` names ``ptdstream.X.a`` and ``ptdstream.X.b``."""
    found: dict[str, list[str]] = {}
    for path in _doc_files():
        text = path.read_text()
        hits = [(m.start(), m.group(0)) for m in _DOTTED.finditer(text)]
        for m in _FROM_IMPORT.finditer(text):
            names = [n.split()[0] for n in m.group(2).strip("()").split(",") if n.strip()]
            hits += [(m.start(), f"{m.group(1)}.{n}") for n in names]
        for start, dotted in hits:
            line = text.count("\n", 0, start) + 1
            found.setdefault(dotted, []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


def _unresolved(dotted: str) -> str | None:
    """Why ``dotted`` is not a public path, or None: no segment private, each module
    on the way lists the next name in its ``__all__``, and the name exists."""
    obj: object = ptdstream
    where = "ptdstream"
    for part in dotted.split(".")[1:]:
        if part.startswith("_"):
            return f"{where}.{part} is private"
        if isinstance(obj, types.ModuleType):
            if part not in getattr(obj, "__all__", ()):
                return f"{where}.__all__ does not list {part!r}"
            try:
                obj = getattr(obj, part)
            except AttributeError:
                obj = importlib.import_module(f"{where}.{part}")
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            return f"{where} has no attribute {part!r}"
        where = f"{where}.{part}"
    return None


def test_the_docs_name_only_public_paths():
    paths = _named_paths()
    assert "ptdstream.save" in paths  # the scan sees README's paths
    bad = {dotted: (why, where) for dotted, where in sorted(paths.items()) if (why := _unresolved(dotted))}
    assert bad == {}


def test_the_path_check_refuses_private_unlisted_and_shadowed_paths():
    assert _unresolved("ptdstream.distributed.write_data_files") is None
    assert _unresolved("ptdstream.hf.export") is None
    assert _unresolved("ptdstream.write.journal.recover") == "ptdstream.__all__ does not list 'write'"
    assert _unresolved("ptdstream._entry.main") == "ptdstream._entry is private"
    # ``ptdstream.save`` is the function, not the module of that name.
    assert _unresolved("ptdstream.save.write_data_files") == "ptdstream.save has no attribute 'write_data_files'"


def _upstream_state():
    """Every class attribute and module global ptdstream may patch, by identity."""
    from ptdstream.upstream import adapter

    owners = [adapter.emitter_module(), adapter.emitter_class(), adapter.export_verifier_module(),
               adapter.manager_class()]
    return {(id(o), k): id(v) for o in owners for k, v in vars(o).items()}


def test_read_commands_leave_executorch_unpatched(tmp_path):
    from conftest import Mlp, export, reference_files

    from ptdstream.check.inspection import inspect_files
    from ptdstream.check.structure import check_structure

    files = reference_files(export(Mlp()), str(tmp_path))
    pte = str(tmp_path / "model.pte")
    assert "model.pte" in files
    before = _upstream_state()
    assert check_structure(pte).ok
    inspect_files([pte])
    assert _upstream_state() == before


def test_parses_are_thread_safe(tmp_path):
    """Parses run at once from several threads each get their own result."""
    from conftest import Mlp, TiedLM, export, reference_files

    from ptdstream.format.reader import read_artifact

    paths = []
    for i, model in enumerate((Mlp(), TiedLM())):
        reference_files(export(model), str(tmp_path / str(i)))
        paths.append(str(tmp_path / str(i) / "model.pte"))
    expected = [read_artifact(p) for p in paths]
    results, errors = {}, []

    def work(k):
        try:
            for _ in range(5):
                results.setdefault(k, []).append(read_artifact(paths[k % 2]))
        except BaseException as e:  # noqa: BLE001 - any failure in a thread is collected and asserted on
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for k, arts in results.items():
        assert [a.segments for a in arts] == [expected[k % 2].segments] * 5
