"""save(manager, path) writes exactly the reference serializer's bytes, on real exports."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import Mlp, TiedLM, WithBuffer, export, read_folder, reference_files
from executorch.exir import ExecutorchBackendConfig

import ptdstream
from ptdstream.errors import LayoutError


def assert_identical(manager, tmp_path, **save_kwargs):
    """Save with ptdstream and with upstream; every file must be byte-equal."""
    ref = reference_files(manager, str(tmp_path / "ref"))
    out = tmp_path / "out"
    out.mkdir()
    report = ptdstream.save(manager, str(out / "model.pte"), **save_kwargs)
    ours = read_folder(str(out))
    assert sorted(ours) == sorted(ref), "the same files, no stray temp file"
    for name in ref:
        assert ours[name] == ref[name], f"{name} differs from the reference"
    assert [os.path.basename(f.path) for f in report.files][-1] == "model.pte"
    assert report.nbytes == sum(len(b) for b in ref.values())
    return report, ours


@pytest.mark.parametrize("xnnpack", [False, True], ids=["portable", "xnnpack"])
def test_default_config_is_identical(tmp_path, xnnpack):
    manager = export(Mlp(), xnnpack=xnnpack)
    assert_identical(manager, tmp_path)


@pytest.mark.parametrize("xnnpack", [False, True], ids=["portable", "xnnpack"])
def test_external_constants_are_identical(tmp_path, xnnpack):
    manager = export(Mlp(), xnnpack=xnnpack, config=ExecutorchBackendConfig(external_constants=True))
    assert_identical(manager, tmp_path)


def test_pte_with_zero_segment_bytes_has_no_extended_header(tmp_path):
    manager = export(Mlp(), config=ExecutorchBackendConfig(external_constants=True))
    _, files = assert_identical(manager, tmp_path)
    pte = files["model.pte"]
    assert pte[4:8] == b"ET12" and pte[8:12] != b"eh00"
    assert "_default_external_constant.ptd" in files


@pytest.mark.parametrize("segment_alignment", [16, 4096, 16384])
@pytest.mark.parametrize("constant_tensor_alignment", [16, 64])
@pytest.mark.parametrize("xnnpack", [False, True], ids=["portable", "xnnpack"])
def test_alignment_combinations_are_identical(tmp_path, segment_alignment, constant_tensor_alignment, xnnpack):
    config = ExecutorchBackendConfig(
        segment_alignment=segment_alignment,
        constant_tensor_alignment=constant_tensor_alignment,
        delegate_alignment=64,
    )
    manager = export(Mlp(), xnnpack=xnnpack, config=config)
    # Both with the explicit config and with parameters read back from the manager.
    assert_identical(manager, tmp_path / "explicit", config=config)
    assert_identical(manager, tmp_path / "inferred")


def test_inline_delegates_when_not_extracting(tmp_path):
    config = ExecutorchBackendConfig(extract_delegate_segments=False, delegate_alignment=64)
    manager = export(Mlp(), xnnpack=True, config=config)
    report, _ = assert_identical(manager, tmp_path)
    assert report.options.extract_delegate_segments is False


def test_two_methods_sharing_weights_share_one_delegate_segment(tmp_path):
    torch.manual_seed(0)
    shared = Mlp()
    models = {"forward": (shared, (torch.randn(2, 64),)), "prefill": (shared, (torch.randn(2, 64),))}
    manager = export(models, xnnpack=True)
    _, files = assert_identical(manager, tmp_path)
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(files["model.pte"]).program
    delegates = [d for plan in program.execution_plan for d in plan.delegates]
    assert len(program.execution_plan) == 2 and len(delegates) == 2


def test_two_methods_with_external_constants_store_each_key_once(tmp_path):
    torch.manual_seed(0)
    shared = Mlp()
    models = {"forward": (shared, (torch.randn(2, 64),)), "prefill": (shared, (torch.randn(4, 64),))}
    manager = export(models, config=ExecutorchBackendConfig(external_constants=True))
    report, files = assert_identical(manager, tmp_path)
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    payload = FlatTensorSerializer().deserialize(files["_default_external_constant.ptd"])
    assert sorted(payload.named_data) == ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]
    assert len(payload.buffers) == 4


def test_tied_embedding_is_stored_once(tmp_path):
    manager = export(TiedLM(), config=ExecutorchBackendConfig(external_constants=True))
    report, files = assert_identical(manager, tmp_path)
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    payload = FlatTensorSerializer().deserialize(files["_default_external_constant.ptd"])
    embedding_nbytes = 512 * 64 * 4
    segments_of = {k: e.buffer_index for k, e in payload.named_data.items()}
    big = [k for k, i in segments_of.items() if len(payload.buffers[i]) == embedding_nbytes]
    assert len({segments_of[k] for k in big}) == 1
    unique = sum(len(b) for b in payload.buffers)
    assert len(files["_default_external_constant.ptd"]) < unique + 4096


def test_mutable_buffer_is_identical(tmp_path):
    manager = export(WithBuffer())
    assert_identical(manager, tmp_path)


def test_constants_split_between_pte_and_ptd_by_tag(tmp_path):
    def tag(node):
        return "weights_a" if "weight" in node.name else None

    manager = export(Mlp(), config=ExecutorchBackendConfig(external_constants=tag))
    _, files = assert_identical(manager, tmp_path)
    assert sorted(files) == ["model.pte", "weights_a.ptd"]


def test_two_tags_give_two_data_files(tmp_path):
    def tag(node):
        return "first" if "l1" in node.name else "second"

    manager = export(Mlp(), config=ExecutorchBackendConfig(external_constants=tag))
    _, files = assert_identical(manager, tmp_path)
    assert sorted(files) == ["first.ptd", "model.pte", "second.ptd"]


def test_save_replaces_another_models_data_file_atomically(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "_default_external_constant.ptd").write_bytes(b"another model's data")
    (out / "model.pte").write_bytes(b"another model")
    manager = export(Mlp(), config=ExecutorchBackendConfig(external_constants=True))
    ref = reference_files(manager, str(tmp_path / "ref"))
    report = ptdstream.save(manager, str(out / "model.pte"))
    assert read_folder(str(out)) == ref
    assert [os.path.basename(f.path) for f in report.files] == [
        "_default_external_constant.ptd",
        "model.pte",
    ]


def test_path_must_end_with_pte(tmp_path):
    manager = export(Mlp())
    with pytest.raises(ValueError, match=r"does not end with \.pte"):
        ptdstream.save(manager, str(tmp_path / "model.bin"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("tag", ["../x", "/abs/x", "a\0b", "sub/x"])
def test_hostile_external_tag_is_refused_before_writing(tmp_path, tag):
    manager = export(Mlp(), config=ExecutorchBackendConfig(external_constants=lambda node: tag))
    with pytest.raises(LayoutError, match="external tag"):
        ptdstream.save(manager, str(tmp_path / "model.pte"))
    assert os.listdir(tmp_path) == []


def test_recorded_config_is_used(tmp_path):
    from ptdstream.hooks.install import record_backend_configs, stop_recording_backend_configs

    record_backend_configs()
    try:
        config = ExecutorchBackendConfig(segment_alignment=4096, constant_tensor_alignment=64)
        manager = export(Mlp(), config=config)
    finally:
        stop_recording_backend_configs()
    assert manager._ptdstream_backend_config is config
    report, _ = assert_identical(manager, tmp_path)
    assert report.options.constant_tensor_alignment == 64


@pytest.mark.parametrize("tag,name", [("..", "...ptd"), ("", ".ptd"), ("a\\b", "a\\b.ptd"), ("w.ptd", "w.ptd")])
def test_odd_but_safe_tags_are_written_as_upstream_writes_them(tmp_path, tag, name):
    manager = export(Mlp(), config=ExecutorchBackendConfig(external_constants=lambda node: tag))
    _, files = assert_identical(manager, tmp_path)
    assert sorted(files) == sorted([name, "model.pte"])
