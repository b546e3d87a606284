"""Temp files beside their targets: names, and leftovers of killed processes.

A temp file is ``.<name>.ptdstream-<pid>-<8 hex>.tmp`` in the target's folder
(so the final rename is atomic), ``.bak`` for a previous file kept while a set is
published. The name is cut and hashed when long, to stay under NAME_MAX.
"""

from __future__ import annotations

import glob
import os
from typing import List


#: Longest file-name stem kept in temp names; longer names are cut and hashed so
#: that ``.<stem>.ptdstream-<pid>-<hex>.tmp`` stays under NAME_MAX (255 bytes).
_STEM_MAX = 160


def stem(name: str) -> str:
    if len(os.fsencode(name)) <= _STEM_MAX:
        return name
    import hashlib

    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    cut = os.fsdecode(os.fsencode(name)[: _STEM_MAX - 17])
    return f"{cut}~{digest}"


def temp_name_for(target: str, suffix: str = "tmp") -> str:
    """A fresh temp path beside ``target`` (same folder, so rename is atomic).

    ``.<name>.ptdstream-<pid>-<8 hex>.<suffix>``, the name cut and hashed when
    long; ``suffix`` is ``tmp`` for data being written, ``bak`` for the previous
    file kept while a set is published.
    """
    folder, name = os.path.split(os.path.abspath(target))
    return os.path.join(
        folder, f".{stem(name)}.ptdstream-{os.getpid()}-{os.urandom(4).hex()}.{suffix}"
    )


def stale_temp_files(target: str) -> List[str]:
    """Temp and backup files of ``target`` left by processes that no longer run."""
    folder, name = os.path.split(os.path.abspath(target))
    stale = []
    pattern = os.path.join(glob.escape(folder), f".{glob.escape(stem(name))}.ptdstream-*")
    for path in sorted(glob.glob(pattern)):
        if not path.endswith((".tmp", ".bak")):
            continue
        try:
            pid = int(os.path.basename(path).rsplit(".ptdstream-", 1)[1].split("-")[0])
        except (IndexError, ValueError):
            continue
        if not _pid_alive(pid):
            stale.append(path)
    return stale


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
