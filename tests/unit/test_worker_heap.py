"""A worker keeps freed heap between batches: a block freed and asked for again costs no new page
faults, where glibc's defaults hand it back to the OS and fault it in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_PROBE = """
import ctypes, resource, sys
from actlake.jobs.extract.worker import keep_freed_heap
if sys.argv[1] == "keep":
    assert keep_freed_heap()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 24 << 20  # a batch's tensor: below the 32 MiB mmap threshold set, above glibc's starting one
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[1])
"""


def _second_round_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_freed_heap_is_kept_for_the_next_batch():
    default = _second_round_faults("default")  # 6,144 on 4 KiB pages; fewer with transparent huge pages
    kept = _second_round_faults("keep")
    assert kept <= default // 10, (kept, default)  # a glibc that keeps the block by itself: both 0
