"""ptdstream.distributed: 1, 2 and 4 gloo ranks write the same bytes as one process
(scalars and shards holding no rows included); a failing or killed rank, or a
tensor changed after hand-over, publishes nothing; fingerprints compose across pieces.

Each group runs its scenarios one after the other (one spawn per group size)."""

from __future__ import annotations

import os

import _dist_worker as W
import pytest
import torch
import xxhash
from _procs import wait_ranks

from ptdstream.distributed.composable_fingerprint import combine, digest_piece
from ptdstream.save import write_data_files
from ptdstream.store import StreamingNamedDataStore

#: The scenarios each group size runs ("kill" ends its group: last).
SCENARIOS = {1: ["ok", "edges"], 2: ["ok", "edges", "raise", "raise-everywhere", *W.CHANGES, *W.LIES, "kill"],
             4: ["ok", "edges"]}


def _run(world: int, tmp_path, scenarios, backend: str = "gloo"):
    """Spawn ``world`` ranks running ``scenarios``; ``(out root, {scenario: {rank:
    outcome line}})`` (None for a rank that died). ``out/<scenario>/model.ptd``
    holds ``b"previous"`` before the writes that must fail."""
    import multiprocessing as mp

    root, results = tmp_path / "out", tmp_path / "results"
    results.mkdir(exist_ok=True)
    for scenario in scenarios:
        (root / scenario).mkdir(parents=True, exist_ok=True)
        if (scenario in ("raise", "raise-everywhere", "kill")
                or scenario in W.CHANGES and scenario != "change-dedup-second"
                or scenario in W.LIES and scenario != "channels-last-replicate"):
            (root / scenario / "model.ptd").write_bytes(b"previous")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=W.worker,
                         args=(r, world, str(tmp_path / "pg"), str(root), list(scenarios), str(results), backend))
             for r in range(world)]
    for p in procs:
        p.start()
    problem = wait_ranks(procs, str(results / "ready"))
    if problem is not None:
        done = sorted(p.name for p in results.iterdir() if p.is_file())
        pytest.fail(f"world {world}, scenarios {list(scenarios)}: {problem}; outcomes written: {done}")
    out = {}
    for scenario in scenarios:
        out[scenario] = {}
        for r in range(world):
            path = results / f"{scenario}.rank{r}"
            out[scenario][r] = path.read_text() if path.exists() else None
    return root, out


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """``group(world)``: the out root and outcomes of ``SCENARIOS[world]``, run once per module."""
    runs = {}

    def get(world: int):
        if world not in runs:
            runs[world] = _run(world, tmp_path_factory.mktemp(f"world{world}"), SCENARIOS[world])
        return runs[world]

    return get


def _reference(tensors, folder) -> StreamingNamedDataStore:
    """One process: ``tensors`` (whole) added in order, written by write_data_files."""
    store = StreamingNamedDataStore()
    for key, t in tensors.items():
        store.add_named_data(key, t, alignment=16, external_tag=W.tag_of(key))
    folder.mkdir()
    write_data_files(store, str(folder))
    return store


def _same_files(folder, ref, names) -> None:
    assert sorted(os.listdir(folder)) == sorted(os.listdir(ref)) == names
    for name in names:
        assert (folder / name).read_bytes() == (ref / name).read_bytes(), name


def _ok_tensors(world: int):
    tensors = dict(W.full_tensors())
    for r in range(world):
        tensors.update(W.rank_tensors(r))
    return tensors


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_write_the_single_process_bytes(tmp_path, group, world):
    root, outcomes = group(world)
    _check_ok(root / "ok", outcomes["ok"], tmp_path, world)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_over_nccl_write_the_single_process_bytes(tmp_path):
    """Two H200 ranks (NCCL), CUDA DTensor shards: the bytes of one CPU process."""
    root, outcomes = _run(2, tmp_path, ["ok"], backend="nccl")
    _check_ok(root / "ok", outcomes["ok"], tmp_path, 2)


def _check_ok(folder, outcomes, tmp_path, world: int) -> None:
    assert all(o is not None and o.startswith("ok") for o in outcomes.values()), outcomes
    store = _reference(_ok_tensors(world), tmp_path / "ref")
    _same_files(folder, tmp_path / "ref", ["extra.ptd", "model.ptd"])
    # Every payload byte was written by exactly one rank (emb_copy and the zeros deduped).
    written = sum(int(o.split()[1]) for o in outcomes.values())
    full = W.full_tensors()
    unique = sum(t.numel() * t.element_size() for k, t in full.items() if k != "emb_copy")
    assert written == unique + world * 3 * 4 * 4 + 8 * 4  # each rank's w, the zeros once
    # Every rank reports the bytes dedup saved, as the one-process store counts them.
    assert store.dedup_saved_nbytes == 10 * 6 * 4 + (world - 1) * 8 * 4
    assert [int(o.split()[2]) for o in outcomes.values()] == [store.dedup_saved_nbytes] * world


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_scalars_and_shards_without_rows_write_the_single_process_bytes(tmp_path, group, world):
    """A replicated and a Partial 0-dim DTensor, plain 0-dim tensors, Shard(0) with
    ranks holding no rows (1 row; 3 rows over 4 ranks), 0-row and 0-column tensors."""
    root, outcomes = group(world)
    assert all(o is not None and o.startswith("ok") for o in outcomes["edges"].values()), outcomes["edges"]
    tensors = {k: t for k, (t, _) in W.edge_tensors(world).items()}
    for r in range(world):
        tensors.update(W.edge_rank_tensors(r))
    _reference(tensors, tmp_path / "ref")
    _same_files(root / "edges", tmp_path / "ref", ["model.ptd"])
    written = sum(int(o.split()[1]) for o in outcomes["edges"].values())
    assert written == 4 + 8 + 3 * 4 + 3 * 2 * 4 + world * 2  # the empty ones hold no bytes


@pytest.mark.slow
def test_a_failing_rank_publishes_nothing(group):
    root, outcomes = group(2)
    assert sorted(os.listdir(root / "raise")) == ["model.ptd"]  # no new file, no temp file left
    assert (root / "raise" / "model.ptd").read_bytes() == b"previous"
    assert outcomes["raise"] == {r: "error DistributedWriteError: write the pieces: rank 1: OSError: [Errno 28] "
                                    "No space left on device (injected); nothing was published" for r in (0, 1)}


@pytest.mark.slow
def test_every_failing_rank_is_named_on_every_rank(group):
    root, outcomes = group(2)
    assert sorted(os.listdir(root / "raise-everywhere")) == ["model.ptd"]
    assert (root / "raise-everywhere" / "model.ptd").read_bytes() == b"previous"
    expected = ("error DistributedWriteError: write the pieces: rank 0: OSError: [Errno 28] No space left on device "
                "(injected on rank 0); rank 1: OSError: [Errno 28] No space left on device (injected on rank 1); "
                "nothing was published")
    assert outcomes["raise-everywhere"] == {0: expected, 1: expected}


def test_the_group_error_names_each_rank_once_per_message_and_pickles():
    import pickle

    from ptdstream.distributed import DistributedIntegrityError, DistributedWriteError
    from ptdstream.errors import IntegrityError

    e = DistributedWriteError("plan the files", {3: "OSError: y", 0: "LayoutError: x", 1: "LayoutError: x"})
    assert str(e) == "plan the files: ranks 0, 1: LayoutError: x; rank 3: OSError: y; nothing was published"
    assert e.failures == {0: "LayoutError: x", 1: "LayoutError: x", 3: "OSError: y"} and e.step == "plan the files"
    back = pickle.loads(pickle.dumps(DistributedIntegrityError("write the pieces", {1: "IntegrityError: z"})))
    assert isinstance(back, IntegrityError) and isinstance(back, DistributedWriteError)
    assert str(back) == "write the pieces: rank 1: IntegrityError: z; nothing was published"
    group_failed = DistributedWriteError("publish", {}, "RuntimeError: Connection closed by peer")
    assert str(group_failed) == ("publish: the group failed (a rank was killed, timed out or left): RuntimeError: "
                                 "Connection closed by peer; nothing was published")


@pytest.mark.slow
def test_a_killed_rank_publishes_nothing(group):
    root, outcomes = group(2)
    assert sorted(os.listdir(root / "kill")) == ["model.ptd"]
    assert (root / "kill" / "model.ptd").read_bytes() == b"previous"
    assert outcomes["kill"][1] is None, outcomes
    assert outcomes["kill"][0].startswith("error DistributedWriteError: write the pieces: the group failed (a rank "
                                          "was killed, timed out or left): RuntimeError: "), outcomes
    assert outcomes["kill"][0].endswith("; nothing was published"), outcomes


def _flipped(t: torch.Tensor, byte: int) -> bytes:
    data = bytearray(t.numpy().tobytes())
    data[byte] ^= 1
    return bytes(data)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["change-head", "change-middle", "change-last", "change-dedup-first"])
def test_a_tensor_changed_after_hand_over_is_refused(tmp_path, group, scenario):
    """Byte 0, 512 or 1023 of rank 1's ``mine`` flipped, or byte 600 of rank 0's
    ``shared`` (the written key of a dedup class), after the plan, before the write:
    refused on every rank, naming the rank, key, file and offset; nothing published."""
    root, outcomes = group(2)
    rank, key, byte, _ = W.CHANGES[scenario]
    folder = root / scenario
    assert sorted(os.listdir(folder)) == ["model.ptd"] and (folder / "model.ptd").read_bytes() == b"previous"
    handed = {**W.change_tensors(0), **W.change_tensors(1)}
    _reference(handed, tmp_path / "ref")
    original = handed[key].numpy().tobytes()
    offset = (tmp_path / "ref" / "model.ptd").read_bytes().find(original)
    if byte < 32:
        why = "its first bytes differ from the plan's"
    else:
        now, then = xxhash.xxh3_128(_flipped(handed[key], byte)).hexdigest(), xxhash.xxh3_128(original).hexdigest()
        why = f"digest {now} as written != {then} when handed over"
    expected = (f"error DistributedIntegrityError: write the pieces: rank {rank}: IntegrityError: {folder}/model.ptd "
                f"at offset {offset}: rank {rank} key {key!r} float32[256] changed after it was handed over ({why}); "
                "nothing was published")
    assert offset > 0 and outcomes[scenario] == {0: expected, 1: expected}


@pytest.mark.slow
def test_a_changed_duplicate_that_is_not_written_keeps_the_hand_over_bytes(tmp_path, group):
    """``shared_copy`` (rank 1) changed after the plan: its dedup class is written
    from ``shared`` (rank 0), so the file holds the bytes handed over, as one process."""
    root, outcomes = group(2)
    assert all(o.startswith("ok") for o in outcomes["change-dedup-second"].values()), outcomes
    _reference({**W.change_tensors(0), **W.change_tensors(1)}, tmp_path / "ref")
    _same_files(root / "change-dedup-second", tmp_path / "ref", ["model.ptd"])


@pytest.mark.slow
def test_a_candidate_changed_before_its_fingerprint_is_refused(group):
    """``near`` made equal to ``shared`` after hand-over, before the dedup digests:
    refused at the fingerprint step (not written as a duplicate of ``shared``)."""
    root, outcomes = group(2)
    folder = root / "change-before-fingerprint"
    assert sorted(os.listdir(folder)) == ["model.ptd"] and (folder / "model.ptd").read_bytes() == b"previous"
    near = W.change_tensors(1)["near"]
    now, then = xxhash.xxh3_128(_flipped(near, 500)).hexdigest(), xxhash.xxh3_128(near.numpy().tobytes()).hexdigest()
    expected = ("error DistributedIntegrityError: fingerprint the dedup candidates: rank 1: IntegrityError: rank 1 "
                f"key 'near' float32[256] changed after it was handed over (digest {now} before the plan != {then} "
                "when handed over); nothing was published")
    assert outcomes["change-before-fingerprint"] == {0: expected, 1: expected}


def _refused(root, outcomes, scenario: str, message: str) -> None:
    """``scenario`` refused on both ranks with ``message``; the folder unchanged."""
    folder = root / scenario
    assert sorted(os.listdir(folder)) == ["model.ptd"] and (folder / "model.ptd").read_bytes() == b"previous"
    assert outcomes[scenario] == {0: message, 1: message}


_DISAGREE = {
    "lie-shape": "shape [6, 3], rank 1 [2, 9]; every rank must pass the same shape",
    "lie-dtype": "dtype FLOAT, rank 1 INT; every rank must pass the same dtype",
    "lie-tag": "external tag 'tag0', rank 1 'tag1'; every rank must pass the same external tag",
    "lie-alignment": "alignment 16, rank 1 64; every rank must pass the same alignment",
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(_DISAGREE))
def test_a_dtensor_whose_ranks_disagree_is_refused_naming_both(group, scenario):
    """Rank 1 passes key ``w`` with another whole shape (the same bytes), dtype
    (the same bytes), tag or alignment than rank 0: refused on every rank, naming
    the key and both ranks' values; nothing published."""
    root, outcomes = group(2)
    _refused(root, outcomes, scenario, "error DistributedWriteError: fingerprint the dedup candidates: ranks 0, 1: "
             f"LayoutError: key 'w': rank 0 passes {_DISAGREE[scenario]} for a DTensor key; nothing was published")


@pytest.mark.slow
def test_a_shard_holding_other_rows_than_its_placement_gives_is_refused(group):
    """Shard(0) of 6 rows over 2 ranks is 3 + 3 (torch.chunk); the local tensors
    (``from_local(..., run_check=False, shape=)``) hold 2 + 4: refused on every rank."""
    root, outcomes = group(2)
    why = [f"rank {r}: LayoutError: key 'w': the local tensor has shape [{n}, 3]; the whole [6, 3] placed Shard(0) "
           f"over 2 ranks gives coordinate {r} shape [3, 3]; pass the local tensor of that shape"
           for r, n in ((0, 2), (1, 4))]
    _refused(root, outcomes, "lie-shard-rows",
             f"error DistributedWriteError: describe the pieces: {'; '.join(why)}; nothing was published")


@pytest.mark.slow
def test_a_channels_last_replicate_dtensor_writes_the_single_process_bytes(tmp_path, group):
    """Its storage bytes with dim order (0, 2, 3, 1), as one process writes it."""
    root, outcomes = group(2)
    assert all(o.startswith("ok") for o in outcomes["channels-last-replicate"].values()), outcomes
    cl = W.channels_last()
    _reference({"cl": cl}, tmp_path / "ref")
    _same_files(root / "channels-last-replicate", tmp_path / "ref", ["model.ptd"])
    data = (tmp_path / "ref" / "model.ptd").read_bytes()
    storage = cl.permute(0, 2, 3, 1).contiguous().numpy().tobytes()
    assert storage in data and cl.contiguous().numpy().tobytes() not in data


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "local"), [("channels-last-shard", [12, 4, 2, 1]),
                                                 ("channels-last-local", [12, 1, 6, 3])])
def test_a_channels_last_shard_is_refused(group, scenario, local):
    """A Shard(0) DTensor with channels_last strides (its local shards contiguous,
    as ``distribute_tensor`` makes them, or channels_last): refused on every rank."""
    root, outcomes = group(2)
    _refused(root, outcomes, scenario, "error DistributedWriteError: describe the pieces: ranks 0, 1: LayoutError: "
             f"key 'cl': a Shard(0) DTensor of strides [12, 1, 6, 3], its local tensor of strides {local}: not "
             "contiguous, so its rows are not byte ranges of the whole as one process writes it (channels_last "
             "included); make the tensor contiguous before sharding it, or pass a Replicate() DTensor; nothing was "
             "published")


@pytest.mark.parametrize("cuts", [[], [1], [7, 8, 9], [65535, 65537, 131072], [100000]])
def test_fingerprint_composes_across_any_split(cuts):
    data = bytes(torch.randint(0, 256, (200_003,), generator=torch.Generator().manual_seed(1),
                               dtype=torch.uint8).tolist())
    whole = combine(len(data), [digest_piece([data], 0)])
    bounds = [0] + cuts + [len(data)]
    parts = [digest_piece([data[a:b]], a) for a, b in zip(bounds, bounds[1:], strict=False)]
    assert combine(len(data), reversed(parts)) == whole
    changed = bytearray(data)
    changed[-1] ^= 1
    assert combine(len(data), [digest_piece([bytes(changed)], 0)]) != whole
    with pytest.raises(ValueError, match="pieces do not tile the buffer: a piece starts at 5, expected 0"):
        combine(len(data), [digest_piece([data[5:]], 5)])


def test_a_plain_tensor_the_single_process_store_refuses_is_refused_by_key():
    """Contiguous or channels_last only, as executorch's TensorLayout.from_tensor
    (and so StreamingNamedDataStore) accepts: a transposed tensor is refused,
    naming its key, before any rank plans or writes."""
    from ptdstream.distributed.local import local_pieces
    from ptdstream.errors import LayoutError

    base = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    channels_last = torch.zeros(1, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    infos, _ = local_pieces({"w": base, "cl": channels_last}, lambda key: "model", 16, 0)
    assert [(i.key, i.dim_order) for i in infos] == [("w", (0, 1)), ("cl", (0, 2, 3, 1))]
    with pytest.raises(LayoutError, match=r"^key 'w.t': Tensor is not contiguous\. Please call \.contiguous\(\)"):
        local_pieces({"w.t": base.t()}, lambda key: "model", 16, 0)


def test_a_group_failing_after_rank_0_published_says_the_set_was_published(tmp_path, monkeypatch):
    """The group fails while rank 0 broadcasts the outcome of a publish that
    succeeded (one rank, in process, its collectives faked): rank 0's error says
    the whole set was published, and the files are the one-process bytes."""
    import ptdstream.distributed.protocol as writer
    from ptdstream.distributed import DistributedWriteError

    class PublishBroadcastFails:
        def __init__(self, group=None) -> None:
            self.rank, self.world_size = 0, 1

        def all_gather(self, step, fn):
            return [fn()]

        def broadcast(self, step, fn):
            value = fn()
            if step == "publish":
                raise DistributedWriteError(step, {}, "RuntimeError: Connection closed by peer")
            return value

    monkeypatch.setattr(writer, "Collective", PublishBroadcastFails)
    tensors = W.rank_tensors(0)
    (tmp_path / "out").mkdir()
    with pytest.raises(DistributedWriteError) as caught:
        writer.write_data_files(tensors, str(tmp_path / "out"), external_tag=W.tag_of, alignment=16)
    assert str(caught.value) == ("publish: the group failed (a rank was killed, timed out or left): RuntimeError: "
                                 "Connection closed by peer; rank 0 had published the whole set")
    assert caught.value.published is True
    _reference(tensors, tmp_path / "ref")
    _same_files(tmp_path / "out", tmp_path / "ref", ["extra.ptd", "model.ptd"])
    unknown = DistributedWriteError("publish", {}, "RuntimeError: Connection closed by peer", None)
    assert str(unknown).endswith("; rank 0 may have published the whole set: look in the folder")
