"""An existing export script, unchanged, inside ``with ptdstream.weights_from(ck):``:
the model built under ``torch.device("meta")`` by the user's code, ``torch.export``,
lowered and saved with upstream's own calls, gives the same files (sha256) as
the script's run on real weights; binding is idempotent, so ``weights.export``
at either export changes nothing; a checkpoint that does not fit is refused at
lowering with every problem at once, nothing written."""

from __future__ import annotations

import hashlib
import os
import warnings

import pytest
import torch
from _checkpoints import save_checkpoint, state_of
from safetensors.torch import load_file

import ptdstream
from ptdstream.weightless import BindingError, MetaBufferError

warnings.filterwarnings("ignore")


class Net(torch.nn.Module):
    """An embedding tied to the output projection, a GELU MLP and a conv1d over tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 32)
        self.conv = torch.nn.Conv1d(32, 32, 3, padding=1)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 96, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((32,), 0.5))  # persistent: in the checkpoint

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        x = x + self.down(torch.nn.functional.gelu(self.up(x)))
        return self.head(x * self.scale)


INPUTS = (torch.tensor([[5, 17, 42, 3, 88, 1]]),)


def build(weights_file: str | None = None) -> torch.nn.Module:
    """The user's model code: built on the meta device; the real run assigns the checkpoint's tensors."""
    with torch.device("meta"):
        model = Net()
    if weights_file is not None:
        model.load_state_dict(load_file(weights_file), assign=True, strict=False)
        model.head.weight = model.embed.weight  # tied, as the model ties it
    return model.eval()


def xnnpack_script(model, out: str) -> None:
    """An XNNPACK export with its weights tagged to a .ptd, saved by upstream's own calls."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

    exported = torch.export.export(model, INPUTS)
    unlifted = exported.module()
    delegate_external_constants_pass_unlifted(unlifted, gen_tag_fn=lambda node: "model")
    exported = torch.export.export(unlifted, INPUTS)
    program = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch(
        ExecutorchBackendConfig())
    os.makedirs(out)
    with open(os.path.join(out, "model.pte"), "wb") as f:
        program.write_to_file(f)
    program.write_tensor_data_to_file(out)


def portable_script(model, out: str) -> None:
    """A portable export with external constants, saved by upstream's own calls."""
    from executorch.exir import ExecutorchBackendConfig, to_edge

    program = to_edge(torch.export.export(model, INPUTS)).to_executorch(
        ExecutorchBackendConfig(external_constants=True))
    os.makedirs(out)
    with open(os.path.join(out, "model.pte"), "wb") as f:
        program.write_to_file(f)
    program.write_tensor_data_to_file(out)


def sha256s(folder: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    return save_checkpoint("safetensors", state_of(Net().eval()), tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize("script,files", [(xnnpack_script, ["model.ptd", "model.pte"]),
                                          (portable_script, ["_default_external_constant.ptd", "model.pte"])],
                         ids=["xnnpack-tagged", "portable-external"])
def test_an_unchanged_script_inside_the_block_writes_the_real_runs_bytes(checkpoint, tmp_path, script, files):
    script(build(checkpoint), str(tmp_path / "real"))
    with ptdstream.weights_from(checkpoint) as weights:
        model = build()  # the same code, no weights loaded
        script(model, str(tmp_path / "weightless"))
        assert weights.programs_bound == 1 and len(weights.bound_keys) == len(load_file(checkpoint))
    want = sha256s(str(tmp_path / "real"))
    assert sorted(want) == files
    assert sha256s(str(tmp_path / "weightless")) == want


@pytest.mark.parametrize("first,second", [("weights.export", "weights.export"), ("weights.export", "torch"),
                                          ("torch", "weights.export")])
def test_xnnpack_reexport_binds_once_through_either_export(checkpoint, tmp_path, first, second):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

    xnnpack_script(build(checkpoint), str(tmp_path / "real"))
    with ptdstream.weights_from(checkpoint) as weights:
        def export(how, model):
            return weights.export(model, INPUTS) if how == "weights.export" else torch.export.export(model, INPUTS)

        unlifted = export(first, weights.model(build())).module()
        delegate_external_constants_pass_unlifted(unlifted, gen_tag_fn=lambda node: "model")
        exported = export(second, unlifted)  # a bound module's constants count as bound: nothing is extra
        manager = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch(
            ExecutorchBackendConfig())
        os.makedirs(tmp_path / "weightless")
        ptdstream.save(manager, str(tmp_path / "weightless" / "model.pte"))
        assert weights.programs_bound == 1 and len(weights.bound_keys) == len(load_file(checkpoint))
    assert sha256s(str(tmp_path / "weightless")) == sha256s(str(tmp_path / "real"))


def test_a_wrong_checkpoint_is_refused_at_lowering_with_every_problem(tmp_path):
    torch.manual_seed(0)
    state = state_of(Net())
    state.pop("up.bias")
    state["down.weight"] = state["down.weight"][:, :60].contiguous()
    state["conv.bias"] = state["conv.bias"].to(torch.int32)
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    with ptdstream.weights_from(ckpt):
        with pytest.raises(BindingError) as raised:
            portable_script(build(), str(tmp_path / "out"))
    problems = raised.value.problems
    assert len(problems) == 3, problems
    assert any(p.startswith("missing: 'up.bias' needs checkpoint key 'up.bias'") for p in problems)
    assert any(p.startswith("shape: 'down.weight' <- key 'down.weight'") and "[32, 60]" in p for p in problems)
    assert any(p.startswith("dtype: 'conv.bias' <- key 'conv.bias'") and "torch.int32" in p for p in problems)
    assert not (tmp_path / "out").exists()


def test_a_meta_non_persistent_buffer_is_refused_by_name_at_export(checkpoint):
    class Rotary(Net):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(32), persistent=False)

    with ptdstream.weights_from(checkpoint):
        with torch.device("meta"):
            model = Rotary()
        with pytest.raises(MetaBufferError, match=r"'inv_freq'"):
            torch.export.export(model, INPUTS)


def test_outside_the_block_a_meta_model_is_exported_as_upstream_does(checkpoint):
    with ptdstream.weights_from(checkpoint):
        pass
    with torch.device("meta"):
        model = Net()
    program = torch.export.export(model, INPUTS)  # upstream traces meta parameters (the embedding's output is meta)
    assert all(p.is_meta for p in model.parameters())
    assert all(t.is_meta for t in program.state_dict.values())


@pytest.mark.parametrize("trim", [True, False])
def test_the_heap_is_handed_back_at_each_lowering_step(checkpoint, tmp_path, monkeypatch, trim):
    """glibc's malloc_trim after torch.export, before and after each run_decompositions and before
    emission (what tracing and lowering freed; benchmarks/README.md measures it); TRIM_HEAP=False: never."""
    from ptdstream.weightless import lowering

    calls = []
    monkeypatch.setattr(lowering, "malloc_trim", lambda: calls.append(1) or True)
    monkeypatch.setattr(lowering, "TRIM_HEAP", trim)
    with ptdstream.weights_from(checkpoint):
        portable_script(build(), str(tmp_path / "out"))
    assert len(calls) == (4 if trim else 0)  # torch.export (after), run_decompositions (before, after), emission
