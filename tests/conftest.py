"""Shared fixtures: small real exports (fixed seeds) and the reference serializer's files."""

from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

warnings.filterwarnings("ignore")

# Every run draws the same examples (a seed per test, from its code): a property
# test fails on every run or on none, never by chance on one CI run. No deadline
# and no speed health check: a loaded 2-core machine must not fail a test by its
# timing. `pytest --hypothesis-profile=explore` draws new examples (to hunt bugs).
_PROFILE = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("ptdstream", derandomize=True, database=None, **_PROFILE)
settings.register_profile("explore", **_PROFILE)
settings.load_profile("ptdstream")
# The CLI's messages are one line unless PTDSTREAM_DEBUG is set: a developer's
# shell must not change what the tests (and the commands they start) see.
os.environ.pop("PTDSTREAM_DEBUG", None)


class Mlp(torch.nn.Module):
    def __init__(self, d_in: int = 64, d_hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(d_in, d_hidden)
        self.l2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class TiedLM(torch.nn.Module):
    """A tiny LM whose 512x64 embedding is tied to the output projection."""

    def __init__(self, vocab: int = 512, dim: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


class WithBuffer(torch.nn.Module):
    """A model with a mutable buffer (a running state updated in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(16, 16)
        self.register_buffer("state", torch.arange(16, dtype=torch.float32))

    def forward(self, x):
        self.state.add_(x.sum(0))
        return self.l(x) + self.state


def example_inputs(model: torch.nn.Module):
    if isinstance(model, TiedLM):
        return (torch.randint(0, 512, (1, 8)),)
    if isinstance(model, WithBuffer):
        return (torch.randn(2, 16),)
    return (torch.randn(2, 64),)


def export(models, *, xnnpack: bool = False, config=None, inputs=None):
    """``torch.export`` -> ``to_edge_transform_and_lower`` -> ``to_executorch``.

    ``models`` is a module or ``{method: (module, inputs)}``.
    """
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    torch.manual_seed(0)
    if isinstance(models, torch.nn.Module):
        programs = torch.export.export(models.eval(), inputs or example_inputs(models))
    else:
        programs = {
            name: torch.export.export(m.eval(), args) for name, (m, args) in models.items()
        }
    partitioner = None
    if xnnpack:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioner = [XnnpackPartitioner()]
    edge = to_edge_transform_and_lower(programs, partitioner=partitioner)
    return edge.to_executorch(config or ExecutorchBackendConfig())


def reference_files(manager, folder: str) -> dict[str, bytes]:
    """What upstream's write_to_file + write_tensor_data_to_file put in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.pte"), "wb") as f:
        manager.write_to_file(f)
    if manager._tensor_data:
        manager.write_tensor_data_to_file(folder)
    return read_folder(folder)


def export_xnnpack_mlp_tagged(folder) -> tuple:
    """``Mlp`` lowered to XNNPACK with its weights tagged into ``w.ptd`` (executorch's
    ``delegate_external_constants_pass_unlifted``), written by upstream to ``folder``;
    returns the paths of ``model.pte`` and ``w.ptd``."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

    torch.manual_seed(0)
    example = (torch.randn(2, 64),)
    unlifted = torch.export.export(Mlp().eval(), example, strict=False).module()
    delegate_external_constants_pass_unlifted(unlifted, gen_tag_fn=lambda node: "w")
    edge = to_edge_transform_and_lower(torch.export.export(unlifted, example, strict=False),
                                       partitioner=[XnnpackPartitioner()])
    reference_files(edge.to_executorch(ExecutorchBackendConfig()), str(folder))
    return os.path.join(folder, "model.pte"), os.path.join(folder, "w.ptd")


def mapped_rss(path) -> int:
    """Bytes of ``path``'s mappings resident in this process (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def mapping_rss(address: int) -> int:
    """Bytes of the one mapping holding ``address`` resident in this process (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's header line
                start, stop = (int(x, 16) for x in head.split("-"))
                inside = start <= address < stop
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


#: ``statfs`` ``f_type`` of the file systems whose files are their pages in memory
#: (``linux/magic.h``): there no page can leave the page cache.
_IN_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def skip_unless_pages_can_drop(folder) -> None:
    """Skip the test where ``folder`` lies on a tmpfs or ramfs (``/tmp`` is one on
    many systems): its bounds on the bytes of a file left in the page cache cannot
    hold there. Decided by the file system's type, never by a measurement."""
    import ctypes

    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first word
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(str(folder)), buf) != 0:
        return
    kind = _IN_MEMORY_FS.get(ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF)
    if kind is not None:
        pytest.skip(f"{folder} is on a {kind}: its files never leave the page cache (give --basetemp on disk)")


def read_folder(folder: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


def write_two_file_set(folder, version: int) -> None:
    """Save a two-file set (a.ptd, b.ptd) into ``folder`` whose files both differ between versions."""
    from ptdstream.save import write_data_files
    from ptdstream.store import StreamingNamedDataStore

    store = StreamingNamedDataStore()
    g = torch.Generator().manual_seed(version)
    for tag in ("a", "b"):
        store.add_named_data(f"{tag}.w", torch.randn(64 + version, generator=g), alignment=16, external_tag=tag)
    write_data_files(store, str(folder))


@functools.cache
def _seeded(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return {"mlp": Mlp, "tied": TiedLM, "buffer": WithBuffer}[name]()


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return Mlp()


@pytest.fixture
def tied_lm():
    torch.manual_seed(0)
    return TiedLM()
