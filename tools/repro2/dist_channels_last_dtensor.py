"""Claim 6 ("equals ptdstream.write_data_files of a store that received the whole
tensors"): a channels_last 4-D DTensor (Replicate, on 2 gloo ranks).

One process: the store accepts the channels_last tensor (dense over its storage)
and writes its storage bytes with dim order (0, 2, 3, 1), as upstream does.
Distributed: ptdstream/distributed/writer.py _local_pieces() sets
dim_order = tuple(range(tensor.dim())) (line 115) and makes the local piece
.contiguous() (line 119): the .ptd holds NCHW bytes with dim order (0, 1, 2, 3).
A program exported with channels_last weights records dim order (0, 2, 3, 1)
for that key, so the distributed .ptd does not match it.

Expected: the same model.ptd bytes as one process. Actual: different.

usage: PYTHONPATH=. python tools/repro2/dist_channels_last_dtensor.py   (about 30 s)
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    import torch

    from ptdstream.save import write_data_files
    from ptdstream.store import StreamingNamedDataStore

    root = tempfile.mkdtemp(prefix="b2cl-")
    try:
        subprocess.run([sys.executable, os.path.join(HERE, "_dist_probe.py"), "2", root, "channels-last-replicate"],
                       capture_output=True, timeout=300, env=dict(os.environ))
        outcomes = [open(os.path.join(root, f"channels-last-replicate.rank{r}")).read() for r in (0, 1)]
        g = torch.Generator().manual_seed(1)
        torch.randn(6, 3, generator=g)  # the harness draws these first
        cl = torch.randn(2, 3, 2, 2, generator=g).contiguous(memory_format=torch.channels_last)
        store = StreamingNamedDataStore()
        store.add_named_data("cl", cl, alignment=1, external_tag="model")
        ref = os.path.join(root, "ref")
        os.makedirs(ref)
        write_data_files(store, ref)
        one = open(os.path.join(ref, "model.ptd"), "rb").read()
        dist = open(os.path.join(root, "channels-last-replicate", "model.ptd"), "rb").read()
        print(f"ranks: {outcomes}")
        print(f"expected: the one-process model.ptd ({len(one)} bytes)")
        print(f"actual: distributed model.ptd ({len(dist)} bytes) {'equal' if dist == one else 'DIFFERS'}")
        return 0 if dist == one else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
