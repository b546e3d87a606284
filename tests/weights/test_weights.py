"""write_ptd: a program's .ptd from a checkpoint, byte-identical to a re-export with
those weights (executorch 1.5.1), every checkpoint kind, every mismatch at once."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from _checkpoints import save_checkpoint, state_of
from _procs import SAFETY_S
from conftest import Mlp, TiedLM, export, reference_files, skip_unless_pages_can_drop

from ptdstream.errors import CheckpointMismatchError, FormatError
from ptdstream.weights import DEFAULT_TAG, read_program_weights, write_ptd

warnings.filterwarnings("ignore")
PTD = DEFAULT_TAG + ".ptd"


class Pair(torch.nn.Module):
    """Two linears whose biases start equal (zero): upstream stores them once."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.a.bias.zero_()
            self.b.bias.zero_()

    def forward(self, x):
        return self.b(self.a(x))


class Reversed(torch.nn.Module):
    """A second method over the same layers, in the other order."""

    def __init__(self, pair: Pair) -> None:
        super().__init__()
        self.pair = pair

    def forward(self, x):
        return self.pair.a(self.pair.b(x))


def _methods(model):
    if isinstance(model, Pair):
        x = (torch.randn(2, 8),)
        return {"forward": (model, x), "backward": (Reversed(model), x)}
    return model


def _export_pair(make, folder, config):
    """Export ``make()`` with seed 0 (A) and seed 1 (B); B's model and both file sets."""
    models = {}
    files = {}
    for name, seed in (("A", 0), ("B", 1)):
        torch.manual_seed(seed)
        models[name] = make()
        files[name] = reference_files(export(_methods(models[name]), config=config), str(folder / name))
    return models["B"], files


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    from executorch.exir import ExecutorchBackendConfig

    config = ExecutorchBackendConfig(external_constants=True)
    out = {}
    for name, make in (("mlp", Mlp), ("tied", TiedLM), ("pair", Pair)):
        folder = tmp_path_factory.mktemp(name)
        model_b, files = _export_pair(make, folder, config)
        out[name] = (folder, model_b, files)
    return out



@pytest.mark.slow
@pytest.mark.parametrize("kind", ["torch", "safetensors", "hf-sharded", "dcp"])
@pytest.mark.parametrize("model", ["mlp", "tied", "pair"])
def test_ptd_equals_reexport_with_new_weights(exports, tmp_path, kind, model):
    folder, model_b, files = exports[model]
    assert files["A"]["model.pte"] == files["B"]["model.pte"]  # only the .ptd changes
    assert files["A"][PTD] != files["B"][PTD]
    ckpt = save_checkpoint(kind, state_of(model_b), tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    # The program names the tied weight 'head.weight'; safetensors and DCP keep it
    # once, as 'embed.weight' (torch.save keeps both keys over one storage).
    # The second method of 'pair' names the same weights 'pair.a.weight', ...
    key_map = {"head.weight": "embed.weight"} if model == "tied" and kind != "torch" else None
    if model == "pair":
        key_map = {"pair.": ""}
    report = write_ptd(str(folder / "A" / "model.pte"), ckpt, str(out), key_map=key_map,
                       format="dcp" if kind == "dcp" else "auto")
    assert sorted(os.listdir(out)) == [PTD]
    assert (out / PTD).read_bytes() == files["B"][PTD]
    assert report.nbytes == len(files["B"][PTD])
    assert report.keys == len(read_program_weights(str(folder / "A" / "model.pte")).keys)
    assert report.pte_classes_changed == ()


@pytest.mark.slow
def test_runtime_runs_program_a_with_weights_b(exports, tmp_path):
    from executorch.runtime import Runtime

    folder, model_b, _ = exports["mlp"]
    ckpt = save_checkpoint("safetensors", state_of(model_b), tmp_path)
    write_ptd(str(folder / "A" / "model.pte"), ckpt, str(tmp_path))
    program = Runtime.get().load_program(str(folder / "A" / "model.pte"), data_path=str(tmp_path / PTD))
    x = torch.randn(2, 64)
    (got,) = program.load_method("forward").execute([x])
    torch.testing.assert_close(got, model_b.eval()(x))


@pytest.mark.slow
def test_changed_equal_classes_are_reported_and_the_program_still_runs(tmp_path):
    """A was exported with two equal (zero) biases, B's differ: B's re-export has
    another .pte (the emitter's data_buffer_idx), the same .ptd as write_ptd
    gives, and A's .pte runs B's weights right (external tensors load by FQN)."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.runtime import Runtime

    class Single(Pair):
        def forward(self, x):
            return self.b(self.a(x))

    config = ExecutorchBackendConfig(external_constants=True)
    x = (torch.randn(2, 8),)
    torch.manual_seed(0)
    model_a = Single()
    torch.manual_seed(1)
    model_b = Single()
    for p in (model_b.a.bias, model_b.b.bias):
        torch.nn.init.normal_(p.data)
    files_a = reference_files(export(model_a, config=config, inputs=x), str(tmp_path / "A"))
    files_b = reference_files(export(model_b, config=config, inputs=x), str(tmp_path / "B"))
    assert files_a["model.pte"] != files_b["model.pte"]
    ckpt = save_checkpoint("safetensors", state_of(model_b), tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    report = write_ptd(str(tmp_path / "A" / "model.pte"), ckpt, str(out))
    assert (out / PTD).read_bytes() == files_b[PTD]
    assert report.pte_classes_changed == ("b.bias",)
    assert "note: 1 key(s) no longer share content as they did at export ('b.bias')" in report.summary()
    program = Runtime.get().load_program(str(tmp_path / "A" / "model.pte"), data_path=str(out / PTD))
    inputs = torch.randn(2, 8)
    (got,) = program.load_method("forward").execute([inputs])
    torch.testing.assert_close(got, model_b.eval()(inputs))


@pytest.mark.slow
def test_like_gives_tags_and_order_and_key_map(tmp_path):
    """A tagging callable puts keys in several files; like= recovers them; key_map renames."""
    from executorch.exir import ExecutorchBackendConfig

    def tag(node):
        return "first" if "l1" in node.name else "rest"

    config = ExecutorchBackendConfig(external_constants=tag)
    model_b, files = _export_pair(Mlp, tmp_path, config)
    assert sorted(files["B"]) == ["first.ptd", "model.pte", "rest.ptd"]
    state = {"model." + k: v for k, v in state_of(model_b).items()}
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    like = [str(tmp_path / "A" / "first.ptd"), str(tmp_path / "A" / "rest.ptd")]
    write_ptd(str(tmp_path / "A" / "model.pte"), ckpt, str(out), like=like, key_map={"": "model."})
    assert (out / "first.ptd").read_bytes() == files["B"]["first.ptd"]
    assert (out / "rest.ptd").read_bytes() == files["B"]["rest.ptd"]
    # The same from a tag callable and a key_map callable.
    out2 = tmp_path / "out2"
    out2.mkdir()
    write_ptd(str(tmp_path / "A" / "model.pte"), ckpt, str(out2),
              tag=lambda fqn: "first" if fqn.startswith("l1.") else "rest", key_map=lambda fqn: "model." + fqn)
    assert (out2 / "first.ptd").read_bytes() == files["B"]["first.ptd"]
    assert (out2 / "rest.ptd").read_bytes() == files["B"]["rest.ptd"]


@pytest.mark.slow
def test_every_mismatch_reported_at_once_and_nothing_written(exports, tmp_path):
    folder, model_b, _ = exports["mlp"]
    state = state_of(model_b)
    del state["l2.bias"]
    state["l1.weight"] = state["l1.weight"].to(torch.float16)
    state["l2.weight"] = state["l2.weight"][:4].contiguous()
    state["l1.bias"] = state["l1.bias"].clone()
    state["stray"] = torch.zeros(3)
    ckpt = save_checkpoint("torch", state, tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    (out / PTD).write_bytes(b"previous")
    with pytest.raises(CheckpointMismatchError) as info:
        write_ptd(str(folder / "A" / "model.pte"), ckpt, str(out))
    assert info.value.problems == [
        "dtype: 'l1.weight' is HALF (torch.float16) in the checkpoint, the program expects FLOAT",
        "shape: 'l2.weight' is [4, 32] in the checkpoint, the program expects [8, 32]",
        f"missing: 'l2.bias' (FLOAT[8] dim order [0]) is not in {ckpt}",
        "extra: 1 checkpoint key(s) are not weights of the program: 'stray' "
        "(allow_extra=True / --allow-extra to ignore them)",
    ]
    assert sorted(os.listdir(out)) == [PTD] and (out / PTD).read_bytes() == b"previous"


@pytest.mark.slow
def test_dim_order_mismatch_is_named(tmp_path):
    """A channels-last conv weight in the program; a row-major one in the checkpoint."""
    from executorch.exir import ExecutorchBackendConfig

    class Conv(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.conv.weight.data = self.conv.weight.data.to(memory_format=torch.channels_last)

        def forward(self, x):
            return self.conv(x)

    torch.manual_seed(0)
    model = Conv()
    manager = export(model, config=ExecutorchBackendConfig(external_constants=True),
                     inputs=(torch.randn(1, 3, 8, 8).to(memory_format=torch.channels_last),))
    files = reference_files(manager, str(tmp_path / "A"))
    layouts = read_program_weights(str(tmp_path / "A" / "model.pte")).keys
    if list(layouts["conv.weight"].dim_order) == [0, 1, 2, 3]:
        pytest.skip("export made the weight row-major: nothing to check here")
    ckpt = save_checkpoint("safetensors", state_of(model), tmp_path / "ckpt")
    with pytest.raises(CheckpointMismatchError) as info:
        write_ptd(str(tmp_path / "A" / "model.pte"), ckpt, str(tmp_path))
    assert info.value.problems == [
        f"dim order: 'conv.weight' is [0, 1, 2, 3] in the checkpoint, the program expects "
        f"{list(layouts['conv.weight'].dim_order)}"
    ]
    # A torch.save checkpoint keeps the channels-last strides: accepted, same bytes.
    ckpt = save_checkpoint("torch", {k: v.detach() for k, v in model.state_dict().items()}, tmp_path / "ckpt2")
    out = tmp_path / "out"
    out.mkdir()
    write_ptd(str(tmp_path / "A" / "model.pte"), ckpt, str(out))
    assert (out / PTD).read_bytes() == files[PTD]


def test_checkpoint_errors(tmp_path):
    from ptdstream.sources.checkpoint import open_checkpoint

    with pytest.raises(FileNotFoundError, match=r"a directory with neither model.safetensors.index.json, "
                                                r"model.safetensors, a \*.safetensors file nor .metadata"):
        open_checkpoint(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(FormatError, match="not a Hugging Face safetensors index"):
        open_checkpoint(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../x.safetensors"}}))
    with pytest.raises(FormatError, match="is not a file name in the index's folder"):
        open_checkpoint(str(tmp_path))
    (tmp_path / "s.pt").write_bytes(b"not a zip")
    with pytest.raises(FormatError, match="torch.load"):
        open_checkpoint(str(tmp_path / "s.pt"))
    torch.save([torch.zeros(2)], tmp_path / "l.pt")
    with pytest.raises(FormatError, match="holds a list, not a state dict"):
        open_checkpoint(str(tmp_path / "l.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_checkpoint_is_never_resident_whole(tmp_path, kind):
    """A 64 MiB checkpoint, written in 1 MiB pieces: at no piece more than 8 MiB of
    it is mapped into the process (each piece is read with pread and its pages
    dropped once copied)."""
    skip_unless_pages_can_drop(tmp_path)
    from conftest import mapped_rss
    from executorch.exir import ExecutorchBackendConfig

    from ptdstream.system.pagecache import resident_nbytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)]).eval()
    files = reference_files(export(model, config=ExecutorchBackendConfig(external_constants=True),
                                   inputs=(torch.randn(1, 1024),)), str(tmp_path / "A"))
    for p in model.parameters():
        torch.nn.init.normal_(p.data)
    ckpt = save_checkpoint(kind, state_of(model), tmp_path / "ckpt")
    path = ckpt
    peaks, cached = [], []
    out = tmp_path / "out"
    out.mkdir()
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    write_ptd(str(tmp_path / "A" / "model.pte"), ckpt, str(out), chunk_nbytes=1 << 20,
              progress=lambda n: (peaks.append(mapped_rss(path)), cached.append(resident_nbytes(path))))
    # bound: three read-ahead windows (read_ahead_kb, 8 MiB here), far below the 64 MiB file; a CI run
    # on a busy box saw 14.6 MiB mapped and 17 MiB cached at one piece (alone: under 8 MiB, 5 of 5)
    window = 24 << 20
    assert len(peaks) >= 64 and max(peaks) <= window, [p >> 20 for p in peaks]
    # Planning read each tensor's first bytes without leaving the file cached (it
    # did, whole, when they were read through the mapping); while writing, the
    # kernel's read-ahead (read_ahead_kb, 8 MiB here) decides what else is cached.
    assert cached[0] <= window, cached[0]
    assert (out / PTD).read_bytes() != files[PTD]  # the new weights...
    ref = reference_files(export(model, config=ExecutorchBackendConfig(external_constants=True),
                                 inputs=(torch.randn(1, 1024),)), str(tmp_path / "B"))
    assert (out / PTD).read_bytes() == ref[PTD]  # ...as a re-export writes them


@pytest.mark.slow
def test_cli(exports, tmp_path, capsys):
    from ptdstream.cli import main

    folder, model_b, files = exports["pair"]
    state = {"model." + k: v for k, v in state_of(model_b).items()}
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    pte = str(folder / "A" / "model.pte")
    assert main(["weights", pte, "--from", ckpt, "-o", str(out), "--map", "pair.=model.", "--map", "=model."]) == 0
    assert (out / PTD).read_bytes() == files["B"][PTD]
    assert "8 keys" in capsys.readouterr().out
    # out/ holds the .ptd written above: refused at once (exit 2) without -f, before the checkpoint is read
    assert main(["weights", pte, "--from", ckpt, "-o", str(out)]) == 2
    assert capsys.readouterr().err == (f"ptdstream weights: error: output {out / PTD} exists; use -f/--force to "
                                       "replace it\n")
    assert main(["weights", pte, "--from", ckpt, "-o", str(out), "-f"]) == 1
    err = capsys.readouterr().err
    assert (out / PTD).read_bytes() == files["B"][PTD]  # nothing written
    assert "missing: 'a.weight' (FLOAT[8, 8] dim order [0, 1]) is not in" in err
    assert "extra: 4 checkpoint key(s) are not weights of the program" in err


@pytest.mark.slow
def test_cli_never_unpickles_a_planted_dcp_metadata(exports, tmp_path, capsys):
    """A .metadata planted in a Hugging Face folder is not read: the command reads
    the safetensors; a DCP folder is read only with --format dcp."""
    import pickle

    from ptdstream.cli import main

    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    folder, model_b, files = exports["mlp"]
    pte = str(folder / "A" / "model.pte")
    hf = save_checkpoint("hf-sharded", state_of(model_b), tmp_path / "hf")
    (tmp_path / "hf" / ".metadata").write_bytes(pickle.dumps(Payload()))
    out = tmp_path / "out"
    out.mkdir()
    assert main(["weights", pte, "--from", hf, "-o", str(out)]) == 0
    assert not (tmp_path / "pwned").exists()
    assert (out / PTD).read_bytes() == files["B"][PTD]
    dcp = save_checkpoint("dcp", state_of(model_b), tmp_path / "d")
    (out / PTD).unlink()
    assert main(["weights", pte, "--from", dcp, "-o", str(out)]) == 1
    assert (f"ptdstream: invalid file: {dcp}: holds .metadata, a torch.distributed.checkpoint (DCP) folder: its "
            "metadata is a pickle, which runs code when read, so it is never read unasked; pass --format dcp "
            "(format='dcp') if you trust this checkpoint") in capsys.readouterr().err
    assert os.listdir(out) == []
    assert main(["weights", pte, "--from", dcp, "--format", "dcp", "-o", str(out)]) == 0
    assert (out / PTD).read_bytes() == files["B"][PTD]


def test_a_segment_alignment_that_is_not_positive_is_refused_before_anything_is_read(tmp_path):
    """0 used to reach a modulo by zero (ZeroDivisionError) after the checkpoint was read."""
    import subprocess
    import sys

    from ptdstream import write_ptd

    with pytest.raises(ValueError, match=r"^Alignment must be greater than 0, received 0\.$"):
        write_ptd(str(tmp_path / "missing.pte"), str(tmp_path / "missing.safetensors"), str(tmp_path),
                  segment_alignment=0)
    proc = subprocess.run([sys.executable, "-m", "ptdstream", "weights", str(tmp_path / "m.pte"), "--from",
                           str(tmp_path / "c.safetensors"), "-o", str(tmp_path), "--segment-alignment", "0"],
                          capture_output=True, text=True, timeout=SAFETY_S)
    assert proc.returncode == 2
    assert "--segment-alignment must be a positive number of bytes, got 0" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_a_checkpoint_rewritten_in_place_midsave_is_refused_and_nothing_published(exports, tmp_path, kind,
                                                                                   monkeypatch):
    """Rewritten after the first tensor was read (same inode and size; every tensor
    of more than 8 floats changed past its first 32 bytes): IntegrityError naming
    the checkpoint and key, never a .ptd mixing both checkpoints."""
    from _checkpoints import rewrite_in_place, untied

    import ptdstream.sources.mapped as mapped
    from ptdstream.errors import IntegrityError

    folder, model_b, _ = exports["mlp"]
    old = {k: v + 1 for k, v in state_of(model_b).items()}
    new = {k: v.clone() for k, v in old.items()}
    for v in new.values():
        if v.numel() > 8:
            v.view(-1)[-1] += 5.0
    ckpt = save_checkpoint(kind, old, tmp_path / "ckpt")
    original = mapped.MappedTensorSource.pieces
    calls = []

    def pieces(self, ring):
        calls.append(self.describe())
        if len(calls) == 2:
            rewrite_in_place(ckpt, untied(new) if kind == "safetensors" else new, kind)
        yield from original(self, ring)

    monkeypatch.setattr(mapped.MappedTensorSource, "pieces", pieces)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(IntegrityError) as e:
        write_ptd(str(folder / "A" / "model.pte"), ckpt, str(out))
    assert f"{ckpt}: key " in str(e.value) and "was written to after it was opened" in str(e.value)
    assert "nothing was published" in str(e.value)
    assert len(calls) == 2 and os.listdir(out) == []


@pytest.mark.parametrize("via", ["checkpoint", "like"])
def test_an_output_that_is_an_input_is_refused_before_anything_is_written(exports, tmp_path, via):
    """--from OUT/<tag>.ptd (a weights-only torch.save file under the output's
    name) or --like OUT/<tag>.ptd: OverwriteError naming the file; the folder is
    unchanged byte for byte (the only copy of the checkpoint kept)."""
    import shutil

    from ptdstream.errors import OverwriteError

    folder, model_b, files = exports["mlp"]
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(folder / "A" / "model.pte", out / "model.pte")
    if via == "checkpoint":
        torch.save(state_of(model_b), out / PTD)
        ckpt, like = str(out / PTD), []
    else:
        (out / PTD).write_bytes(files["A"][PTD])
        ckpt, like = save_checkpoint("safetensors", state_of(model_b), tmp_path / "ckpt"), [str(out / PTD)]
    before = {n: (out / n).read_bytes() for n in sorted(os.listdir(out))}
    with pytest.raises(OverwriteError) as e:
        write_ptd(str(out / "model.pte"), ckpt, str(out), like=like)
    assert str(e.value) == (f"output {out / PTD} is also an input: writing it would destroy the input; "
                            "choose another output path")
    assert {n: (out / n).read_bytes() for n in sorted(os.listdir(out))} == before


def test_a_method_with_several_delegates_is_named_once_with_the_cli_option_names(tmp_path):
    """Two XNNPACK partitions of one method: one line for the method, counting them,
    naming the CLI's --like/--old beside the Python arguments."""
    from ptdstream.sources.checkpoint import open_checkpoint
    from ptdstream.weights.write import ProgramWeights, plan_ptd_files

    ckpt = save_checkpoint("safetensors", {"w": torch.zeros(2)}, tmp_path / "ckpt")
    weights = ProgramWeights("model.pte", {}, (("forward", "XnnpackBackend"), ("forward", "XnnpackBackend"),
                                               ("prefill", "VulkanBackend")))
    with open_checkpoint(ckpt) as checkpoint, pytest.raises(CheckpointMismatchError) as info:
        plan_ptd_files(weights, checkpoint, str(tmp_path / "out"), allow_extra=True)
    assert info.value.problems == [
        "delegate: method 'forward' holds 2 XnnpackBackend delegates; its weights live in its blob or under keys "
        "derived from the bytes it packed, so new weights need a new .pte (re-export, or for XNNPACK: like= / "
        "--like the old .ptd files and old_checkpoint= / --old the exported weights)",
        "delegate: method 'prefill' holds a VulkanBackend delegate; its weights live in its blob or under keys "
        "derived from the bytes it packed, so new weights need a new .pte (re-export)",
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_map_to_missing_keys_is_named_as_the_problem_never_a_map_to_itself(exports, tmp_path, capsys):
    from ptdstream.cli import main

    folder, model_b, _ = exports["mlp"]
    ckpt = save_checkpoint("safetensors", state_of(model_b), tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    (out / PTD).write_bytes(b"previous")
    with pytest.raises(CheckpointMismatchError) as info:
        write_ptd(str(folder / "A" / "model.pte"), ckpt, str(out), key_map={"l1.": "x1."})
    assert info.value.problems[:2] == [
        f"missing: 'l1.weight' (looked up as 'x1.weight') (FLOAT[32, 64] dim order [0, 1]) is not in {ckpt}; the "
        "map is the problem: key_map={'l1.': 'x1.'} / --map l1.=x1. renamed it to a key "
        f"{ckpt} lacks; {ckpt} holds 'l1.weight' under the program's own name; fix or drop that map",
        f"missing: 'l1.bias' (looked up as 'x1.bias') (FLOAT[32] dim order [0]) is not in {ckpt}; the "
        "map is the problem: key_map={'l1.': 'x1.'} / --map l1.=x1. renamed it to a key "
        f"{ckpt} lacks; {ckpt} holds 'l1.bias' under the program's own name; fix or drop that map",
    ]
    assert not any("=l1." in p for p in info.value.problems)  # no map of a key to itself
    capsys.readouterr()
    assert main(["weights", str(folder / "A" / "model.pte"), "--from", ckpt, "-o", str(out),
                 "--map", "l1.=x1.", "-f"]) == 1  # -f: out/ holds a previous .ptd, kept as it is
    err = capsys.readouterr().err
    assert "--map l1.=x1. renamed it to a key" in err and "--map l1.weight=l1.weight" not in err
    assert sorted(os.listdir(out)) == [PTD] and (out / PTD).read_bytes() == b"previous"


def test_an_index_with_several_bad_shard_names_names_the_same_one_under_any_hash_seed(tmp_path):
    """The shard names are checked in sorted order: which bad name the error names
    does not depend on PYTHONHASHSEED (a set's order does)."""
    import subprocess
    import sys

    shards = {f"w{i}": f"../{name}.safetensors" for i, name in enumerate("qzamxkcb")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    code = ("import sys\nfrom ptdstream.sources.checkpoint import open_checkpoint\n"
            "try:\n    open_checkpoint(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    messages = set()
    for seed in range(6):
        env = dict(os.environ, PYTHONHASHSEED=str(seed))
        run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True,
                             text=True, timeout=SAFETY_S)
        messages.add(run.stdout.strip())
    assert messages == {f"CheckpointFileError {tmp_path / 'model.safetensors.index.json'}: shard name "
                        "'../a.safetensors' (for 1 key(s): 'w2') is not a file name in the index's folder "
                        f"{tmp_path} (a checkpoint is read only from its own folder)"}, messages
