"""A packed artifact's metadata read is bounded by a limit (and by what the seek
table says exists), not by its header's claim."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from _procs import SAFETY_S

from ptdstream import FormatError
from ptdstream.format.identity import ExtendedHeader
from ptdstream.pack import PackedArtifact, pack


def hostile_pte(path, nbytes: int) -> None:
    """A sparse file whose extended header claims a program of ``nbytes`` - 64 bytes,
    followed by zeros (they exist, and compress to almost nothing)."""
    with open(path, "wb") as f:
        f.write(b"\x00" * 4 + b"ET12" + ExtendedHeader(nbytes - 64, nbytes - 64, 0).to_bytes())
        f.truncate(nbytes)


def test_a_program_claim_over_the_limit_is_refused_before_it_is_read(tmp_path):
    hostile_pte(tmp_path / "h.pte", 4 << 20)
    pack(str(tmp_path / "h.pte"), str(tmp_path / "h.pte.zst"), level=1)
    with pytest.raises(FormatError, match=r"metadata of 4,194,240 bytes at offset 0 is over the limit of "
                                          r"1,048,576 bytes for a packed artifact"):
        PackedArtifact(str(tmp_path / "h.pte.zst"), max_metadata_nbytes=1 << 20)


def test_extract_list_of_a_512_mib_claim_stays_small(tmp_path):
    """The claim exists (512 MiB of zeros in a few hundred KB): the default limit
    (256 MiB) refuses it; peak RSS stays far below the claim (it grew past 5 GB
    for a 4 GiB claim before)."""
    hostile_pte(tmp_path / "h.pte", 512 << 20)
    pack(str(tmp_path / "h.pte"), str(tmp_path / "h.pte.zst"), level=1)
    os.unlink(tmp_path / "h.pte")
    assert os.path.getsize(tmp_path / "h.pte.zst") < 1 << 20
    code = textwrap.dedent(f"""
        import resource
        from ptdstream.cli import main
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        code = main(["extract", {str(tmp_path / 'h.pte.zst')!r}, "--list"])
        print(code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SAFETY_S)
    code, added_kib = map(int, out.stdout.split()[-2:])
    assert code == 1, out.stderr
    assert "is over the limit of 268,435,456 bytes for a packed artifact" in out.stderr
    assert added_kib < 96 << 10, f"peak RSS grew by {added_kib} KiB"
