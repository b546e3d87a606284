"""Claim 6 (inputs that lie): 2 gloo ranks pass DTensors whose metadata disagree
across ranks or with their local shards. Each should be refused on every rank
(a LayoutError naming the key inside DistributedWriteError), nothing published.

  lie-shard-sizes          Shard(0) of a (6, 3) tensor over 2 ranks is rows 3 + 3
                           (torch.chunk); rank 0's local shard holds 2 rows, rank
                           1's 4 (DTensor.from_local(..., run_check=False, shape=)).
                           DTensor itself cannot full_tensor() it.
  lie-shard-shape-differs  rank 0 says the whole is (6, 3), rank 1 says (2, 9).
  lie-dtype-differs        rank 0's shard is float32, rank 1's int32 (same bytes).
  lie-tag-differs          external_tag "tag0" on rank 0, "tag1" on rank 1.
  lie-alignment-differs    alignment 16 on rank 0, 64 on rank 1.
  lie-replicate-differs    a Replicate DTensor whose replicas differ (arguable:
                           run_check=False promised they are equal).

Actual: every one is published ("ok"), with rank 0's (the first piece's) view of
the key: ptdstream/distributed/plan.py collate() (lines 67-92) checks only that
the pieces' sizes add up to group[0].total_nbytes; plan_files() (line 118) takes
tag, alignment, dtype, sizes and dim order from pieces[key][0] and never compares
them with the other ranks' PieceInfo; nothing checks a Shard(0) piece's row count
against the chunk torch.chunk gives its coordinate.

usage: PYTHONPATH=. python tools/repro2/dist_lying_inputs.py   (about 40 s)
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ["lie-shard-sizes", "lie-shard-shape-differs", "lie-dtype-differs", "lie-tag-differs",
             "lie-alignment-differs", "lie-replicate-differs"]


def main() -> int:
    root = tempfile.mkdtemp(prefix="b2lie-")
    try:
        subprocess.run([sys.executable, os.path.join(HERE, "_dist_probe.py"), "2", root, *SCENARIOS],
                       capture_output=True, timeout=300, env=dict(os.environ))
        bad = 0
        for name in SCENARIOS:
            outcomes = []
            for r in (0, 1):
                p = os.path.join(root, f"{name}.rank{r}")
                outcomes.append(open(p).read() if os.path.exists(p) else None)
            files = sorted(os.listdir(os.path.join(root, name)))
            refused = all(o is not None and o.startswith("error") and "LayoutError" in o for o in outcomes)
            print(f"{name}: rank 0: {outcomes[0]!r}; rank 1: {outcomes[1]!r}; folder: {files}")
            bad += not refused
        print("expected: every scenario refused on both ranks (LayoutError naming the key), nothing published")
        print(f"actual: {bad} of {len(SCENARIOS)} published" if bad else "actual: as expected")
        return 1 if bad else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
