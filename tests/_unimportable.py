"""Run a command line in a fresh interpreter where some packages cannot be imported.

A ``sitecustomize`` put first on ``PYTHONPATH`` inserts a meta-path finder that
raises ``ImportError`` for the top-level names in ``PTDSTREAM_TEST_UNIMPORTABLE``:
a command that answers a usage error or a missing file before it imports torch (or
the flatbuffer readers) gives its one line; one that imports them first fails
with the ImportError instead. So the order of checks is tested by the answer,
not by a clock.
"""

from __future__ import annotations

import os
import subprocess
import sys

from _procs import SAFETY_S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The heavy imports a usage answer must not need: torch and what loads it, and the
#: readers' numpy/flatbuffers and pack's zstandard.
HEAVY = ("torch", "torchao", "executorch", "transformers", "optimum", "numpy", "flatbuffers", "zstandard")

SITECUSTOMIZE = '''
import os, sys

_REFUSED = frozenset(os.environ["PTDSTREAM_TEST_UNIMPORTABLE"].split(","))


class _Unimportable:
    """Refuses the packages the test made unimportable."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _REFUSED:
            raise ImportError(f"{name}: made unimportable by the test")
        return None


sys.meta_path.insert(0, _Unimportable())
'''


def run_without(folder, argv, unimportable=HEAVY, cwd=None, stdin=None, timeout=SAFETY_S):
    """Run ``[python, *argv]`` with ``unimportable`` refused (the sitecustomize is
    written into ``folder``): the completed process (text)."""
    site = os.path.join(os.fspath(folder), "unimportable-site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, ROOT]),
               PTDSTREAM_TEST_UNIMPORTABLE=",".join(unimportable))
    env.pop("PTDSTREAM_DEBUG", None)
    return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, stdin=stdin, capture_output=True, text=True,
                          env=env, timeout=timeout)
