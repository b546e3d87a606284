"""Claim 7 (files changed mid-save): `write_ptd` / `ptdstream weights` from a
safetensors checkpoint that is rewritten in place (same header, same size, as
`safetensors.torch.save_file` over the same path does) while the save reads it.

Expected: an IntegrityError naming the checkpoint file (the file changed after
it was handed over), nothing published; never a .ptd holding some tensors of
the old checkpoint and some of the new.
Actual (see the output): printed per variant.

usage: PYTHONPATH=. python tools/repro2/weights_checkpoint_rewritten_midsave.py
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

import safetensors.torch as st  # noqa: E402
import torch  # noqa: E402
from conftest import Mlp, export  # noqa: E402
from executorch.exir import ExecutorchBackendConfig  # noqa: E402

import ptdstream.sources.mapped as mapped  # noqa: E402
from ptdstream.weights import write_ptd  # noqa: E402

PTD = "_default_external_constant.ptd"


def main() -> int:
    root = tempfile.mkdtemp(prefix="b2w-")
    try:
        torch.manual_seed(0)
        model = Mlp()
        manager = export(model, config=ExecutorchBackendConfig(external_constants=True))
        pte = os.path.join(root, "model.pte")
        with open(pte, "wb") as f:
            manager.write_to_file(f)
        base = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
        state_a = {k: v + 1 for k, v in base.items()}
        bad = 0
        for variant in ("whole tensors differ", "bytes past the first 32 differ"):
            if variant == "whole tensors differ":
                state_b = {k: v + 2 for k, v in base.items()}
            else:
                state_b = {k: v.clone() for k, v in state_a.items()}
                for v in state_b.values():
                    if v.numel() > 8:  # past the first 32 bytes
                        v.view(-1)[-1] += 5.0
            ckpt = os.path.join(root, "ckpt.safetensors")
            st.save_file(state_a, ckpt)
            outs = {}
            for name, state in (("A", state_a), ("B", state_b)):
                st.save_file(state, ckpt)
                d = os.path.join(root, f"ref{name}")
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
                write_ptd(program=pte, checkpoint=ckpt, out_dir=d)
                outs[name] = open(os.path.join(d, PTD), "rb").read()
            st.save_file(state_a, ckpt)
            out = os.path.join(root, "out")
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            original = mapped.MappedTensorSource.pieces
            calls = [0]

            def pieces(self, ring, _orig=original):
                calls[0] += 1
                if calls[0] == 2:  # after the first tensor was read: rewrite the checkpoint in place
                    ino = os.stat(ckpt).st_ino
                    data = st.save(state_b)
                    assert len(data) == os.path.getsize(ckpt)
                    with open(ckpt, "r+b") as f:  # in place, as `dd conv=notrunc` or a writer's pwrite
                        f.write(data)
                    assert os.stat(ckpt).st_ino == ino  # the same file, rewritten
                yield from _orig(self, ring)

            mapped.MappedTensorSource.pieces = pieces
            try:
                write_ptd(program=pte, checkpoint=ckpt, out_dir=out)
                result = f"published {sorted(os.listdir(out))}"
            except Exception as e:  # noqa: BLE001
                result = f"refused: {type(e).__name__}: {e}"
            finally:
                mapped.MappedTensorSource.pieces = original
            got = open(os.path.join(out, PTD), "rb").read() if os.path.exists(os.path.join(out, PTD)) else None
            kind = ("absent" if got is None else "old checkpoint (A)" if got == outs["A"]
                    else "new checkpoint (B)" if got == outs["B"] else "MIXED (neither A nor B)")
            print(f"[{variant}] {result}\n    the .ptd is: {kind}")
            if got is not None and kind.startswith("MIXED"):
                bad += 1
        print("expected: refused naming the checkpoint file, nothing published")
        print(f"actual: {bad} variant(s) published a mixed .ptd" if bad else "actual: as expected")
        return 1 if bad else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
