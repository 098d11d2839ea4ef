"""``fp8ptq.usage``: the one timing line and JSON fields every command reports (quantize, eval,
sensitivity and validate assert them in their own CLI tests)."""

import json
import re
import subprocess
import sys

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
