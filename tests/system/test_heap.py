"""glibc's heap policy: a fixed mmap threshold gives each large block its own mapping."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
from _procs import SAFETY_S

CHILD = r"""
import ctypes, mmap
from ptdstream.system.heap import MMAP_THRESHOLD_NBYTES, fix_mmap_threshold
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
# glibc raises its threshold to the largest mapped block freed: a 16 MiB one here
libc.free(libc.malloc(16 << 20))
before = [libc.malloc(MMAP_THRESHOLD_NBYTES + 4096) for _ in range(4)]
print(fix_mmap_threshold(), fix_mmap_threshold())
libc.free(libc.malloc(16 << 20))
after = [libc.malloc(MMAP_THRESHOLD_NBYTES + 4096) for _ in range(4)]
def own_mapping(p):  # a mapped chunk: its header fills the first 16 bytes of a page
    return p % mmap.PAGESIZE == 16
print(sum(map(own_mapping, before)), sum(map(own_mapping, after)))
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="not glibc: no mallopt")
def test_a_fixed_threshold_maps_each_large_block_even_after_a_larger_one_was_freed():
    # in a child: the setting lasts for the rest of the process
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=SAFETY_S)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "True", "0", "4"]
