"""Shared helpers for the reproducers: a small .pte/.ptd/safetensors set and a CLI runner."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PTD = "_default_external_constant.ptd"


def make_set(folder):
    """model.pte + _default_external_constant.ptd + ck.safetensors + w.ptd.zst in ``folder`` (~10 s)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch
    from conftest import Mlp, export
    from executorch.exir import ExecutorchBackendConfig
    from safetensors.torch import save_file

    import ptdstream

    torch.manual_seed(0)
    model = Mlp()
    ptdstream.save(export(model, config=ExecutorchBackendConfig(external_constants=True)),
                   os.path.join(folder, "model.pte"))
    new = {k: v.detach().clone() + 1 for k, v in model.state_dict().items()}
    save_file(new, os.path.join(folder, "ck.safetensors"))
    run_cli("pack", os.path.join(folder, PTD), "-o", os.path.join(folder, "w.ptd.zst"), "-q")


def run_cli(*argv, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "ptdstream", *argv], env=env, timeout=kw.pop("timeout", 120), **kw)
