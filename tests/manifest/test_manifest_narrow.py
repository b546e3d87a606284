"""verify --manifest names exactly the sections, keys and bytes that differ (issue 14 item 5)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import Mlp, export

from ptdstream.manifest.describe import write_manifest
from ptdstream.manifest.verify import read_manifest, verify_manifest


class TwoSizes(torch.nn.Module):
    """A 1 KiB and a 512 KiB weight: a cut at 200,000 bytes leaves the first intact."""

    def __init__(self) -> None:
        super().__init__()
        self.small = torch.nn.Linear(16, 16)
        self.big = torch.nn.Linear(16, 8192)

    def forward(self, x):
        return self.big(self.small(x))


def _write(manager, folder) -> dict:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.pte"), "wb") as f:
        manager.write_to_file(f)
    if manager._tensor_data:
        manager.write_tensor_data_to_file(folder)
    return {n: os.path.join(folder, n) for n in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from executorch.exir import ExecutorchBackendConfig

    root = tmp_path_factory.mktemp("narrow")
    torch.manual_seed(0)
    out = _write(export(TwoSizes(), inputs=(torch.randn(2, 16),),
                        config=ExecutorchBackendConfig(external_constants=True)), str(root / "ext"))
    out.update({f"xnn_{k}": v for k, v in _write(export(Mlp(), xnnpack=True), str(root / "xnn")).items()})
    return out


def _copy(src: str, folder, data: bytes) -> str:
    path = os.path.join(str(folder), os.path.basename(src))
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_a_cut_file_lists_only_the_keys_it_lost(files, tmp_path):
    ptd = files["_default_external_constant.ptd"]
    manifest = write_manifest([ptd], str(tmp_path / "m.manifest"))
    entry = manifest.files[0]
    cut = 200_000
    lost = tuple(s.key for s in entry.sections if s.key is not None and s.offset + s.nbytes > cut)
    kept = tuple(s.key for s in entry.sections if s.key is not None and s.offset + s.nbytes <= cut)
    assert kept and lost and entry.nbytes > cut
    with open(ptd, "rb") as f:
        check = verify_manifest(_copy(ptd, tmp_path, f.read(cut)), read_manifest(str(tmp_path / "m.manifest")))
    assert not check.ok
    assert check.bad_keys == lost
    assert not set(kept) & set(check.bad_keys)
    assert [s[0] for s in check.bad_sections] == [s.name for s in entry.sections if s.offset + s.nbytes > cut]
    first_lost = min(s.offset for s in entry.sections if s.offset + s.nbytes > cut)
    assert check.first_bad_offset == max(cut // 4096 * 4096, first_lost)
    assert (check.section, check.key) == ("named data", lost[0])
    assert f"size {cut} != {entry.nbytes}" in check.message


@pytest.mark.parametrize("name", ["model.pte", "_default_external_constant.ptd", "xnn_model.pte"])
def test_a_flip_in_every_section_is_placed_in_that_section(files, tmp_path, name):
    path = files[name]
    manifest = write_manifest([path], str(tmp_path / "m.manifest"))
    with open(path, "rb") as f:
        data = f.read()
    kinds = set()
    for s in manifest.files[0].sections:
        if not s.nbytes:
            continue
        kinds.add(s.name)
        at = s.offset + s.nbytes // 2
        flipped = bytearray(data)
        flipped[at] ^= 0x40
        check = verify_manifest(_copy(path, tmp_path, bytes(flipped)), manifest)
        assert not check.ok
        assert check.bad_sections == ((s.name, s.key, s.offset, s.nbytes),), (s, check.message)
        assert (check.section, check.key) == (s.name, s.key)
        assert check.first_bad_offset <= at < check.first_bad_offset + check.bad_nbytes <= s.offset + s.nbytes
        assert check.bad_nbytes <= 4096 and check.first_bad_offset >= s.offset
        keyed = {k for k, _, _ in manifest.files[0].keys} & ({s.key} if s.key else set())
        assert set(check.bad_keys) == keyed or (s.key and set(check.bad_keys) >= keyed)
        assert f"section {s.name!r} at {s.offset:,}" in check.message
    if name == "xnn_model.pte":
        assert {"extended header", "flatbuffer", "delegate blob XnnpackBackend", "named data"} <= kinds
    if name.endswith(".ptd"):
        assert {"flat tensor header", "flatbuffer", "named data"} <= kinds


def test_a_version_1_manifest_still_checks_and_names_the_key(files, tmp_path):
    """A manifest written before section digests and blocks (version 1) is read and used
    at piece granularity; key ranges still come from the manifest's own sections."""
    import dataclasses

    from ptdstream.manifest.codec import from_bytes, to_bytes

    ptd = files["_default_external_constant.ptd"]
    v2 = write_manifest([ptd], str(tmp_path / "m.manifest"))
    old = dataclasses.replace(v2, version=1, files=tuple(
        dataclasses.replace(f, block_nbytes=0, blocks=(),
                            sections=tuple(dataclasses.replace(s, digest=None) for s in f.sections))
        for f in v2.files))
    v1 = from_bytes(to_bytes(old))
    assert v1.version == 1 and v1.files[0].block_nbytes == 0
    target = next(s for s in v1.files[0].sections if s.key == "small.weight")
    with open(ptd, "rb") as f:
        data = bytearray(f.read())
    data[target.offset + 7] ^= 1
    check = verify_manifest(_copy(ptd, tmp_path, bytes(data)), v1)
    assert not check.ok and check.bad_keys == ("small.weight",)
    assert (check.first_bad_piece, check.first_bad_offset, check.key) == (0, 0, "small.weight")
