"""Verified roots of a .pte program flatbuffer and a .ptd FlatTensor flatbuffer (flatc code).

:func:`program_root` and :func:`flat_tensor_root` run the bounds-checked verifier
(:mod:`ptdstream.format.verifier`, the C++ ``flatbuffers::Verifier`` rules) over the
bytes first and only then hand them to the ``flatc --python`` classes, which read
without checks. Neither imports torch nor executorch.
"""

from __future__ import annotations

from typing import Any

from .flat_tensor_fb.FlatTensor import FlatTensor
from .program_fb.Program import Program
from .program_fb.Tensor import Tensor
from .verifier import verify_buffer

__all__ = ["flat_tensor_root", "program_root", "text", "union_tensor"]

Buffer = bytes | bytearray | memoryview


def program_root(buf: Buffer) -> Program:
    """The verified ``Program`` root of ``buf`` (the .pte from byte 0 to ``program_size``).

    Mirrors ``runtime/executor/program.cpp::Program::load``: identifier ``ET12`` at
    bytes 4..8 and ``VerifyProgramBuffer`` (InternalConsistency verification).

    Raises:
        FlatbufferError: the runtime's verifier would refuse ``buf`` (offset, reason).
    """
    buf = bytes(buf)
    verify_buffer(buf, "program")
    return Program.GetRootAs(buf, 0)


def flat_tensor_root(buf: Buffer) -> FlatTensor:
    """The verified ``FlatTensor`` root of ``buf`` (the .ptd from byte 0 to the end of its
    flatbuffer). The runtime does not verify this flatbuffer
    (``extension/flat_tensor/flat_tensor_data_map.cpp::FlatTensorDataMap::load`` only
    checks the ``FT01`` identifier), so a corrupt one can crash it; this refuses it.

    Raises:
        FlatbufferError: ``buf`` is not a valid FlatTensor flatbuffer.
    """
    buf = bytes(buf)
    verify_buffer(buf, "flat_tensor")
    return FlatTensor.GetRootAs(buf, 0)


def union_tensor(value: Any) -> Tensor:
    """The ``Tensor`` table an ``EValue`` whose ``ValType()`` is Tensor (5) holds."""
    tab = value.Val()
    t = Tensor()
    t.Init(tab.Bytes, tab.Pos)
    return t


def text(raw: bytes | None) -> str:
    """A flatbuffer string (bytes) as str; undecodable bytes kept as surrogates."""
    return raw.decode("utf-8", "surrogateescape") if raw is not None else ""


def shown(value: bytes | bytearray | memoryview | str, quote: bool = False) -> str:
    """How a key or name read from a file is shown in messages and listings: its
    UTF-8 text, each undecodable byte as ``\\xNN`` (Python's ``backslashreplace``)
    and each unprintable character (``\\x00``, other controls) escaped the same
    way. ``value``: bytes, or str as :func:`text` decodes it (surrogateescape);
    ``quote`` wraps it in single quotes."""
    if isinstance(value, str):
        try:
            raw = value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate of no byte: show its code point
            raw = value.encode("utf-8", "backslashreplace")
        value = raw
    out = "".join(c if c.isprintable() else (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
                  for c in bytes(value).decode("utf-8", "backslashreplace"))
    return f"'{out}'" if quote else out
