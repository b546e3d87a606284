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


REUSE = r"""
import ctypes, mmap
from ptdstream.system.heap import MMAP_THRESHOLD_NBYTES, fix_mmap_threshold, reusing_heap_blocks
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def own_mapping(p):  # a mapped chunk: its header fills the first 16 bytes of a page
    return p % mmap.PAGESIZE == 16
def blocks(n):
    got = [libc.malloc(n) for _ in range(3)]
    for p in got:
        libc.free(p)
    return sum(map(own_mapping, got))
with reusing_heap_blocks():  # before the threshold is fixed: glibc's own policy, left alone
    early = blocks(8 << 20)
fix_mmap_threshold()
with reusing_heap_blocks():
    with reusing_heap_blocks():
        inside = [blocks(8 << 20), blocks(31 << 20), blocks(40 << 20)]
    still = blocks(8 << 20)
after = blocks(8 << 20)
print(early, inside, still, after)
"""

FAULTS = r"""
import ctypes, mmap, resource
from ptdstream.system.heap import fix_mmap_threshold, reusing_heap_blocks
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def faults(n, rounds):  # minor page faults of `rounds` blocks of n bytes, each touched whole, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)
        libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
fix_mmap_threshold()  # first thing, as a weights_from context does: glibc has moved no threshold yet
with reusing_heap_blocks():
    print(faults(8 << 20, 4), (8 << 20) // mmap.PAGESIZE)
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="not glibc: no mallopt")
def test_inside_reusing_heap_blocks_blocks_under_32_mib_come_from_the_heap_and_the_fixed_threshold_comes_back():
    run = subprocess.run([sys.executable, "-c", REUSE], capture_output=True, text=True, timeout=SAFETY_S)
    assert run.returncode == 0, run.stderr[-2000:]
    # glibc's own: an 8 MiB block is mapped (its starting threshold is 128 KiB); inside: heap blocks
    # under 32 MiB, a 40 MiB one mapped; the outer context still active; after: mapped again
    assert run.stdout.split("\n")[0] == "3 [0, 0, 3] 0 3"


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="not glibc: no mallopt")
def test_inside_reusing_heap_blocks_a_block_freed_at_the_top_of_the_heap_is_reused_not_faulted_in_again():
    """Four blocks of 8 MiB, each touched whole and freed: the first is faulted in, the others
    reuse its pages. Before, a block freed at the top of the heap went back to the system at once
    (glibc's trim threshold stayed at 128 KiB once the mmap threshold was fixed): four times the
    faults (found by the breaker)."""
    run = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, timeout=SAFETY_S)
    assert run.returncode == 0, run.stderr[-2000:]
    reused, one_block = map(int, run.stdout.split())
    assert reused < 2 * one_block, (reused, one_block)
