"""The kernel libraries shipped with the pinned executorch, and which of them a program needs.

A runtime registers the operators of the kernel libraries linked into it or loaded
(:mod:`ptdstream.check.runtime.registry`, generated from the installed executorch by
``tools/gen_runtime_registry.py``): ``portable`` (the runtime's own operators and the
portable kernels), ``optimized`` (linked into executorch's Python runtime),
``quantized`` (``import executorch.kernels.quantized``) and ``llm`` (executorch's LLM
custom ops, ``llama::custom_sdpa``, ``llama::update_cache``...: ``import
executorch.extension.llm.custom_ops``, as every LLM runner does). No torch, no executorch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...errors import LayoutError
from .registry import BACKENDS, EXECUTORCH_VERSION, KERNEL_MODULES, KERNEL_OPERATORS

__all__ = ["LIBRARIES", "TITLES", "backends_line", "library_of", "loaded_by", "needs_line", "operators_of",
           "parse_libraries", "unregistered_hint"]

#: Library ids in the order verify names them (a cheaper library first).
LIBRARIES: tuple[str, ...] = tuple(KERNEL_OPERATORS)

#: How reports name each library.
TITLES = {"portable": "portable", "optimized": "optimized", "quantized": "quantized", "llm": "llm custom ops"}


def parse_libraries(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"portable,llm"`` (or a sequence of ids) -> the library ids, in :data:`LIBRARIES` order.

    Raises:
        LayoutError: an id that is not one of :data:`LIBRARIES` (the message lists them),
            or none at all.
    """
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text)]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in KERNEL_OPERATORS]
    if unknown or not names:
        raise LayoutError(f"kernel libraries {', '.join(map(repr, unknown)) or '(none given)'}: executorch "
                          f"{EXECUTORCH_VERSION} ships {', '.join(LIBRARIES)}; give a comma-separated list of "
                          "those")
    return tuple(lib for lib in LIBRARIES if lib in names)


def operators_of(libraries: Iterable[str]) -> frozenset[str]:
    """The operator names (``name.overload``) the given libraries register together."""
    return frozenset().union(*(KERNEL_OPERATORS[lib] for lib in libraries))


def library_of(operator: str) -> str | None:
    """The first library (in :data:`LIBRARIES` order) that registers ``operator``, or None."""
    return next((lib for lib in LIBRARIES if operator in KERNEL_OPERATORS[lib]), None)


def loaded_by(library: str) -> str | None:
    """The module whose import registers ``library``'s kernels, None if the runtime has them."""
    return KERNEL_MODULES[library]


def needs_line(operators: Iterable[str]) -> tuple[tuple[str, ...], str]:
    """The libraries a program calling ``operators`` needs, and how the report says it
    (after ``needs kernels:``): ``portable, llm custom ops (in Python: import ...)``.
    Operators no library has are left out (verify refuses them before)."""
    needed = {lib for lib in map(library_of, operators) if lib is not None}
    libs = tuple(lib for lib in LIBRARIES if lib in needed)
    imports = [m for m in (loaded_by(lib) for lib in libs) if m]
    line = ", ".join(TITLES[lib] for lib in libs) or "none"
    if imports:
        line += f" (in Python: import {', '.join(imports)} before loading the program)"
    return libs, line


def backends_line(backends: Iterable[str]) -> str:
    """How the report names the backends a program's delegates need (after ``needs
    backends:``): ``XnnpackBackend (registered in executorch.runtime)``; one the
    pinned Python runtime does not register is named as needing a runtime built with it."""
    parts = []
    for backend in backends:
        where = ("registered in executorch.runtime" if backend in BACKENDS
                 else "not in executorch.runtime: a runtime built with it")
        parts.append(f"{backend} ({where})")
    return ", ".join(parts)


def unregistered_hint(operator: str) -> str:
    """Why ``operator`` is not among the registered ones, for the refusal: the shipped
    library that has it, or that none has it."""
    lib = library_of(operator)
    if lib is None:
        return (f"no kernel library shipped with executorch {EXECUTORCH_VERSION} has it "
                f"({', '.join(LIBRARIES)}): the program needs a runtime built with its kernel")
    module = loaded_by(lib)
    return (f"it is in the {TITLES[lib]} kernel library ({lib}), not among the libraries checked; add {lib} to "
            f"--kernels if the runtime has it" + (f" (in Python: import {module})" if module else ""))
