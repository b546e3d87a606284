"""SIGKILL at 20 points of a 200 MiB save: each target is the old file or the new one.

Two versions of a ~200 MiB model (fp32, portable, external constants: a .pte and
a 192 MiB .ptd) are exported once, in this process. Each save runs in a forked
child that is killed with SIGKILL at a seeded random point, one point per
twentieth of a save's measured duration. After each kill, every target must be
the file it was before the save, byte for byte, or the complete file of the
version being saved; temp files left behind must carry ptdstream's name
(``.<name>.ptdstream-<pid>-<hex>.tmp``) and be gone once a later save has
started writing. The last, uninterrupted save must leave exactly the targets.
"""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import time

import pytest
import torch
import xxhash
from _procs import SAFETY_S, fork, wait_status
from conftest import export
from executorch.exir import ExecutorchBackendConfig

import ptdstream
from ptdstream.write.tempfiles import stale_temp_files

pytestmark = pytest.mark.slow

KILLS = 20
SEED = 20_251_130
PTD = "_default_external_constant.ptd"
PTE = "model.pte"
TARGETS = (PTD, PTE)
TEMP_RE = re.compile(r"\.(model\.pte|_default_external_constant\.ptd)\.ptdstream-(\d+)-[0-9a-f]{8}\.(tmp|bak|journal)")


class Big(torch.nn.Module):
    """Three 4096x4096 fp32 layers (192 MiB); ``bias`` adds 16 KiB and changes the .pte."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4096, 4096, bias=bias)
        self.b = torch.nn.Linear(4096, 4096, bias=False)
        self.c = torch.nn.Linear(4096, 4096, bias=False)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


@pytest.fixture(scope="module")
def managers():
    """Version "A" and version "B": every file of one differs from the other's."""
    config = ExecutorchBackendConfig(external_constants=True)
    out = {}
    for seed, (name, bias) in enumerate([("A", False), ("B", True)]):
        torch.manual_seed(seed)
        out[name] = export(Big(bias), config=config, inputs=(torch.randn(1, 4096),))
    return out


def digest(path: str) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while True:
            piece = f.read(8 << 20)
            if not piece:
                return h.hexdigest()
            h.update(piece)


def observe(folder: str):
    """``({target: digest or None}, {temp name: pid})`` of the folder now."""
    names = os.listdir(folder)
    files = {t: digest(os.path.join(folder, t)) if t in names else None for t in TARGETS}
    temps = {}
    for name in names:
        if name in TARGETS:
            continue
        match = TEMP_RE.fullmatch(name)
        assert match, f"unrecognisable file left in the folder: {name!r}"
        temps[name] = int(match.group(2))
    return files, temps


def start_save(manager, path: str) -> int:
    return fork(lambda: ptdstream.save(manager, path))


def wait(pid: int, timeout_s: float = SAFETY_S) -> int:
    """The child's wait status (it is reaped, so its pid counts as dead)."""
    return wait_status(pid, timeout_s)


def full_save(manager, path: str) -> float:
    start = time.monotonic()
    status = wait(start_save(manager, path))
    assert os.waitstatus_to_exitcode(status) == 0, "an uninterrupted save failed"
    return time.monotonic() - start


def test_sigkill_at_20_points_leaves_old_or_new_files(managers, tmp_path, capsys):
    folder = str(tmp_path)
    path = os.path.join(folder, PTE)
    rng = random.Random(SEED)

    # Complete saves: the known versions, and how long one save takes (fork to exit).
    seconds = []
    version = {}
    for name in ("B", "A"):
        seconds.append(full_save(managers[name], path))
        files, temps = observe(folder)
        assert temps == {} and None not in files.values()
        version[name] = files
    seconds.append(full_save(managers["B"], path))
    seconds.append(full_save(managers["A"], path))
    assert observe(folder) == (version["A"], {})
    for target in TARGETS:
        assert version["A"][target] != version["B"][target], f"{target}: versions must differ"
    duration = sorted(seconds[1:])[1]  # the median of the warm saves

    previous = dict(version["A"])  # what the folder holds once recovered (a whole set)
    raw_previous = previous  # what it holds before (a half-published set while a journal is pending)
    version_of_pid = {}
    outcomes = collections.Counter()
    killed_pids = []
    stale_seen = set()
    survived = 0
    for i in range(KILLS):
        name = "B" if previous[PTD] == version["A"][PTD] else "A"
        new = version[name]
        delay = (i + rng.random()) / KILLS * duration
        start = time.monotonic()
        pid = start_save(managers[name], path)
        version_of_pid[pid] = name
        time.sleep(max(0.0, start + delay - time.monotonic()))
        os.kill(pid, signal.SIGKILL)  # a zombie, if it already ended: no effect
        status = wait(pid)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        assert killed or os.waitstatus_to_exitcode(status) == 0, f"save {i} failed"
        killed_pids.append(pid)

        files, temps = observe(folder)
        for target in TARGETS:
            # A save first completes the set a killed save left half published.
            assert files[target] in (raw_previous[target], previous[target], new[target]), (
                f"kill {i} at {delay:.3f} s: {target} is neither the previous file nor "
                f"version {name}'s"
            )
            assert files[target] is not None or previous[target] is None
        # Every leftover is a temp of a killed save, and ptdstream sees it as stale.
        assert set(temps.values()) <= set(killed_pids), temps
        stale = {os.path.basename(p) for t in TARGETS for p in stale_temp_files(os.path.join(folder, t))}
        assert stale == set(temps), (stale, temps)
        # Once this save wrote anything, it had removed the older saves' temps.
        if pid in temps.values() or not killed:
            assert set(temps.values()) <= {pid}, f"kill {i}: older temps not removed: {temps}"
        if not killed:
            assert files == new and temps == {}
        stale_seen.update(temps)

        journals = [n for n in temps if n.endswith(".journal")]
        assert len(journals) <= 1, journals
        # Recovered, the folder holds one whole set: the journal's (it rolls forward)
        # or, without a journal, the files as they are.
        recovered = version[version_of_pid[temps[journals[0]]]] if journals else files
        assert recovered in (version["A"], version["B"]), f"kill {i}: a mixed set with no journal"
        outcomes["left a journal (rolled forward by the next save)"] += bool(journals)
        published = [t for t in TARGETS if files[t] == new[t] != raw_previous[t]]
        outcomes[
            "ended before the kill" if not killed
            else "nothing published" if not published
            else "only the .ptd published" if published == [PTD]
            else "both published"
        ] += 1
        outcomes["left a temp file"] += bool(temps)
        raw_previous, previous = files, recovered
        survived += 1

    # An uninterrupted save removes every temp file that killed saves left.
    final = "B" if previous[PTD] == version["A"][PTD] else "A"
    full_save(managers[final], path)
    assert observe(folder) == (version[final], {})
    assert stale_seen, "no kill left a temp file: the kills missed the writing phase"

    assert survived == KILLS
    with capsys.disabled():
        print(
            f"\ntest_crash: {survived}/{KILLS} SIGKILLs survived, spread over a {duration:.2f} s "
            f"save of {sum(os.path.getsize(os.path.join(folder, t)) for t in TARGETS) / 2**20:.0f} MiB "
            f"(complete saves: {', '.join(f'{s:.2f}' for s in seconds)} s); "
            + ", ".join(f"{k}: {n}" for k, n in sorted(outcomes.items()))
            + f"; {len(stale_seen)} temp files left and then removed"
        )
