"""Parse an untrusted .pte program flatbuffer with executorch's object API, bounded.

Two guards around ``executorch_flatbuffer.ProgramT.InitFromPackedBuf``:

* byte vectors and strings must end inside the data (the flatbuffers Python reader
  slices them without a bounds check, so a program cut inside its last string
  would otherwise parse, with the string shortened);
* a work budget: the generated ``*T.InitFromBuf``/``InitFromObj`` class methods
  are counted while the parse runs (scoped through
  :func:`~ptdstream.upstream.patching.shadowed`, restored when it returns) and,
  after it, the elements of every vector, so offsets shared across a crafted file
  cannot expand without bound.

Parses are serialized by a lock (the counted class methods are process-wide
while one runs); nothing stays patched after :func:`parse_program` returns.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import threading

from .names import resolve
from .patching import shadowed

__all__ = ["parse_program"]

_FB = "executorch.exir._serialize._flatbuffer_program"
_parse_lock = threading.Lock()


class _BoundedBytes(bytes):
    """``bytes`` whose slices must end inside it."""

    def __getitem__(self, key):
        if isinstance(key, slice) and key.stop is not None and key.stop > len(self):
            raise IndexError(f"bytes [{key.start}:{key.stop}] lie beyond the flatbuffer's {len(self)} bytes")
        return super().__getitem__(key)


class _Budget:
    """Units of work a flatbuffer of ``nbytes`` bytes may cost (each table takes at
    least 4 bytes); :meth:`spend` raises once they are spent."""

    def __init__(self, nbytes: int) -> None:
        self.left = nbytes // 4 + 1024
        self.nbytes = nbytes

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise ValueError(
                f"the program flatbuffer ({self.nbytes} bytes) unpacks into more objects "
                "than it could hold: shared offsets (a crafted file?)"
            )


def _generated_classes():
    package = resolve("executorch.exir._serialize.generated.executorch_flatbuffer")
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        cls = getattr(module, f"{info.name}T", None)
        if cls is not None:
            yield cls


def _counting(budget: _Budget, original):
    def counted(cls, *args):
        budget.spend()
        return original(*args)

    return classmethod(counted)


def _vector_elements(obj, budget: _Budget, depth: int = 0) -> None:
    """Spend one unit per element of every list/array in an unpacked tree, so a
    scalar vector shared by many tables cannot expand without bound either."""
    if depth > 64:
        raise ValueError("the program flatbuffer nests deeper than 64 levels")
    for value in vars(obj).values():
        if isinstance(value, (bytes, bytearray, str)) or value is None:
            continue
        if hasattr(value, "__len__") and not hasattr(value, "__dict__"):
            budget.spend(len(value))
            for item in value if isinstance(value, list) else ():
                if hasattr(item, "__dict__"):
                    _vector_elements(item, budget, depth + 1)
        elif hasattr(value, "__dict__"):
            _vector_elements(value, budget, depth + 1)


def parse_program(data: bytes):
    """``data`` (a program flatbuffer from an untrusted file) as ``exir.schema.Program``.

    Raises:
        IndexError: a string or byte vector runs past the end of ``data``.
        ValueError: the program unpacks into more tables and vector elements than
            ``len(data) / 4 + 1024`` (shared offsets), or nests deeper than 64.
        Exception: any other parse failure; every exception means ``data`` is not
            a valid program flatbuffer.
    """
    from executorch.exir.schema import Program

    program_cls = resolve("executorch.exir._serialize.generated.executorch_flatbuffer.Program", "ProgramT")
    resolve(_FB, "_patch_generated_flatbuffer_aliases")()  # upstream's own, idempotent
    budget = _Budget(len(data))
    with _parse_lock, contextlib.ExitStack() as patches:
        for cls in _generated_classes():
            for name in ("InitFromBuf", "InitFromObj"):
                original = getattr(cls, name, None)
                if original is not None:
                    patches.enter_context(shadowed(cls, name, _counting(budget, original)))
        program_t = program_cls.InitFromPackedBuf(_BoundedBytes(data))
    _vector_elements(program_t, _Budget(len(data) * 2))
    return resolve(_FB, "_convert_from_flatbuffer_dataclass")(program_t, Program)
