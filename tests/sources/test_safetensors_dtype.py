"""The dtype of a safetensors header entry, checked before safetensors reads the
file: one it does not know is refused naming the file and the key."""

from __future__ import annotations

import pytest

from ptdstream.errors import FormatError
from ptdstream.sources.checkpoint import open_checkpoint

KNOWN = ("BOOL, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, I16, U16, F16, BF16, I32, U32, F32, "
         "F64, I64, U64, F4, F6_E2M3, F6_E3M2, C64")


def _file(path, entries: str, data: bytes = bytes(16)) -> int:
    """Write the file; return the file offset its data starts at."""
    header = ("{" + entries + "}").encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    return 8 + len(header)


@pytest.mark.parametrize("dtype, spelled", [('"F33"', "'F33'"), ("7", "7"), ('"f32"', "'f32'")],
                         ids=["unknown", "number", "lower-case"])
def test_a_dtype_safetensors_does_not_know_is_refused_naming_the_key(tmp_path, dtype, spelled):
    path = tmp_path / "c.safetensors"
    _file(path, '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                f'"b":{{"dtype":{dtype},"shape":[2],"data_offsets":[8,16]}}')
    with pytest.raises(FormatError) as raised:
        open_checkpoint(str(path))
    assert str(raised.value) == (f"{path}: key 'b': dtype {spelled} in the header (from offset 8) is no safetensors "
                                 f"dtype (one of {KNOWN}): the header is damaged, or written by a newer "
                                 "safetensors than the one installed")


@pytest.mark.parametrize("dtype", ["F8_E4M3FNUZ", "F8_E5M2FNUZ"])
def test_the_fnuz_float8_dtypes_are_sized(tmp_path, dtype):
    """safetensors knows them (one byte each): a shape that lies about their bytes is named."""
    path = tmp_path / "c.safetensors"
    start = _file(path, f'"w":{{"dtype":"{dtype}","shape":[4],"data_offsets":[0,16]}}')
    with pytest.raises(FormatError) as raised:
        open_checkpoint(str(path))
    assert str(raised.value) == (f"{path}: key 'w': shape [4] of {dtype} needs 4 bytes, data_offsets [0, 16] "
                                 f"(from file offset {start}) hold 16")
