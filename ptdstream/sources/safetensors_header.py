"""The header of a ``.safetensors`` file, checked against the file before
``safetensors`` reads it, so that a header that lies is refused with the file,
key and offset named (``safetensors`` itself refuses such files too, without
naming them).

Layout (safetensors/src/tensor.rs, ``SafeTensors::read_metadata``): 8 bytes of
header size N (little-endian), N bytes of JSON ``{key: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data; offsets
count from the first byte of the data (file offset ``8 + N``).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator
from json import decoder
from typing import NamedTuple, NoReturn

from ..errors import FormatError

__all__ = ["SAFETENSORS_MAX_HEADER_NBYTES", "Header", "Tensor", "check_safetensors_header"]

#: ``safetensors``' own limit on a header (``MAX_HEADER_SIZE``, safetensors/src/tensor.rs), bytes.
SAFETENSORS_MAX_HEADER_NBYTES = 100_000_000
#: Bits per element of each safetensors dtype (``Dtype::bitsize``, safetensors/src/tensor.rs).
_SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
                     "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
                     "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
                     "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "C64": 64}
#: The most items a ``shape`` or ``data_offsets`` list may have (safetensors takes
#: any number; no tensor has so many dimensions): each is kept as a Python list.
MAX_LIST_ITEMS = 1024
_WHITESPACE = re.compile(r"[ \t\n\r]*")
#: A tensor's entry as safetensors writes it (its serializer: no spaces, fields in this
#: order): read with one match; any other spelling is read token by token.
_WRITTEN_ENTRY = re.compile(r'\{"dtype":"([A-Z0-9_]{1,16})","shape":\[((?:[0-9]{1,20}(?:,[0-9]{1,20})'
                            f"{{0,{MAX_LIST_ITEMS - 1}}})?)"
                            r'\],"data_offsets":\[([0-9]{1,20}),([0-9]{1,20})\]\}')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
#: ``json``'s own string reader (C), which its decoder uses for every string.
_scanstring = decoder.scanstring  # type: ignore[attr-defined]  # in json/decoder.py, not in typeshed's stub
#: A JSON scalar, and a tensor's ``(dtype, shape, data_offsets)`` as the header gives them.
Scalar = str | int | float | bool | None
Entry = tuple[Scalar | list[Scalar], Scalar | list[Scalar] | tuple[int, ...], Scalar | list[Scalar] | tuple[int, ...]]


#: A tensor of the header once checked: safetensors dtype name, shape, data_offsets begin and end.
Tensor = tuple[str, tuple[int, ...], int, int]


class Header(NamedTuple):
    """A checked header: the file offset of the data's first byte (``8 +`` header
    size) and the tensors, ``{key: (dtype, shape, begin, end)}`` (safetensors'
    dtype name, ``data_offsets`` counted from the data's first byte)."""

    data_offset: int
    tensors: dict[str, Tensor]


def check_safetensors_header(path: str, name: str | None = None) -> Header:
    """Check the header of the ``.safetensors`` file at ``path`` against the file
    before ``safetensors`` maps it, and return its tensors (:class:`Header`; the
    last of a repeated key, as safetensors keeps; each checked as it is read): the
    header size (8 bytes, little-endian) fits the file and
    ``SAFETENSORS_MAX_HEADER_NBYTES``; every tensor's dtype is one safetensors
    knows; its ``data_offsets`` lie inside the data, in order, without overlap;
    its shape times its dtype's size is its byte count. ``path`` is opened
    without blocking and must be a regular file
    (:func:`~ptdstream.system.files.open_input`); messages name the file
    ``name`` (default ``path``).

    Reads the header only, and is bounded by it whatever it holds. Time: one
    pass over its text, a fixed amount of work a tensor (a tensor as safetensors
    writes it is read with one regex match), plus one sort of the spans when the
    header does not give them in data order. Memory: the header twice (its bytes
    and its text, each at most ``SAFETENSORS_MAX_HEADER_NBYTES``) plus one record
    a tensor, kept (its key, dtype name, two offsets and its shape, shared by the
    tensors of one shape). A tensor of no bytes costs what any other does.
    Figures: benchmarks/README.md (``bench_header.py``).

    Raises:
        FormatError: naming the file, the key and the offset (bytes from the
            start of the data, which begins at ``8 + header size``).
        OSError: the file cannot be opened or read, or is no regular file (a
            FIFO, socket, device or folder), naming it.
    """
    from ..system.files import open_input

    named = path if name is None else name
    with open_input(path) as f:
        file_nbytes = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{named}: {file_nbytes} bytes, too short for a safetensors header size (8 bytes)")
        header_nbytes = int.from_bytes(head, "little")
        if header_nbytes > min(file_nbytes - 8, SAFETENSORS_MAX_HEADER_NBYTES):
            raise FormatError(f"{named}: header size {header_nbytes} at offset 0 is larger than the "
                              f"{max(file_nbytes - 8, 0)} bytes after it (or safetensors' limit "
                              f"{SAFETENSORS_MAX_HEADER_NBYTES}): not a safetensors file, or cut")
        raw = f.read(header_nbytes)
    data_nbytes = file_nbytes - 8 - header_nbytes
    tensors: dict[str, Tensor] = {}
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple for each shape the header repeats
    for key, (dtype, given_shape, given_offsets) in _tensor_entries(raw, named):
        where = f"{named}: key {key!r}"
        offsets, shape = _integers(given_offsets), _integers(given_shape)
        if offsets is None or len(offsets) != 2 or shape is None or any(d < 0 for d in shape):
            raise FormatError(f"{where}: the header gives no valid data_offsets [begin, end] and shape "
                              f"(got {given_offsets!r:.80} and {given_shape!r:.80})")
        begin, end = offsets
        if not 0 <= begin <= end or end > data_nbytes:
            raise FormatError(f"{where}: data_offsets [{begin}, {end}] are not inside the {data_nbytes} bytes "
                              f"of data (from file offset {8 + header_nbytes}): the header lies, or the file is cut")
        bits = _SAFETENSORS_BITS.get(dtype) if isinstance(dtype, str) else None
        if bits is None:
            raise FormatError(f"{where}: dtype {dtype!r:.40} in the header (from offset 8) is no safetensors "
                              f"dtype (one of {', '.join(_SAFETENSORS_BITS)}): the header is damaged, or written "
                              "by a newer safetensors than the one installed")
        nbits = 0 if 0 in shape else bits
        for d in shape:
            nbits *= d
            if nbits > 8 * data_nbytes:
                break  # more than the file holds: no need to multiply out a huge shape
        if nbits != 8 * (end - begin):
            need = f"{nbits // 8}" if nbits <= 8 * data_nbytes else f"more than the {data_nbytes}"
            raise FormatError(f"{where}: shape {list(shape)!r:.80} of {dtype} needs {need} bytes, "
                              f"data_offsets [{begin}, {end}] (from file offset {8 + header_nbytes}) "
                              f"hold {end - begin}")
        tensors[key] = (str(dtype), shapes.setdefault(shape, shape), begin, end)  # a repeated key: the last
    _check_spans(named, tensors)
    return Header(8 + header_nbytes, tensors)


def _check_spans(path: str, tensors: dict[str, Tensor]) -> None:
    """Refuse tensors whose bytes overlap: one pass when the header lists them in
    data order (as safetensors writes them), else one sort of the spans.

    Raises:
        FormatError: naming both keys and the data offsets.
    """
    last = (0, 0, "")
    for key, (_, _, begin, end) in tensors.items():
        span = (begin, end, key)
        if span < last:
            break
        if begin < last[1]:
            _overlap(path, last, span)
        last = span
    else:
        return
    spans = sorted((b, e, k) for k, (_, _, b, e) in tensors.items())
    for first, then in itertools.pairwise(spans):
        if then[0] < first[1]:
            _overlap(path, first, then)


def _overlap(path: str, first: tuple[int, int, str], then: tuple[int, int, str]) -> NoReturn:
    raise FormatError(f"{path}: key {then[2]!r} at data offset {then[0]} overlaps key {first[2]!r} "
                      f"[{first[0]}, {first[1]})")


def _integers(value: Scalar | list[Scalar] | tuple[int, ...]) -> tuple[int, ...] | None:
    """``value`` as a tuple if it is a list of integers (not booleans), else None."""
    if isinstance(value, tuple):  # read by the one match: integers already
        return value
    if not isinstance(value, list):
        return None
    out = tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return out if len(out) == len(value) else None


class _Cursor:
    """A position in the header's JSON text, read one token at a time (strings with
    ``json``'s own ``scanstring``); errors name the file and the file offset."""

    def __init__(self, text: str, path: str) -> None:
        self.text, self.i, self.path = text, 0, path

    def fail(self, what: str, key: str | None = None) -> NoReturn:
        offset = 8 + len(self.text[: self.i].encode("utf-8", "surrogatepass"))
        named = f" key {key!r}:" if key is not None else ""
        raise FormatError(f"{self.path}:{named} the safetensors header (from offset 8) is not what safetensors "
                          f"reads, at file offset {offset}: {what}")

    def peek(self) -> str:
        """The next character after white space ("" at the end)."""
        self.i = _WHITESPACE.match(self.text, self.i).end()  # type: ignore[union-attr]  # matches the empty string
        return self.text[self.i : self.i + 1]

    def take(self, char: str, key: str | None = None) -> None:
        if self.peek() != char:
            self.fail(f"expected {char!r}, got {self.text[self.i : self.i + 20]!r}", key)
        self.i += 1

    def string(self, key: str | None = None) -> str:
        self.take('"', key)
        try:
            value, self.i = _scanstring(self.text, self.i, True)
        except ValueError as e:
            self.fail(f"not a JSON string ({e})", key)
        return str(value)

    def scalar(self, key: str | None = None) -> Scalar:
        """A string, number, true, false or null."""
        if self.peek() == '"':
            return self.string(key)
        for word, value in (("true", True), ("false", False), ("null", None)):
            if self.text.startswith(word, self.i):
                self.i += len(word)
                return value
        m = _NUMBER.match(self.text, self.i)
        if m is None:
            self.fail(f"expected a value, got {self.text[self.i : self.i + 20]!r}", key)
        if m.group(1) or m.group(2):
            self.i = m.end()
            return float(m.group())
        if m.end() - m.start() > 20:  # more digits than a 64-bit size (safetensors' usize)
            self.fail(f"integer of {m.end() - m.start()} digits, larger than safetensors' 64-bit sizes", key)
        self.i = m.end()
        return int(m.group())

    def members(self, key: str | None = None) -> Iterator[str]:
        """Each name of the object at the cursor, the cursor left on its value."""
        self.take("{", key)
        if self.peek() == "}":
            self.i += 1
            return
        while True:
            name = self.string(key)
            self.take(":", key)
            yield name
            if self.peek() == "}":
                self.i += 1
                return
            self.take(",", key)

    def flat(self, key: str) -> Scalar | list[Scalar]:
        """A scalar, or a list of at most ``MAX_LIST_ITEMS`` scalars."""
        if self.peek() == "{":
            self.fail("an object where safetensors takes a string or a list of integers", key)
        if self.peek() != "[":
            return self.scalar(key)
        self.i += 1
        items: list[Scalar] = []
        if self.peek() == "]":
            self.i += 1
            return items
        while True:
            if self.peek() in ("[", "{"):
                self.fail("a nested list or object where safetensors takes integers", key)
            items.append(self.scalar(key))
            if len(items) > MAX_LIST_ITEMS:
                self.fail(f"a list of more than {MAX_LIST_ITEMS} items", key)
            if self.peek() == "]":
                self.i += 1
                return items
            self.take(",", key)

    def skip(self, key: str) -> None:
        """Step over one value, keeping nothing (a field safetensors ignores)."""
        depth = 0
        while True:
            c = self.peek()
            if c in ("{", "["):
                depth, self.i = depth + 1, self.i + 1
            elif c in ("}", "]") and depth:
                depth, self.i = depth - 1, self.i + 1
            elif c in (",", ":") and depth:
                self.i += 1
                continue
            else:
                self.scalar(key)
            if not depth:
                return


def _tensor_entries(raw: bytes, path: str) -> Iterator[tuple[str, Entry]]:
    """Every tensor of the header as ``(key, (dtype, shape, data_offsets))`` (None
    for a field not given; a repeated key as often as it is there), read in one pass
    (safetensors/src/tensor.rs ``HashMetadata``): ``__metadata__`` must be null or
    an object of strings (``HashMap<String, String>``) and is not kept, a field
    safetensors ignores is stepped over, nothing else is built.

    Raises:
        FormatError: not UTF-8, not a JSON object, a ``__metadata__`` value that is
            not a string, a nested value in a tensor's fields, a list longer than
            ``MAX_LIST_ITEMS``: naming the file, the key and the file offset.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: the safetensors header is not UTF-8 (file offset {8 + e.start})") from None
    cursor = _Cursor(text, path)
    if cursor.peek() != "{":
        cursor.fail("the header is not a JSON object")
    for key in cursor.members():
        if key == "__metadata__":
            if cursor.peek() != "{":
                if cursor.scalar(key) is not None:
                    cursor.fail("__metadata__ is neither an object of strings nor null", key)
                continue
            for name in cursor.members(key):
                if cursor.peek() != '"':
                    cursor.fail(f"the __metadata__ value of {name[:80]!r} is not a string (safetensors takes "
                                "strings only)", key)
                cursor.string(key)
            continue
        fields: dict[str, Scalar | list[Scalar]] = {}
        cursor.peek()
        written = _WRITTEN_ENTRY.match(text, cursor.i)
        if written is not None:
            cursor.i = written.end()
            dims = written.group(2)
            yield key, (written.group(1), tuple(map(int, dims.split(","))) if dims else (),
                        (int(written.group(3)), int(written.group(4))))
            continue
        if cursor.peek() != "{":
            cursor.skip(key)  # not an object: refused as giving no data_offsets and shape
        else:
            for field in cursor.members(key):
                if field in ("dtype", "shape", "data_offsets"):
                    fields[field] = cursor.flat(key)
                else:
                    cursor.skip(key)
        yield key, (fields.get("dtype"), fields.get("shape"), fields.get("data_offsets"))
    if cursor.peek():
        cursor.fail("text after the header's object")
