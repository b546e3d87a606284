"""Claim 3: a lying manifest cannot make `verify --manifest` allocate.

Huge piece sizes are handled, tiny ones are not: an 8 KiB manifest whose one
file entry says piece_size 1 (for a 4 MiB file, with one piece digest listed)
makes verify compute and keep one xxh3-128 digest object per byte
(ptdstream/check/manifest.py piece_digests, ~line 86-101, builds the whole list;
manifest_codec.from_bytes does not check len(pieces) == ceil(size / piece_size)).
block_size 1 does the same with 4-byte block checks (check/manifest_narrow.py:82).

Expected: refused at once (piece count does not fit size / piece size), small RSS.
Actual:   ~325 MiB peak RSS and ~40 s for a 4 MiB file (~630 MiB for 8 MiB: about 75 bytes of RSS per
          byte verified: a 1 GiB file needs ~80 GB); block_size 1: ~300 MB / 17 s for 64 MiB.

Run: PYTHONPATH=. python tools/repro/manifest_tiny_piece_size.py   (exit 1 = bug present)
"""
import dataclasses
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ptdstream.check import manifest_codec  # noqa: E402
from ptdstream.check.manifest import write_manifest  # noqa: E402

with tempfile.TemporaryDirectory() as d:
    data = os.path.join(d, "data.bin")
    with open(data, "wb") as f:
        f.write(os.urandom(4 << 20))
    m = write_manifest([data], os.path.join(d, "real.manifest"))
    lie = os.path.join(d, "lie.manifest")
    entry = dataclasses.replace(m.files[0], piece_nbytes=1)
    with open(lie, "wb") as f:
        f.write(manifest_codec.to_bytes(dataclasses.replace(m, files=(entry,))))
    code = ("import resource, sys; from ptdstream.cli import main; rc = main(sys.argv[1:]); "
            "print('maxrss_mib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, 'rc', rc)")
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code, "verify", data, "--manifest", lie], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    wall = time.monotonic() - t
    line = p.stdout.strip().splitlines()[-1]
    rss = int(line.split()[1])
    print(f"manifest {os.path.getsize(lie)} bytes, file 4 MiB: {line}, {wall:.1f} s (want: refused, < 100 MiB, < 2 s)")
    sys.exit(1 if rss > 150 or wall > 5 else 0)
