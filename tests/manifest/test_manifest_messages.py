"""A manifest's failure leads with the bytes that differ; the first bad piece is named as a
piece with its byte range (was: "first bad piece 0 at offset 0", read as byte 0)."""

from __future__ import annotations

import os

from _small_exports import write_reference

EXT_PTD = "_default_external_constant.ptd"


def test_a_manifest_names_the_differing_bytes_first_and_the_piece_as_a_piece(tmp_path, capsys):
    from ptdstream.cli import main

    files = write_reference("external", tmp_path)
    ptd = files[EXT_PTD]
    assert main(["manifest", ptd, "-o", str(tmp_path / "m.manifest"), "--piece-size", "4096", "-q"]) == 0
    size = os.path.getsize(ptd)
    with open(ptd, "r+b") as f:
        f.seek(size - 1)
        last = f.read(1)
        f.seek(size - 1)
        f.write(bytes([last[0] ^ 1]))
    capsys.readouterr()
    code = main(["verify", ptd, "--manifest", str(tmp_path / "m.manifest")])
    out = capsys.readouterr().out
    piece = (size - 1) // 4096
    assert code == 1 and out.startswith(f"BAD {ptd}: differs in bytes [")
    assert f" (first bad piece {piece}, bytes [{piece * 4096:,}, {size:,})); section " in out
