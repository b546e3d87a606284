"""weights_from: an export traced on storage-less parameters and bound to a checkpoint
saves the same bytes as the export on real weights; every checkpoint mismatch is
reported at once, by name, before anything is bound or written."""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch
from _checkpoints import safetensors_offset, save_checkpoint, state_of
from _procs import SAFETY_S
from conftest import Mlp, TiedLM, example_inputs, read_folder

import ptdstream
from ptdstream.errors import CheckpointMismatchError, StateError
from ptdstream.upstream import adapter
from ptdstream.upstream.patching import is_shadowed
from ptdstream.weightless import (
    BindingError,
    MetaBufferError,
    is_storage_less,
    storage_less_model,
    weights_from,
)

warnings.filterwarnings("ignore")
PTD = "_default_external_constant.ptd"


def _config():
    from executorch.exir import ExecutorchBackendConfig

    return ExecutorchBackendConfig(external_constants=True)


def _lower(programs):
    from executorch.exir import to_edge

    return to_edge(programs).to_executorch(_config())


def _save(manager, folder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    ptdstream.save(manager, str(folder / "model.pte"))


def _real_files(model, inputs, folder) -> dict[str, bytes]:
    """``model`` exported on its real weights, saved with ptdstream.save into ``folder``."""
    _save(_lower(torch.export.export(model, inputs)), folder)
    return read_folder(str(folder))


def _seeded(cls):
    torch.manual_seed(0)
    return cls().eval()


class Rotary(torch.nn.Module):
    """A linear and a non-persistent buffer (like rotary ``inv_freq``): not in a checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(64, 64)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 64, dtype=torch.float32) / 64)),
                             persistent=False)

    def forward(self, x):
        return self.l(x) * self.inv_freq


class Decode(torch.nn.Module):
    """A second method over the same layers as ``Mlp`` (prefill/decode sharing weights)."""

    def __init__(self, mlp) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return torch.tanh(self.mlp(x))


# ------------------------------------------------------------------ byte identity


@pytest.mark.parametrize("kind", ["safetensors", "hf-sharded", "torch"])
def test_mlp_bound_to_checkpoint_saves_the_real_exports_bytes(tmp_path, kind):
    real = _seeded(Mlp)
    inputs = example_inputs(real)
    want = _real_files(real, inputs, tmp_path / "real")
    ckpt = save_checkpoint(kind, state_of(real), tmp_path / "ckpt")
    out = tmp_path / "weightless"
    with weights_from(ckpt) as weights:
        model = weights.model(Mlp)
        assert all(is_storage_less(p) for p in model.parameters())
        manager = _lower(weights.export(model, inputs))
        _save(manager, out)
    got = read_folder(str(out))
    assert sorted(got) == ["_default_external_constant.ptd", "model.pte"]
    assert got == want


def test_tied_embedding_bound_once_saves_the_real_exports_bytes(tmp_path):
    real = _seeded(TiedLM)
    inputs = example_inputs(real)
    want = _real_files(real, inputs, tmp_path / "real")
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")  # 'head.weight' left out (tied)
    with weights_from(ckpt) as weights:
        model = weights.model(TiedLM)
        assert model.head.weight is model.embed.weight
        program = weights.export(model, inputs)
        assert program.state_dict["head.weight"] is program.state_dict["embed.weight"]
        assert not is_storage_less(program.state_dict["embed.weight"])
        _save(_lower(program), tmp_path / "weightless")
    assert read_folder(str(tmp_path / "weightless")) == want


def test_two_methods_sharing_weights_save_the_real_exports_bytes(tmp_path):
    real = _seeded(Mlp)
    x = example_inputs(real)
    programs = {"prefill": torch.export.export(real, x), "decode": torch.export.export(Decode(real).eval(), x)}
    _save(_lower(programs), tmp_path / "real")
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    # the second method names the same weights 'mlp.l1.weight'...: key_map points them at the checkpoint's
    key_map = {f"mlp.{k}": k for k in state_of(real)}
    with weights_from(ckpt, key_map) as weights:
        model = weights.model(Mlp)
        fake = {"prefill": torch.export.export(model, x), "decode": torch.export.export(Decode(model).eval(), x)}
        weights.bind(fake)
        assert fake["decode"].state_dict["mlp.l1.weight"] is fake["prefill"].state_dict["l1.weight"]
        _save(_lower(fake), tmp_path / "weightless")
    assert read_folder(str(tmp_path / "weightless")) == read_folder(str(tmp_path / "real"))


def test_meta_device_module_and_real_non_persistent_buffer(tmp_path):
    real = _seeded(Rotary)
    x = (torch.randn(2, 64),)
    want = _real_files(real, x, tmp_path / "real")
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    assert sorted(state_of(real)) == ["l.bias", "l.weight"]
    with weights_from(ckpt) as weights:
        built = weights.model(Rotary)  # from the factory: the buffer is computed
        assert torch.equal(built.inv_freq, real.inv_freq)
        with torch.device("meta"):
            meta = Mlp()
        model = weights.model(meta)  # built the usual empty way: its meta parameters are taken as storage-less
        assert model is meta and all(p.device.type == "cpu" and is_storage_less(p) for p in model.parameters())
        _save(_lower(weights.export(built, x)), tmp_path / "weightless")
    assert read_folder(str(tmp_path / "weightless")) == want


def test_emitter_keeps_references_to_the_mapped_checkpoint(tmp_path):
    real = _seeded(Mlp)
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        manager = _lower(weights.export(weights.model(Mlp), example_inputs(real)))
    parts = adapter.manager_parts(manager)
    constants = parts.external_constant_buffer
    assert len(constants) == 4
    assert all(getattr(c, "file_mapped", False) for c in constants)  # no bytes copy: views of the mapping


# ------------------------------------------------------------------ refusals


def test_every_checkpoint_mismatch_is_reported_at_once(tmp_path):
    import safetensors.torch as st

    state = state_of(_seeded(Mlp))
    del state["l2.bias"]  # missing
    state["l1.weight"] = state["l1.weight"].to(torch.int32)  # a dtype that is not converted
    state["l1.bias"] = torch.zeros(31)  # wrong shape
    state["stray"] = torch.zeros(3)  # extra
    path = tmp_path / "ckpt.safetensors"
    st.save_file(state, path)
    out = tmp_path / "out"
    out.mkdir()
    with weights_from(path) as weights:
        program = torch.export.export(weights.model(Mlp), example_inputs(Mlp()))
        with pytest.raises(BindingError) as caught:
            weights.bind(program)
    assert isinstance(caught.value, CheckpointMismatchError)
    assert caught.value.problems == [
        f"dtype: 'l1.weight' <- key 'l1.weight' ({path}): the checkpoint holds torch.int32, "
        "the export needs torch.float32 (only float32, float16, bfloat16 are converted, to one another)",
        f"shape: 'l1.bias' <- key 'l1.bias' ({path}): the checkpoint holds [31], the export needs [32]",
        "missing: 'l2.bias' needs checkpoint key 'l2.bias', which the checkpoint does not hold",
        f"extra: checkpoint key 'stray' (torch.float32 [3], {path}) is no storage-less constant of the export "
        "(pass allow_extra=True to ignore it)",
    ]
    assert str(caught.value).startswith(f"{path} does not fit the exported program's storage-less constants "
                                        "(nothing bound) (4 problem(s); nothing written):\n  dtype: ")
    assert all(is_storage_less(t) for t in program.state_dict.values())  # nothing bound
    assert os.listdir(out) == []


def test_allow_extra_ignores_unused_keys(tmp_path):
    import safetensors.torch as st

    real = _seeded(Mlp)
    state = dict(state_of(real), stray=torch.zeros(3))
    st.save_file(state, tmp_path / "ckpt.safetensors")
    want = _real_files(real, example_inputs(real), tmp_path / "real")
    with weights_from(tmp_path / "ckpt.safetensors", allow_extra=True) as weights:
        _save(_lower(weights.export(weights.model(Mlp), example_inputs(real))), tmp_path / "weightless")
    assert read_folder(str(tmp_path / "weightless")) == want


def test_a_program_never_bound_is_bound_as_it_reaches_lowering(tmp_path):
    real = _seeded(Mlp)
    want = _real_files(real, example_inputs(real), tmp_path / "real")
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        program = torch.export.export(weights.model(Mlp), example_inputs(real))  # never passed to bind
        assert all(is_storage_less(t) for t in program.state_dict.values())
        manager = _lower(program)  # to_edge's run_decompositions binds it
        assert not any(is_storage_less(t) for t in program.state_dict.values())
        assert weights.programs_bound == 1 and weights.bound_keys == ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
        _save(manager, tmp_path / "weightless")
    assert read_folder(str(tmp_path / "weightless")) == want


def test_meta_non_persistent_buffer_is_refused_by_name(tmp_path):
    ckpt = save_checkpoint("safetensors", state_of(_seeded(Rotary)), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        with torch.device("meta"):
            meta = Rotary()
        with pytest.raises(MetaBufferError, match=r"1 non-persistent buffer\(s\) on the meta device.*'inv_freq'"):
            weights.model(meta)


def test_use_after_the_block_is_refused(tmp_path):
    ckpt = save_checkpoint("safetensors", state_of(_seeded(Mlp)), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        pass
    with pytest.raises(StateError, match=r"weights_from\(...\)\.model\(\) called after its with block"):
        weights.model(Mlp)


# ------------------------------------------------------------------ scoping


def test_patches_are_restored_when_the_last_context_exits(tmp_path):
    module = adapter.program_module()
    register = torch.nn.Module.register_parameter
    ckpt = save_checkpoint("safetensors", state_of(_seeded(Mlp)), tmp_path / "ckpt")
    with weights_from(ckpt):
        with weights_from(ckpt):  # nested
            assert is_shadowed(module, "emit_program")
        assert is_shadowed(module, "emit_program")
        assert is_shadowed(adapter.emitter_module(), "bytes")
    assert is_shadowed(module, "emit_program")  # the emission check stays: a model may outlive its block
    assert not is_shadowed(adapter.emitter_module(), "bytes")
    assert torch.nn.Module.register_parameter is register
    assert all(not is_storage_less(p) for p in Mlp().parameters())  # outside the build: real parameters


def test_two_threads_export_weightless_at_once(tmp_path):
    real = _seeded(Mlp)
    want = _real_files(real, example_inputs(real), tmp_path / "real")
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    errors: list[BaseException] = []
    both_open = threading.Barrier(2, timeout=SAFETY_S)
    upstream = threading.Lock()  # torch.export itself is not thread-safe (its module hierarchy is a global)

    def job(n: int) -> None:
        try:
            with weights_from(ckpt) as weights:
                both_open.wait()
                with upstream:
                    manager = _lower(weights.export(weights.model(Mlp), example_inputs(real)))
                _save(manager, tmp_path / f"t{n}")
                both_open.wait()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=job, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert read_folder(str(tmp_path / "t0")) == want
    assert read_folder(str(tmp_path / "t1")) == want


def test_storage_less_model_of_a_factory_allocates_no_parameter():
    model = storage_less_model(lambda: torch.nn.Linear(4096, 4096))
    assert is_storage_less(model.weight) and model.weight.shape == (4096, 4096)
    assert model.weight.dtype == torch.float32 and not model.training
    with pytest.raises(TypeError, match="returned a int, not a torch.nn.Module"):
        storage_less_model(lambda: 3)


def test_checkpoint_changed_between_emission_and_save_is_refused(tmp_path):
    from ptdstream.errors import IntegrityError

    real = _seeded(Mlp)
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    with weights_from(ckpt) as weights:
        manager = _lower(weights.export(weights.model(Mlp), example_inputs(real)))
        with open(ckpt, "r+b") as f:  # the last 4 bytes: the end of the last tensor's data ('l2.weight')
            f.seek(-4, os.SEEK_END)
            f.write(b"\x01\x02\x03\x04")
        with pytest.raises(IntegrityError) as caught:
            ptdstream.save(manager, str(out / "model.pte"))
    assert os.listdir(out) == []
    message = str(caught.value)
    # the file's identity, checked at the first read (issue 32: before, the digest of 'l2.weight' once written)
    at = safetensors_offset(ckpt, "l1.weight")
    assert message.startswith(f"constant 'l1.weight' (8192 bytes at offset {at:,} of its file) uint8[8192]: "
                              f"its checkpoint file {ckpt} was "
                              "written to after it was opened"), message
    assert message.endswith("nothing is written from it: a checkpoint must not change while it is saved")


def test_constant_prop_before_binding_is_refused_by_name_and_after_binding_matches(tmp_path):
    from executorch.exir import to_edge
    from executorch.exir.passes.constant_prop_pass import constant_prop_pass

    real = _seeded(Mlp)
    x = example_inputs(real)
    edge = to_edge(torch.export.export(real, x))
    constant_prop_pass(edge.exported_program())
    _save(edge.to_executorch(_config()), tmp_path / "real")
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    early = to_edge(torch.export.export(storage_less_model(Mlp), x))  # lowered outside any block: not bound
    constant_prop_pass(early.exported_program())  # folds the transposes of storage-less weights
    with weights_from(ckpt) as weights:
        with pytest.raises(BindingError) as caught:
            weights.bind(early.exported_program())
        late = to_edge(torch.export.export(weights.model(Mlp), x))  # bound as it is lowered
        constant_prop_pass(late.exported_program())  # folded from the mapped checkpoint
        _save(late.to_executorch(_config()), tmp_path / "weightless")
    folded = ("which the checkpoint does not hold (a constant that constant_prop_pass folded from storage-less "
              "weights: it needs their values, so bind before constant_prop_pass)")
    assert [p for p in caught.value.problems if p.startswith("missing")] == [
        f"missing: '_prop_tensor_constant0' needs checkpoint key '_prop_tensor_constant0', {folded}",
        f"missing: '_prop_tensor_constant1' needs checkpoint key '_prop_tensor_constant1', {folded}",
    ]
    assert read_folder(str(tmp_path / "weightless")) == read_folder(str(tmp_path / "real"))


@pytest.mark.parametrize("target", ["model.pte", PTD, "model.manifest", "link.pte"])
def test_a_save_over_the_open_checkpoint_is_refused_and_the_checkpoint_kept(tmp_path, target):
    """The checkpoint named as a file of the set (or a symlink to it as the .pte):
    publishing would replace the user's checkpoint. Refused before anything is
    written; the checkpoint's bytes are unchanged."""
    from ptdstream.errors import OverwriteError

    real = _seeded(Mlp)
    folder = tmp_path / "out"
    folder.mkdir()
    ckpt = folder / ("model.safetensors" if target == "link.pte" else target)
    if target == "link.pte":
        import safetensors.torch as st

        st.save_file(state_of(real), ckpt)
    else:  # a name that is not .safetensors: read as torch.save's zip
        torch.save(state_of(real), ckpt)
    if target == "link.pte":
        os.symlink(ckpt.name, folder / target)
    before = ckpt.read_bytes()
    pte = folder / ("link.pte" if target == "link.pte" else "model.pte")
    with weights_from(str(ckpt)) as weights:
        manager = _lower(weights.export(weights.model(Mlp), example_inputs(real)))
        with pytest.raises(OverwriteError) as caught:
            ptdstream.save(manager, str(pte), manifest=True)
    written = str(folder / target)
    spelled = f" ({os.path.realpath(ckpt)})" if target == "link.pte" else ""
    assert str(caught.value) == (f"output {written} is a checkpoint file an open weights_from reads{spelled}: "
                                 "writing it would destroy the checkpoint; choose another output path"), caught.value
    assert ckpt.read_bytes() == before
    assert sorted(os.listdir(folder)) == sorted({ckpt.name, target})


def test_a_checkpoint_renamed_to_the_output_or_named_like_a_stale_temp_file_is_kept(tmp_path):
    """Known by device and inode, not by name: a checkpoint renamed to model.pte after it was opened
    is refused as the output; one named like a killed writer's temp file is not removed as one."""
    from ptdstream.errors import OverwriteError

    real = _seeded(Mlp)
    folder = tmp_path / "out"
    folder.mkdir()
    ckpt = folder / "model.safetensors"
    import safetensors.torch as st

    st.save_file(state_of(real), ckpt)
    before = ckpt.read_bytes()
    with weights_from(str(ckpt)) as weights:
        manager = _lower(weights.export(weights.model(Mlp), example_inputs(real)))
        os.rename(ckpt, folder / "model.pte")
        with pytest.raises(OverwriteError, match=r"^output .*/out/model\.pte is a checkpoint file an open "
                                                 r"weights_from reads \(.*/out/model\.safetensors\)"):
            ptdstream.save(manager, str(folder / "model.pte"))
        assert (folder / "model.pte").read_bytes() == before
        stale = folder / ".model.pte.ptdstream-1-deadbeef.tmp"  # a temp file's name, unlocked
        os.rename(folder / "model.pte", stale)
        (tmp_path / "elsewhere").mkdir()
        ptdstream.save(manager, str(folder / "m2.pte"))
    assert stale.read_bytes() == before
    assert sorted(os.listdir(folder)) == sorted([stale.name, "m2.pte", PTD])
