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
import json
import os

from ..errors import FormatError

__all__ = ["SAFETENSORS_MAX_HEADER_NBYTES", "check_safetensors_header"]

#: ``safetensors``' own limit on a header (``MAX_HEADER_SIZE``, safetensors/src/tensor.rs), bytes.
SAFETENSORS_MAX_HEADER_NBYTES = 100_000_000
#: Bits per element of each safetensors dtype (``Dtype::bitsize``, safetensors/src/tensor.rs).
_SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
                     "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
                     "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "C64": 64}


def check_safetensors_header(path: str) -> None:
    """Check the header of the ``.safetensors`` file at ``path`` against the file
    before ``safetensors`` maps it: the header size (8 bytes, little-endian) fits
    the file and ``SAFETENSORS_MAX_HEADER_NBYTES``; every tensor's
    ``data_offsets`` lie inside the data, in order, without overlap; its shape
    times its dtype's size is its byte count. Reads the header only (memory:
    its size, at most the file's).

    Raises:
        FormatError: naming the file, the key and the offset (bytes from the
            start of the data, which begins at ``8 + header size``).
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        file_nbytes = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{path}: {file_nbytes} bytes, too short for a safetensors header size (8 bytes)")
        header_nbytes = int.from_bytes(head, "little")
        if header_nbytes > min(file_nbytes - 8, SAFETENSORS_MAX_HEADER_NBYTES):
            raise FormatError(f"{path}: header size {header_nbytes} at offset 0 is larger than the "
                              f"{file_nbytes - 8} bytes after it (or safetensors' limit "
                              f"{SAFETENSORS_MAX_HEADER_NBYTES}): not a safetensors file, or cut")
        raw = f.read(header_nbytes)
    data_nbytes = file_nbytes - 8 - header_nbytes
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise TypeError(f"the header is a {type(header).__name__}, not an object")
    except (ValueError, TypeError) as e:
        raise FormatError(f"{path}: the safetensors header (offset 8, {header_nbytes} bytes) is not a JSON "
                          f"object: {e}") from None
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        where = f"{path}: key {key!r}"
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)):
            raise FormatError(f"{where}: the header gives no valid data_offsets [begin, end] and shape "
                              f"(got {offsets!r:.80} and {shape!r:.80})")
        begin, end = offsets
        if not 0 <= begin <= end or end > data_nbytes:
            raise FormatError(f"{where}: data_offsets [{begin}, {end}] are not inside the {data_nbytes} bytes "
                              f"of data (from file offset {8 + header_nbytes}): the header lies, or the file is cut")
        bits = _SAFETENSORS_BITS.get(info.get("dtype"))
        if bits is not None:
            nbits = 0 if 0 in shape else bits
            for d in shape:
                nbits *= d
                if nbits > 8 * data_nbytes:
                    break  # more than the file holds: no need to multiply out a huge shape
            if nbits != 8 * (end - begin):
                need = f"{nbits // 8}" if nbits <= 8 * data_nbytes else f"more than the {data_nbytes}"
                raise FormatError(f"{where}: shape {shape!r:.80} of {info.get('dtype')} needs {need} bytes, "
                                  f"data_offsets [{begin}, {end}] (from file offset {8 + header_nbytes}) "
                                  f"hold {end - begin}")
        spans.append((begin, end, key))
    spans.sort()
    for (b0, e0, k0), (b1, _e1, k1) in itertools.pairwise(spans):
        if b1 < e0:
            raise FormatError(f"{path}: key {k1!r} at data offset {b1} overlaps key {k0!r} [{b0}, {e0})")

