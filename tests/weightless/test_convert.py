"""weights_from with a checkpoint in another float dtype than the export's, or a DCP
checkpoint: each tensor converted piece by piece into a temporary file, mapped back
and bound; the saved files are those of the export on real weights whose weights
are ``checkpoint_tensor.to(dtype)``. Temporary files never outlive the context; a
checkpoint changed after it was opened is refused by key."""

from __future__ import annotations

import os
import stat
import warnings

import pytest
import torch
from _checkpoints import save_checkpoint, state_of
from conftest import Mlp, TiedLM, example_inputs, mapping_rss, read_folder

import ptdstream
from ptdstream.errors import FormatError, IntegrityError, MissingKeyError
from ptdstream.sources.checkpoint import open_checkpoint
from ptdstream.sources.memory import MemorySource
from ptdstream.upstream import adapter
from ptdstream.weightless import BindingError, weights_from
from ptdstream.weightless.convert import ConvertDir

warnings.filterwarnings("ignore")
PTD = "_default_external_constant.ptd"


def _lower(programs):
    from executorch.exir import ExecutorchBackendConfig, to_edge

    return to_edge(programs).to_executorch(ExecutorchBackendConfig(external_constants=True))


def _save(manager, folder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    ptdstream.save(manager, str(folder / "model.pte"))


def _seeded(cls):
    torch.manual_seed(0)
    return cls().eval()


def _with_weights(cls, state, dtype):
    """A real ``cls`` whose weights are ``state``'s tensors ``.to(dtype)`` (what the export must hold)."""
    model = cls().to(dtype).eval()
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    return model


def _meta(cls, dtype):
    with torch.device("meta"):
        return cls().to(dtype)


def _inputs(cls, dtype):
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in example_inputs(cls()))


# ------------------------------------------------------------------ byte identity


@pytest.mark.parametrize(("stored", "exported"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                  (torch.float16, torch.bfloat16)],
                         ids=["bf16-to-fp32", "fp32-to-bf16", "fp16-to-bf16"])
def test_checkpoint_in_another_dtype_saves_the_converted_real_exports_bytes(tmp_path, stored, exported):
    state = {k: v.to(stored) for k, v in state_of(_seeded(Mlp)).items()}
    inputs = _inputs(Mlp, exported)
    _save(_lower(torch.export.export(_with_weights(Mlp, state, exported), inputs)), tmp_path / "real")
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    (tmp_path / "conv").mkdir()
    with weights_from(ckpt, convert_dir=tmp_path / "conv") as weights:
        program = weights.export(weights.model(_meta(Mlp, exported)), inputs)
        bound = program.state_dict["l1.weight"]
        assert bound.dtype == exported
        assert torch.equal(bound, weights.checkpoint.tensor("l1.weight").to(exported))
        assert os.listdir(tmp_path / "conv") == []  # each copy removed once mapped: the mapping keeps it
        manager = _lower(program)
        constants = adapter.manager_parts(manager).external_constant_buffer
        assert all(getattr(c, "file_mapped", False) for c in constants)  # references to the mapped copies
        _save(manager, tmp_path / "weightless")
    assert os.listdir(tmp_path / "conv") == []
    got = read_folder(str(tmp_path / "weightless"))
    assert sorted(got) == [PTD, "model.pte"]
    assert got == read_folder(str(tmp_path / "real"))


def test_dcp_checkpoint_saves_the_real_exports_bytes(tmp_path):
    real = _seeded(TiedLM)
    inputs = example_inputs(real)
    _save(_lower(torch.export.export(real, inputs)), tmp_path / "real")
    ckpt = save_checkpoint("dcp", state_of(real), tmp_path / "ckpt")
    with weights_from(ckpt, format="dcp") as weights:
        model = weights.model(TiedLM)
        program = weights.export(model, inputs)
        assert program.state_dict["head.weight"] is program.state_dict["embed.weight"]  # tied: bound once
        assert sorted(weights.converted_keys) == ["embed.weight", "mix.bias", "mix.weight"]
        folder = weights.convert_dir.folder
        assert os.path.isdir(folder) and os.listdir(folder) == []
        _save(_lower(program), tmp_path / "weightless")
    assert not os.path.exists(folder)  # the default folder goes with its files
    assert read_folder(str(tmp_path / "weightless")) == read_folder(str(tmp_path / "real"))


def _xnnpack_tagged(program, inputs):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

    unlifted = program.module()
    delegate_external_constants_pass_unlifted(unlifted, gen_tag_fn=lambda node: "w")
    return torch.export.export(unlifted, inputs, strict=False), lambda p: to_edge_transform_and_lower(
        p, partitioner=[XnnpackPartitioner()]).to_executorch(ExecutorchBackendConfig())


def test_xnnpack_tagged_weights_from_converted_copies_save_the_real_exports_bytes(tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in state_of(_seeded(Mlp)).items()}
    inputs = example_inputs(Mlp())
    program, lower = _xnnpack_tagged(torch.export.export(_with_weights(Mlp, state, torch.float32), inputs,
                                                         strict=False), inputs)
    _save(lower(program), tmp_path / "real")
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        fake, lower = _xnnpack_tagged(torch.export.export(weights.model(Mlp), inputs, strict=False), inputs)
        weights.bind(fake)
        assert len(weights.converted_keys) == 4
        manager = lower(fake)
        blobs = adapter.manager_parts(manager).named_data.buffers
        assert blobs and all(getattr(b, "file_mapped", False) for b in blobs)  # XNNPACK read the mapped copies
        _save(manager, tmp_path / "weightless")
    got = read_folder(str(tmp_path / "weightless"))
    assert sorted(got) == ["model.pte", "w.ptd"]
    assert got == read_folder(str(tmp_path / "real"))


def test_conversion_across_piece_boundaries_is_torchs_to(tmp_path):
    # values that round differently, infinities, NaN, subnormals; pieces of 6 bytes split elements
    values = torch.tensor([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -9, -65504.0, 70000.0, float("inf"), float("nan"),
                           1e-40, -0.0, 3.14159] * 7, dtype=torch.float32).reshape(7, 10)
    folder = ConvertDir(tmp_path)
    for dtype in (torch.bfloat16, torch.float16):
        got = folder.convert(MemorySource(values.numpy().tobytes()), torch.float32, dtype, (7, 10), (0, 1),
                             "test", chunk_nbytes=6)
        assert got.dtype == dtype and got.shape == (7, 10)
        assert bytes(got.contiguous().view(torch.uint8).numpy()) == bytes(values.to(dtype).view(torch.uint8).numpy())
    back = folder.convert(MemorySource(values.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()),
                          torch.bfloat16, torch.float32, (10, 7), (1, 0), "test", chunk_nbytes=6)
    assert back.stride() == (1, 10)  # the checkpoint's dim order
    assert bytes(back.t().contiguous().view(torch.uint8).numpy()) == bytes(
        values.to(torch.bfloat16).to(torch.float32).view(torch.uint8).numpy())
    assert os.listdir(tmp_path) == []  # removed once mapped
    folder.close()
    assert os.path.isdir(tmp_path)  # a folder given is kept


def test_copies_are_created_exclusive_0600_and_removed_once_mapped(tmp_path, monkeypatch):
    made = []
    real_open = os.open

    def spy(path, flags, mode=0o777, **kwargs):
        fd = real_open(path, flags, mode, **kwargs)
        if str(path).startswith(str(tmp_path)):
            made.append((os.path.basename(path), flags, mode, stat.S_IMODE(os.fstat(fd).st_mode)))
        return fd

    monkeypatch.setattr(os, "open", spy)
    folder = ConvertDir(tmp_path)
    got = folder.convert(MemorySource(b"\x80\x3f" * 4), torch.bfloat16, torch.float32, (4,), (0,), "t")
    assert torch.equal(got, torch.ones(4))
    [(name, flags, mode, on_disk)] = made
    assert name.startswith(".ptdstream-convert-0-")
    assert flags & os.O_CREAT and flags & os.O_EXCL and flags & os.O_NOFOLLOW and mode == on_disk == 0o600
    assert os.listdir(tmp_path) == [] and folder.files == []


def test_short_source_leaves_no_file(tmp_path):
    folder = ConvertDir(tmp_path)
    with pytest.raises(IntegrityError, match=r"^key 'w' \(bf16\): bytes holds 6 bytes, a torch.bfloat16 tensor "
                                             r"of shape \[4\] needs 8; nothing converted$"):
        folder.convert(MemorySource(b"\0" * 6), torch.bfloat16, torch.float32, (4,), (0,), "key 'w' (bf16)")
    assert os.listdir(tmp_path) == [] and folder.files == []


# ------------------------------------------------------------------ refusals, clean-up


def test_failed_checks_convert_nothing(tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in state_of(_seeded(Mlp)).items()}
    state["l2.bias"] = state["l2.bias"].to(torch.int64)
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    (tmp_path / "conv").mkdir()
    with weights_from(ckpt, convert_dir=tmp_path / "conv") as weights:
        program = torch.export.export(weights.model(Mlp), example_inputs(Mlp()))
        with pytest.raises(BindingError) as caught:
            weights.bind(program)
        assert os.listdir(tmp_path / "conv") == []
    assert caught.value.problems == [
        f"dtype: 'l2.bias' <- key 'l2.bias' ({ckpt}): the checkpoint holds torch.int64, the export needs "
        "torch.float32 (only float32, float16, bfloat16 are converted, to one another)"]


def test_temp_files_are_removed_after_an_exception_in_the_block(tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in state_of(_seeded(Mlp)).items()}
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    (tmp_path / "conv").mkdir()
    (tmp_path / "conv" / "mine").write_bytes(b"kept")
    with pytest.raises(KeyboardInterrupt):
        with weights_from(ckpt, convert_dir=tmp_path / "conv") as weights:
            program = weights.export(weights.model(Mlp), example_inputs(Mlp()))
            raise KeyboardInterrupt
    assert os.listdir(tmp_path / "conv") == ["mine"]  # only what it made is removed
    assert torch.equal(program.state_dict["l2.bias"], state["l2.bias"].float())  # the mapping keeps the bytes
    with pytest.raises(NotADirectoryError, match=r"convert_dir .*/nowhere: not an existing folder"):
        with weights_from(ckpt, convert_dir=tmp_path / "nowhere"):
            pass


def _scribble(path) -> None:
    with open(path, "r+b") as f:  # the last 4 bytes: the end of the last tensor's data ('l2.weight')
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")


@pytest.mark.parametrize("kind", ["mapped", "converted", "dcp"])
def test_checkpoint_changed_between_bind_and_emission_is_refused_by_key(tmp_path, kind):
    dtype = torch.bfloat16 if kind == "converted" else torch.float32
    state = {k: v.to(dtype) for k, v in state_of(_seeded(Mlp)).items()}
    ckpt = save_checkpoint("dcp" if kind == "dcp" else "safetensors", state, tmp_path / "ckpt")
    changed = os.path.join(ckpt, "__0_0.distcp") if kind == "dcp" else ckpt
    with weights_from(ckpt, format="dcp" if kind == "dcp" else "auto") as weights:
        program = weights.export(weights.model(Mlp), example_inputs(Mlp()))
        _scribble(changed)
        with pytest.raises(IntegrityError) as caught:
            _lower(program)
    message = str(caught.value)
    assert message.startswith(f"checkpoint file {changed}: changed after weights_from opened it")
    assert ("before to_executorch emitted the program (nothing emitted): 4 bound key(s) come from it: "
            "'l1.weight', 'l1.bias', 'l2.weight', 'l2.bias'; a checkpoint must not change") in message


def test_converted_checkpoint_changed_after_emission_is_refused_by_the_save_and_reported_at_exit(tmp_path):
    """The converted copies hold the values from before the change and the save reads nothing from
    the checkpoint: it refuses before its first folder step (it used to publish them), and the
    block's exit reports the keys."""
    state = {k: v.to(torch.bfloat16) for k, v in state_of(_seeded(Mlp)).items()}
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    with pytest.raises(IntegrityError) as caught:
        with weights_from(ckpt) as weights:
            manager = _lower(weights.export(weights.model(Mlp), example_inputs(Mlp())))
            _scribble(ckpt)
            with pytest.raises(IntegrityError) as refused:
                _save(manager, tmp_path / "out")
            assert str(refused.value).startswith(f"checkpoint file {os.path.realpath(ckpt)}: written to after an "
                                                 "open weights_from opened it (device, inode, size"), refused.value
    assert os.listdir(tmp_path / "out") == []
    assert f"checkpoint file {ckpt}: changed after weights_from opened it" in str(caught.value)
    assert ("before weights_from exited (its converted copies and quantized weights hold the values from before "
            "the change): 4 bound key(s) come from it: 'l1.weight'") in str(caught.value)


# ------------------------------------------------------------------ Checkpoint.tensor


def test_checkpoint_tensor_is_the_mapped_view_and_names_an_unknown_key(tmp_path):
    state = state_of(_seeded(Mlp))
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    with open_checkpoint(ckpt) as opened:
        view = opened.tensor("l1.weight")
        assert view is opened.tensor("l1.weight") and torch.equal(view, state["l1.weight"])
        with pytest.raises(MissingKeyError) as caught:
            opened.tensor("l3.weight")
        assert isinstance(caught.value, KeyError)
        assert str(caught.value) == (f"{ckpt}: no tensor 'l3.weight' in this safetensors checkpoint (4 tensors); "
                                     "check the key (or key_map)")
    dcp = save_checkpoint("dcp", state, tmp_path / "dcp")
    with open_checkpoint(dcp, "dcp") as opened:
        with pytest.raises(FormatError, match=r"key 'l1.weight': a dcp checkpoint is loaded, not memory-mapped"):
            opened.tensor("l1.weight")


def test_rows_read_for_quantization_leave_no_page_of_the_checkpoint_mapped(tmp_path):
    """Each 2-D tensor of a checkpoint read in bands of 64 KiB (weights.reading, as quantization
    reads them), bf16 to float32: after each reader closes, none of the checkpoint's pages are
    mapped into the process. Before, the window a page fault maps around its page (into the
    neighbouring tensors, which no band of this one releases) stayed: 59 MiB after the 58
    weights of an 8B-shaped model of 8 layers."""
    from ptdstream.system.pagecache import file_mapping

    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(rows, 1536).to(torch.bfloat16) for i, rows in enumerate((700, 33, 1400, 5))}
    state["norm"] = torch.ones(1536, dtype=torch.bfloat16)
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        first = weights.checkpoint.tensor("w0")
        mapping = file_mapping(first.data_ptr(), first.numel() * first.element_size())
        assert mapping is not None
        after = []
        for key in ("w0", "w1", "w2", "w3"):
            with weights.reading(key, torch.float32) as source:
                rows = state[key].shape[0]
                for r0 in range(0, rows, 10):
                    assert torch.equal(source.read(r0, min(rows, r0 + 10)), state[key][r0:r0 + 10].float())
            after.append(mapping_rss(mapping.start))
    assert after == [0, 0, 0, 0]

