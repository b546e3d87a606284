"""The package's shape: imports point down the layers of docs/ARCHITECTURE.md, never
up and never in a circle (function-level imports included), and nothing of
executorch stays patched after a read command returns."""

from __future__ import annotations

import ast
import pathlib
import threading
from typing import Dict, Set

import pytest

import ptdstream

PACKAGE = pathlib.Path(ptdstream.__file__).parent

#: Layers, low to high (docs/ARCHITECTURE.md). A module may import modules of its
#: own layer or lower ones. Longest prefix wins.
LAYERS = {
    "errors": 0, "defaults": 0, "reports": 0, "progress": 0, "timeline": 0, "system": 0,
    "upstream": 0,
    "format": 1, "sources": 1,
    "store": 2,
    "write": 3,
    "manager": 4, "check": 4, "pack": 4,
    "save": 5, "weights": 5, "weights_xnnpack": 5, "distributed": 5,
    "hooks": 6,
    "cli": 7, "demo": 7, "__main__": 7, "_entry": 7,
    "": 8,  # ptdstream/__init__.py: the public API re-exports every layer
}


def _modules() -> Dict[str, pathlib.Path]:
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


def _imports(modules: Dict[str, pathlib.Path]) -> Dict[str, Set[str]]:
    """Module -> the package modules it imports (any scope)."""
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
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
    state: Dict[str, int] = {}

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
    graph: Dict[str, Set[str]] = {}
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
    assert "format.verifier" in graph["format.pte_reader"]
    assert "save" in graph["hooks.install"]


def _upstream_state():
    """Every class attribute and module global ptdstream may patch, by identity."""
    from ptdstream.upstream import adapter, untrusted

    owners = list(untrusted._generated_classes())
    owners += [adapter.emitter_module(), adapter.emitter_class(), adapter.export_verifier_module(),
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
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for k, arts in results.items():
        assert [a.segments for a in arts] == [expected[k % 2].segments] * 5
