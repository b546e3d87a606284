"""verify looks an external tensor up as the runtime does: by its
``fully_qualified_name`` read as a C string (cut at its first NUL), against the
.ptd key taken whole (check.runtime.rules.runtime_key); both behaviours of
executorch.runtime are pinned here."""

from __future__ import annotations

import struct

import pytest
import torch
from conftest import Mlp, export
from executorch.exir import ExecutorchBackendConfig

import ptdstream
from ptdstream.check.runtime.rules import runtime_key
from ptdstream.check.structure import check_structure

PTD = "_default_external_constant.ptd"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("names")
    torch.manual_seed(0)
    ptdstream.save(export(Mlp(), config=ExecutorchBackendConfig(external_constants=True)), str(folder / "model.pte"))
    return folder


def _nul_suffixed(saved, tmp_path, cut_ptd_key: bool):
    """The program's 'l1.weight' renamed 'l1\\0weight' (the runtime reads 'l1'); the
    .ptd key made 'l1' (its length prefix cut to 2) or 'l1\\0weight' like the program's."""
    pte = (saved / "model.pte").read_bytes()
    assert pte.count(b"l1.weight") == 1
    (tmp_path / "model.pte").write_bytes(pte.replace(b"l1.weight", b"l1\0weight"))
    ptd = bytearray((saved / PTD).read_bytes())
    at = ptd.index(b"l1.weight")
    assert struct.unpack_from("<I", ptd, at - 4) == (9,)
    if cut_ptd_key:
        struct.pack_into("<I", ptd, at - 4, 2)
        ptd[at : at + 3] = b"l1\0"
    else:
        ptd[at : at + 9] = b"l1\0weight"
    (tmp_path / PTD).write_bytes(bytes(ptd))
    return str(tmp_path / "model.pte"), str(tmp_path / PTD)


def _runtime_loads(pte: str, ptd: str) -> bool:
    from executorch.runtime import Runtime

    try:
        Runtime.get().load_program(pte, data_path=ptd).load_method("forward")
    except RuntimeError:
        return False
    return True


def test_runtime_key_cuts_at_the_first_nul():
    assert runtime_key(b"l1\0weight") == b"l1" and runtime_key("a\0b\0c") == "a" and runtime_key(b"w") == b"w"


def test_a_nul_suffixed_name_the_runtime_loads_is_accepted(saved, tmp_path):
    pte, ptd = _nul_suffixed(saved, tmp_path, cut_ptd_key=True)
    assert _runtime_loads(pte, ptd)
    report = check_structure(pte, [ptd])
    assert report.ok, report.summary()
    assert "external data: all 4 external tensors found" in report.summary()


def test_a_nul_in_the_ptd_key_is_refused_as_the_runtime_refuses_it(saved, tmp_path):
    pte, ptd = _nul_suffixed(saved, tmp_path, cut_ptd_key=False)
    assert not _runtime_loads(pte, ptd)  # the .ptd key is compared whole: 'l1\0weight' is not 'l1'
    report = check_structure(pte, [ptd])
    assert not report.ok
    assert "external data: missing from the given .ptd files: 'l1\\x00weight'" in report.summary()
