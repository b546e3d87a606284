"""Claim 2: "a lying safetensors header is refused naming file, key and offset, in bounded memory".

check_safetensors_header (ptdstream/sources/safetensors_header.py:52-55) reads the
header (up to safetensors' 100 MB limit) and json.loads it whole: a header of
empty JSON objects in __metadata__ (which safetensors itself would reject: its
metadata values are strings) costs ~25x its size in Python objects before the
lying key after it is refused. 10 MB of header -> ~260 MiB RSS; 100 MB -> ~2.5 GiB.

Expected: refused in memory bounded by a small constant (or by the header bytes).
Actual:   peak RSS ~25x the header size (printed below), then the refusal.

Run: PYTHONPATH=. python tools/repro/safetensors_header_memory.py   (exit 1 = bug present)
"""
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "lie.safetensors")
    n = 10_000_000 // 3
    header = ('{"__metadata__":{"x":[' + ",".join(["{}"] * n) + ']},'
              '"w":{"dtype":"F32","shape":[4],"data_offsets":[0,1000000]}}').encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    code = ("import resource, sys\nfrom ptdstream.sources.safetensors_header import check_safetensors_header\n"
            "try:\n    check_safetensors_header(sys.argv[1]); print('accepted')\n"
            "except Exception as e: print(type(e).__name__, str(e)[-120:])\n"
            "print('maxrss_mib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)")
    p = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    print(p.stdout.strip())
    rss = int(p.stdout.split("maxrss_mib")[1])
    print(f"header {len(header) / 1e6:.1f} MB -> peak RSS {rss} MiB (want: bounded, e.g. < 64 MiB)")
    sys.exit(1 if rss > 100 else 0)
