"""Small real exports for the reader, verify, inspect and CLI tests.

Each export is made once per test process (``functools.lru_cache``), with fixed
seeds, from tiny models (about a second each; the first XNNPACK export also
pays for importing the backend). Files are written by the tests themselves,
into their ``tmp_path``.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterable

import torch

warnings.filterwarnings("ignore")


class TwoLinear(torch.nn.Module):
    """Linear(8, 4) -> ReLU -> Linear(4, 3): four constants of 128, 16, 48, 12 bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 4)
        self.b = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Counter(torch.nn.Module):
    """A Linear(4, 4) plus a mutable buffer ``count`` (initial state 0, 1, 2, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.arange(4, dtype=torch.float32))

    def forward(self, x):
        self.count.add_(1)
        return self.lin(x) + self.count


class Tied(torch.nn.Module):
    """Embedding(64, 16) whose weight is also the output projection's (4096 bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.embed(tokens))


#: What each export holds (see :func:`manager`).
KINDS = ("plain", "mutable", "xnnpack", "external", "xnnpack_ptd", "tied")


@functools.cache
def model(kind: str) -> torch.nn.Module:
    """The seeded eager model behind ``manager(kind)``."""
    torch.manual_seed(0)
    cls = {"mutable": Counter, "tied": Tied}.get(kind, TwoLinear)
    return cls().eval()


def _inputs(kind: str):
    if kind == "tied":
        return (torch.randint(0, 64, (1, 5)),)
    return (torch.randn(2, 4 if kind == "mutable" else 8),)


@functools.cache
def manager(kind: str):
    """An ``ExecutorchProgramManager`` for ``kind``:

    * ``plain``: constants in the .pte constant segment;
    * ``mutable``: a constant segment and a mutable-data segment;
    * ``xnnpack``: one XNNPACK delegate blob and its weights as .pte named data;
    * ``external``: ``external_constants=True``: the .pte is a raw flatbuffer and
      ``_default_external_constant.ptd`` holds the four constants;
    * ``xnnpack_ptd``: XNNPACK with its weights tagged ``model``, so ``model.ptd``;
    * ``tied``: XNNPACK on a tied embedding: the same 4096 bytes as a program
      constant and as XNNPACK named data.
    """
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    m = model(kind)
    args = _inputs(kind)
    torch.manual_seed(0)
    ep = torch.export.export(m, args, strict=True)
    config: dict = {}
    if kind == "xnnpack_ptd":
        from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

        module = ep.module()
        delegate_external_constants_pass_unlifted(module, lambda node: "model")
        ep = torch.export.export(module, args, strict=True)
    if kind == "external":
        config["external_constants"] = True
    if kind == "mutable":
        from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

        config["passes"] = [InitializedMutableBufferPass(["count"])]
    partitioner = None
    if kind in ("xnnpack", "xnnpack_ptd", "tied"):
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioner = [XnnpackPartitioner()]
    edge = to_edge_transform_and_lower(ep, partitioner=partitioner)
    return edge.to_executorch(ExecutorchBackendConfig(**config))


def write_reference(kind: str, folder, name: str = "model.pte") -> dict[str, str]:
    """Write ``manager(kind)`` with upstream's ``write_to_file`` and
    ``write_tensor_data_to_file`` into ``folder``; ``{file name: path}``."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    mgr = manager(kind)
    with open(os.path.join(folder, name), "wb") as f:
        mgr.write_to_file(f)
    if mgr._tensor_data:
        mgr.write_tensor_data_to_file(folder)
    return {n: os.path.join(folder, n) for n in sorted(os.listdir(folder))}


def param_bytes(kind: str, name: str) -> bytes:
    """The bytes of parameter ``name`` of ``model(kind)`` (float32, contiguous)."""
    return dict(model(kind).named_parameters())[name].detach().contiguous().numpy().tobytes()


def assert_only(folder, names: Iterable[str]) -> None:
    """``folder`` holds exactly ``names``: no temp or stray file was left."""
    assert sorted(os.listdir(os.fspath(folder))) == sorted(names)


def patched(path, offset: int, data: bytes, out=None) -> str:
    """Copy ``path`` to ``out`` (default: in place) with ``data`` written at ``offset``."""
    with open(path, "rb") as f:
        content = bytearray(f.read())
    content[offset : offset + len(data)] = data
    out = out or path
    with open(out, "wb") as f:
        f.write(content)
    return os.fspath(out)


def truncated(path, nbytes: int, out) -> str:
    """Copy the first ``nbytes`` of ``path`` to ``out``."""
    with open(path, "rb") as f:
        content = f.read(nbytes)
    with open(out, "wb") as f:
        f.write(content)
    return os.fspath(out)
