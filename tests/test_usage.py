"""``fp8ptq.usage``: the one timing line and JSON fields every command reports (quantize, eval,
sensitivity and validate assert them in their own CLI tests)."""

import json
import os
import re
import subprocess
import sys

import pytest

from fp8ptq.usage import time_line, timed, usage


def test_time_line_and_json_fields():
    seconds = {"load": 1.234, "plan": 0.01, "write": 0.0, "quantize": 12.06}
    line = time_line(seconds, always=("write",))
    assert re.fullmatch(r"time: load 1\.2s, write 0\.0s, quantize 12\.1s; peak RSS \d+ MiB", line)
    assert time_line({}).startswith("time: -; peak RSS ")
    assert time_line({"x": 0.0}, min_seconds=0).startswith("time: x 0.0s;")
    fields = usage(seconds)
    assert fields["seconds"] == {"load": 1.234, "plan": 0.01, "write": 0.0, "quantize": 12.06}
    assert fields["peak_rss_mb"] > 0
    acc: dict = {}
    with timed(acc, "a"):
        pass
    with timed(acc, "a"):
        sum(range(10000))
    assert set(acc) == {"a"} and acc["a"] > 0


def test_peak_rss_is_the_process_high_water_mark():
    """A fresh process that touches 300 MiB more than its peak so far reports a peak at least
    that much above its current resident memory, and the peak stays after the memory is freed
    (a high-water mark, as /usr/bin/time -v)."""
    code = """
import json, os
from fp8ptq.usage import peak_rss_mb
import torch
current = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
before = peak_rss_mb()
extra = before - current + 300
x = torch.ones(int(extra * 2**20) // 4)
during = peak_rss_mb()
del x
print(json.dumps([current, before, during, peak_rss_mb()]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    current, before, during, after = json.loads(out.stdout)
    assert during >= before + 250 and after == during, (current, before, during)


_HEAP_PROBE = """
import ctypes, sys, torch
from fp8ptq.usage import bound_heap
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                              "usmblks", "fsmblks", "uordblks", "fordblks",
                                              "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
took = bound_heap() if sys.argv[1] == "bound" else None
x = torch.empty(4 << 20, dtype=torch.uint8); x.fill_(1); del x  # glibc now raises its threshold
before = libc.mallinfo2().hblkhd
y = torch.empty(3 << 20, dtype=torch.uint8); y.fill_(1)
print(took, (libc.mallinfo2().hblkhd - before) >> 20)
"""


def _heap_probe(mode: str, **env) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True,
                         text=True, env={**os.environ, **env})
    if out.returncode and "mallinfo2" in out.stderr:
        pytest.skip("not glibc >= 2.33")
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_bound_heap_maps_large_tensors_after_glibc_raised_its_threshold():
    """glibc's default: once a 4 MiB block was freed, a 3 MiB tensor comes from the heap (no
    new mapping), where it can stay resident after it is freed; after ``bound_heap`` it gets
    its own mapping, returned to the kernel when freed."""
    assert _heap_probe("default") == ["None", "0"]
    assert _heap_probe("bound") == ["True", "3"]
    # a user's own setting wins: bound_heap changes nothing then
    assert _heap_probe("bound", MALLOC_MMAP_THRESHOLD_="33554432") == ["False", "0"]
