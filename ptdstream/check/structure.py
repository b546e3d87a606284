"""Structure: the checks the runtime's loaders make, on a .pte and its .ptd files.

:func:`check_structure` reads each file's section map (:mod:`ptdstream.format.reader`,
which already refuses headers, bounds, constant offsets and segment references
that the runtime would refuse) and adds cross-file checks: every tensor the
program marks EXTERNAL is a key of a given .ptd with the same layout, and no key
is in two .ptd files. Then every check the runtime makes when it loads the program
and each method (:mod:`ptdstream.check.runtime.rules`). Nothing is written; only
metadata (and XNNPACK delegate blobs) is read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence, Set
from dataclasses import dataclass

from ..errors import FormatError
from ..format.artifact import TensorMeta
from ..format.identity import MAX_SUPPORTED_FLAT_TENSOR_VERSION, expected_identifier
from ..format.reader import Artifact, read_artifact
from ..reports import Report
from .runtime import registry as runtime_registry
from .runtime.kernels import backends_line, needs_line, operators_of, parse_libraries
from .runtime.load import LOADERS, program_needs, runtime_load_checks
from .runtime.rules import runtime_key

__all__ = ["StructureReport", "check_structure"]


@dataclass(frozen=True)
class Check:
    """One structural check: the file it concerns, its name, result and detail."""

    path: str
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class StructureReport(Report):
    """All checks :func:`check_structure` made; ``ok`` when every one passed."""

    pte_path: str
    ptd_paths: tuple[str, ...]
    checks: tuple[Check, ...]
    #: The shipped kernel libraries the program's operators are in (``check.runtime.kernels``), when checked.
    needs_kernels: tuple[str, ...] = ()
    #: The backends the program's delegates name (``XnnpackBackend``), when it loads.
    needs_backends: tuple[str, ...] = ()
    #: The loader the runtime checks answer for (``runtime`` or ``module``: ``check.runtime.load.LOADERS``).
    loader: str = "runtime"

    derived = ("ok",)

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return all(c.ok for c in self.checks)

    @property
    def problems(self) -> tuple[Check, ...]:
        """The checks that failed, in order."""
        return tuple(c for c in self.checks if not c.ok)

    def summary(self) -> str:
        """One line per check, then a verdict line."""
        lines = [f"{'ok  ' if c.ok else 'FAIL'} {c.path}: {c.name}: {c.detail}" for c in self.checks]
        n = len(self.problems)
        lines.append("OK: structure valid" if self.ok else f"INVALID: {n} check{'s' * (n != 1)} failed")
        return "\n".join(lines)


def _file_checks(path: str, art: Artifact, expected_kind: str) -> list[Check]:
    checks = [Check(path, "kind", art.kind == expected_kind,
                    f"{art.kind} (identifier {art.identifier}); expected {expected_kind}")]
    want = expected_identifier(art.kind).decode("ascii")
    checks.append(Check(path, "identifier", art.identifier == want, f"{art.identifier}, runtime expects {want}"))
    h = art.header
    if h is None:
        checks.append(Check(path, "header", True, "no extended header: raw program flatbuffer, no segment data"))
    else:
        checks.append(Check(path, "header", True, f"{h.MAGIC.decode()} length {h.length}"))
    checks.append(Check(path, "flatbuffer", True, f"parses ({art.flatbuffer_end:,} bytes with header)"))
    end = art.segment_base_offset + art.segment_data_nbytes
    checks.append(Check(path, "segments in bounds", True,
                        f"{len(art.segments)} segment{'' if len(art.segments) == 1 else 's'}; "
                        f"base {art.segment_base_offset:,} + data "
                        f"{art.segment_data_nbytes:,} = {end:,} <= file size {art.file_nbytes:,}"))
    if art.constant_segment_index is not None:
        seg = art.segments[art.constant_segment_index]
        checks.append(Check(path, "constant offsets", True,
                            f"{len(art.constant_offsets)} offset{'' if len(art.constant_offsets) == 1 else 's'} "
                            f"within segment {seg.index} ({seg.nbytes:,} bytes)"))
    checks.append(Check(path, "named keys", True, f"{len(art.named)} keys resolve to segments"))
    counts: dict[str, int] = {}
    for e in art.named:
        counts[e.key] = counts.get(e.key, 0) + 1
    dups = sorted(k for k, n in counts.items() if n > 1)
    checks.append(Check(path, "keys unique", not dups, f"duplicate keys: {_names(dups)}" if dups else "no key repeats"))
    if art.kind == "ptd":
        checks.append(Check(path, "version", art.version <= MAX_SUPPORTED_FLAT_TENSOR_VERSION,
                            f"FlatTensor version {art.version}, runtime supports <= "
                            f"{MAX_SUPPORTED_FLAT_TENSOR_VERSION}"))
    return checks


def _names(keys: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_structure(pte_path: str, ptd_paths: Sequence[str] = (), *,
                    operators: Set[str] | None = runtime_registry.OPERATORS,
                    backends: Set[str] | None = runtime_registry.BACKENDS,
                    max_planned_nbytes: int | None = None,
                    kernels: str | Sequence[str] | None = None, loader: str = "runtime") -> StructureReport:
    """Check a .pte and its .ptd files the way the runtime would load them.

    When every file check passes, the runtime's own load rules follow
    (:mod:`ptdstream.check.runtime.load`): what ``Program::load`` and ``Method::init``
    check, so an OK report means the ``loader`` loads the program and every
    method with these .ptd files: ``"runtime"`` (the default), ``executorch.runtime``'s
    ``load_program``, which takes one data file (a program whose keys are spread over
    several .ptd files fails the ``loader`` check, naming the keys each file lacks);
    ``"module"``, the C++ ``Module`` given several data files (its ``loader`` line says
    when it needs several). ``operators``/``backends`` are the operator names
    (``name.overload``) and backend ids the runtime has registered; the defaults are every
    kernel library shipped with the pinned executorch (:mod:`ptdstream.check.runtime.kernels`:
    portable, optimized, quantized, llm custom ops) and the backends of its Python runtime;
    None skips that check (a runtime built with other kernels). ``kernels`` (library ids,
    ``"portable,llm"`` or a sequence) replaces ``operators`` by those libraries' operators.
    When the operators are checked and the program loads, a ``needs kernels`` check names the
    libraries it needs (``needs kernels: portable, llm custom ops``; ``needs_kernels``).
    ``max_planned_nbytes`` caps the planned buffers the runtime allocates at load
    (default: physical memory).

    Per file: kind and identifier, header, flatbuffer parse, segments within the
    file, constant offsets within the constant segment, named keys resolving to
    segments and unique, .ptd version. Across files: every tensor the program
    marks EXTERNAL is a key of some .ptd (layouts equal where the .ptd records
    one), and no key is in two .ptd files. Keys that only a backend's blob
    references are checked by the runtime rules for XNNPACK blobs
    (:mod:`ptdstream.check.runtime.xnnpack_blob`); other backends' blobs are opaque.

    Raises:
        OSError: a file cannot be opened or read (an invalid file is a failed check).
        LayoutError: ``kernels`` names a library executorch does not ship (the message lists them).
        ValueError: ``loader`` is neither ``"runtime"`` nor ``"module"``.
    """
    if loader not in LOADERS:
        raise ValueError(f"loader {loader!r}: expected one of {', '.join(LOADERS)}")
    if kernels is not None:
        operators = operators_of(parse_libraries(kernels))
    pte_path = os.fspath(pte_path)
    ptd_paths = tuple(os.fspath(p) for p in ptd_paths)
    checks: list[Check] = []
    arts: dict[str, Artifact] = {}
    for path, kind in [(pte_path, "pte")] + [(p, "ptd") for p in ptd_paths]:
        try:
            arts[path] = read_artifact(path)
        except FormatError as e:
            checks.append(Check(path, "parse", False, str(e)))
            continue
        checks.extend(_file_checks(path, arts[path], kind))
    pte = arts.get(pte_path)
    ptds = [arts[p] for p in ptd_paths if p in arts and arts[p].kind == "ptd"]
    owners: dict[str, list[str]] = {}
    for art in ptds:
        for named in art.named:
            if art.path not in owners.setdefault(named.key, []):
                owners[named.key].append(art.path)
    if ptds and pte is not None and pte.kind == "pte":  # across files: under the program it loads with
        shared = sorted(k for k, paths in owners.items() if len(paths) > 1)
        checks.append(Check(pte_path, "keys unique across .ptd files", not shared,
                            f"in several files: {_names(shared)}" if shared else f"{len(owners)} keys"))
    if pte is not None and pte.kind == "pte":
        checks.extend(_external_checks(pte_path, pte, ptds, loader))
        if all(c.ok for c in checks):
            results = runtime_load_checks(pte_path, pte, [(a.path, a) for a in ptds], operators, backends,
                                          max_planned_nbytes, loader)
            checks.extend(Check(pte_path, name, ok, detail) for name, ok, detail in results)
            loads = all(ok for _, ok, _ in results)
            called, backend_ids = program_needs(pte_path, pte) if loads else ([], [])
            delegates = tuple(backend_ids)
            if delegates:  # the backends too, not only the kernels: an XNNPACK program needs XNNPACK
                checks.append(Check(pte_path, "needs backends", True, backends_line(delegates)))
            if operators is not None and loads:
                needed, line = needs_line(called)
                checks.append(Check(pte_path, "needs kernels", True, line))
                return StructureReport(pte_path, ptd_paths, tuple(checks), needed, delegates, loader)
            return StructureReport(pte_path, ptd_paths, tuple(checks), (), delegates, loader)
    return StructureReport(pte_path, ptd_paths, tuple(checks), loader=loader)


def _external_checks(pte_path: str, pte: Artifact, ptds: list[Artifact], loader: str) -> list[Check]:
    if not pte.external_tensors:
        return [Check(pte_path, "external data", True, "the program marks no tensor EXTERNAL (keys that only a backend "
                      "blob references are checked below for XNNPACK blobs)")]
    layouts: dict[str, tuple[str, TensorMeta | None]] = {}
    for art in ptds:
        for e in art.named:
            layouts.setdefault(e.key, (art.path, e.layout))
    key = {t.fqn: runtime_key(t.fqn) for t in pte.external_tensors}  # cut at a NUL, as the runtime reads it
    missing = [t.fqn for t in pte.external_tensors if key[t.fqn] not in layouts]
    given = "missing from the given .ptd files" if ptds else "no .ptd given; missing"
    checks = [Check(pte_path, "external data", not missing,
                    f"{given}: {_names(missing)}{_beside(pte_path, ptds, {key[f] for f in missing}, loader)}" if missing
                    else f"all {len(pte.external_tensors)} external tensors found")]
    wrong = [f"{t.fqn!r} program {t.layout} vs {layouts[key[t.fqn]][0]} {layouts[key[t.fqn]][1]}"
             for t in pte.external_tensors
             if key[t.fqn] in layouts and layouts[key[t.fqn]][1] is not None and layouts[key[t.fqn]][1] != t.layout]
    checks.append(Check(pte_path, "external layouts", not wrong,
                        "; ".join(wrong[:3]) if wrong else "layouts match where recorded"))
    return checks


#: The most .ptd files beside a program that :func:`_beside` reads (a folder of many models).
_SIBLINGS = 64


def _beside(pte_path: str, ptds: Sequence[Artifact], keys: Set[str], loader: str) -> str:
    """Where the missing ``keys`` are: the .ptd files in the program's folder, not
    given, that hold any of them (section maps only; at most :data:`_SIBLINGS` read),
    and the command with them: ``; out/model.ptd beside it holds them: ptdstream
    verify out/model.pte out/model.ptd`` (with ``--loader module`` when it names
    several .ptd files under the ``runtime`` loader, which takes one). Empty when no
    file there holds one."""
    import shlex

    folder = os.path.dirname(pte_path) or "."
    given = {os.path.realpath(a.path) for a in ptds}
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".ptd"))[:_SIBLINGS]
    except OSError:
        return ""
    found: list[str] = []
    held: set[str] = set()
    for name in names:
        path = os.path.join(os.path.dirname(pte_path), name)
        if os.path.realpath(path) in given:
            continue
        try:
            art = read_artifact(path)
        except (OSError, FormatError):
            continue
        mine = {e.key for e in art.named} & keys
        if mine:
            found.append(path)
            held |= mine
    if not found:
        return ""
    which = "them" if held == set(keys) else f"{len(held)} of them"
    verb = "holds" if len(found) == 1 else "hold"
    line = " ".join(shlex.quote(p) for p in [pte_path, *(a.path for a in ptds), *found])
    several = len(ptds) + len(found) > 1 and loader == "runtime"
    line += (" --loader module (the keys are in several .ptd files: executorch.runtime's load_program takes one)"
             if several else "")
    return f"; {', '.join(found)} beside it {verb} {which}: ptdstream verify {line}"
