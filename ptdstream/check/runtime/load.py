"""Judge a .pte (and its .ptd files) by the runtime's load rules, without the runtime.

:func:`runtime_load_checks` applies :mod:`ptdstream.check.runtime.rules` (program load)
and :mod:`ptdstream.check.runtime.method` (each method's load) to files the reader
(:func:`ptdstream.format.reader.read_artifact`) already parsed, and returns one result per
stage: ``("runtime: program load", ok, detail)`` then ``("runtime: method 'name'", ok,
detail)`` for each method, then ``("loader", ok, detail)``: whether the loader the user
has (:data:`LOADERS`) can give the methods every key they look up. A failed detail names
the rule's upstream function.

The loaders (executorch 1.5.1):

* ``runtime``: ``executorch.runtime``'s ``Runtime.load_program(pte, data_path=ptd)``
  (``extension/pybindings/pybindings.cpp``: one ``FlatTensorDataMap``), one data file
  at most: a program whose keys are spread over several .ptd files fails
  ``load_method`` with any one of them (``Method::parse_external_constants``:
  ``Failed to get metadata for key``), so the check fails naming the keys each file
  lacks;
* ``module``: the C++ ``Module(pte, data_files)`` (``extension/module/module.cpp``),
  which merges the .ptd files (``extension/named_data_map/merged_data_map.h``:
  ``MergedDataMap``, keys unique across them): the methods load from several files.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from ...format.fb_roots import flat_tensor_root, program_root
from ...format.reader import Artifact
from ...system.files import open_input
from .errors import RuleError
from .method import check_method
from .rules import HEAD_NBYTES, ProgramFile, PtdMap, check_program, default_planned_limit

__all__ = ["LOADERS", "program_needs", "runtime_load_checks"]

#: What :func:`runtime_load_checks` answers for, and how a report names each.
LOADERS = {"runtime": "executorch.runtime (load_program, one data file)",
           "module": "C++ Module (several data files, merged)"}


def _read(path: str, nbytes: int) -> bytes:
    with open_input(path) as f:
        return f.read(nbytes)


def runtime_load_checks(pte_path: str, pte_art: Artifact, ptds: Sequence[tuple[str, Artifact]] = (),
                        operators: Set[str] | None = None, backends: Set[str] | None = None,
                        max_planned_nbytes: int | None = None,
                        loader: str = "runtime") -> list[tuple[str, bool, str]]:
    """Results of the runtime's program and method load rules, then (when every method
    loads with the .ptd files merged) of ``loader`` (a key of :data:`LOADERS`): the
    keys the methods look up are in one data file, or the loader takes several.

    Args:
        pte_path, pte_art: the .pte and its :class:`~ptdstream.format.reader.Artifact`.
        ptds: (path, Artifact) of each .ptd given (kind "ptd" only).
        operators, backends: the runtime's registered operator names / backend ids, or
            None to leave registration unchecked (said in the detail).
        max_planned_nbytes: bytes the planned buffers may take in all (default: physical
            memory, :func:`default_planned_limit`).
        loader: ``"runtime"`` (executorch.runtime: one data file) or ``"module"``
            (the C++ Module: several).

    Raises:
        OSError: a file cannot be read.
    """
    limit = default_planned_limit() if max_planned_nbytes is None else max_planned_nbytes
    out: list[tuple[str, bool, str]] = []
    pte = ProgramFile(pte_path, program_root(_read(pte_path, pte_art.flatbuffer_end)),
                      pte_art.segment_base_offset if pte_art.header is not None else 0, pte_art.file_nbytes)
    maps = []
    for path, art in ptds:
        if art.file_nbytes < HEAD_NBYTES:
            out.append(("runtime: program load", False, f"{path}: {art.file_nbytes} bytes; the runtime loads "
                        f"the first {HEAD_NBYTES} [FlatTensorDataMap::load]"))
            return out
        maps.append(PtdMap(path, flat_tensor_root(_read(path, art.flatbuffer_end)), art.segment_base_offset,
                           art.segment_data_nbytes, art.file_nbytes))
    try:
        meta = check_program(pte, limit)
    except RuleError as e:
        return out + [("runtime: program load", False, str(e))]
    unchecked = [what for what, given in (("operators", operators), ("backends", backends)) if given is None]
    note = f" (registered {' and '.join(unchecked)} not checked)" if unchecked else ""
    out.append(("runtime: program load", True, f"{len(meta['methods'])} methods; planned buffers "
                f"{sum(meta['planned']):,} bytes"))
    for name, index in meta["methods"].items():
        try:
            check_method(pte, index, name, maps, meta["planned"], operators, backends)
        except RuleError as e:
            out.append((f"runtime: method {name!r}", False, str(e)))
            return out
        out.append((f"runtime: method {name!r}", True, "loads" + note))
    out.append(_loader_check(loader, maps))
    return out


def _keys(keys: Sequence[bytes], limit: int = 5) -> str:
    listed = ", ".join(repr(k.decode("utf-8", "replace")) for k in keys[:limit])
    return listed + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _loader_check(loader: str, maps: Sequence[PtdMap]) -> tuple[str, bool, str]:
    """``("loader", ok, detail)``: the data files the methods' lookups found keys in
    (``PtdMap.found``), under ``loader``."""
    used = [m for m in maps if m.found]
    idle = [m.path for m in maps if not m.found]
    spare = f"; not needed: {', '.join(idle)}" if idle else ""
    if len(used) > 1 and loader == "runtime":
        lacks = "; ".join(f"with {m.path} alone, {_keys([k for o in used if o is not m for k in o.found])} "
                          "missing" for m in used)
        return ("loader", False, f"{LOADERS[loader]}: the methods need keys from {len(used)} .ptd files, "
                f"load_program takes one data_path: {lacks} (load_method fails with any one of them); a loader "
                "taking several data files loads it (C++ Module with data_files: verify --loader module)")
    if len(used) > 1:
        return ("loader", True, f"{LOADERS[loader]}: needs a loader taking several data files: "
                f"{', '.join(m.path for m in used)} (executorch.runtime's load_program takes one){spare}")
    data = f"data file {used[0].path}" if used else "no data file needed"
    return ("loader", True, f"{LOADERS[loader]}: {data}{spare}")


def program_needs(pte_path: str, pte_art: Artifact) -> tuple[list[str], list[str]]:
    """What a program needs the runtime to have registered, each name once, in the
    order first met: the operator names (``name.overload``) its methods' KernelCalls
    call (what ``Method::init`` resolves) and its delegates' backend ids (what
    ``BackendDelegate::Init`` looks up). For a program whose
    :func:`runtime_load_checks` passed (its indices are checked there).

    Raises:
        OSError: the file cannot be read.
    """
    from ...format.program_fb.InstructionArguments import InstructionArguments as IA
    from ...format.program_fb.KernelCall import KernelCall

    root = program_root(_read(pte_path, pte_art.flatbuffer_end))
    operators: dict[str, None] = {}
    backends: dict[str, None] = {}
    for p in range(root.ExecutionPlanLength()):
        plan = root.ExecutionPlan(p)
        for i in range(plan.DelegatesLength()):
            backends[plan.Delegates(i).Id().split(b"\0", 1)[0].decode("utf-8", "surrogateescape")] = None
        for c in range(plan.ChainsLength()):
            chain = plan.Chains(c)
            for i in range(chain.InstructionsLength()):
                ins = chain.Instructions(i)
                if ins.InstrArgsType() != IA.KernelCall:
                    continue
                call = KernelCall()
                call.Init(ins.InstrArgs().Bytes, ins.InstrArgs().Pos)
                op = plan.Operators(call.OpIndex())
                name = op.Name().split(b"\0", 1)[0]
                raw = op.Overload()
                full = name + (b"." + raw.split(b"\0", 1)[0] if raw is not None and len(raw) > 0 else b"")
                operators[full.decode("utf-8", "surrogateescape")] = None  # as Method::resolve_operator spells it
    return list(operators), list(backends)
