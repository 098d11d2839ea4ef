"""``fp8ptq.runtime.usage``: the one timing line and JSON fields every command reports (quantize,
eval,
sensitivity and validate assert them in their own CLI tests)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fp8ptq.io.source import GGUF_EXPANSION, weights_on_disk
from fp8ptq.runtime import usage as usage_module
from fp8ptq.runtime.usage import (
    MMAP_THRESHOLD,
    ROOMY_MMAP_THRESHOLD,
    _glibc_version,
    _thp_mode,
    available_bytes,
    heap_threshold,
    hugepage_env,
    time_line,
    timed,
    usage,
)

pytestmark = pytest.mark.slow  # every test here runs over ~5 s (see pyproject.toml)


def test_time_line_and_json_fields():
    seconds = {"load": 1.234, "plan": 0.01, "write": 0.0, "quantize": 12.06}
    line = time_line(seconds, always=("write",))
    assert re.fullmatch(r"time: load 1\.2s, write 0\.0s, quantize 12\.1s; "
                        r"peak RSS \d+ MiB( in \w+)?", line)
    assert time_line({}).startswith("time: -; peak RSS ")
    assert time_line({"x": 0.0}, min_seconds=0).startswith("time: x 0.0s;")
    fields = usage(seconds)
    assert fields["seconds"] == {"load": 1.234, "plan": 0.01, "write": 0.0, "quantize": 12.06}
    assert fields["peak_rss_mb"] > 0
    assert "peak_gpu_mb" not in fields and "GPU" not in line  # CUDA never used here
    acc: dict = {}
    with timed(acc, "a"):
        pass
    with timed(acc, "a"):
        sum(range(10000))
    assert set(acc) == {"a"} and acc["a"] > 0


def test_peak_gpu_memory_is_reported_where_cuda_was_used(monkeypatch):
    """Two devices used, 3 and 1.5 MiB allocated at their peaks: 4.5 MiB beside the RSS."""
    import torch
    peaks = {0: 3 * 2**20, 1: 3 * 2**19}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peaks[d])
    assert usage({"load": 1.0})["peak_gpu_mb"] == 4.5
    assert re.fullmatch(r"time: load 1\.0s; peak RSS \d+ MiB( in \w+)?, peak GPU 4 MiB",
                        time_line({"load": 1.0}))


def test_peak_rss_is_the_process_high_water_mark():
    """A fresh process that touches 300 MiB more than its peak so far reports a peak at least
    that much above its current resident memory, and the peak stays after the memory is freed
    (a high-water mark, as /usr/bin/time -v)."""
    code = """
import json, os
from fp8ptq.runtime.usage import peak_rss_mb
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


def test_the_line_names_the_stage_the_peak_was_reached_in():
    """A fresh process whose "load" touches 300 MiB and whose "quantize" touches little: the
    peak is load's, not quantize's (a first GGUF load's conversion read as the quantize
    step's peak otherwise); a later stage that raises the peak takes it over."""
    code = """
import json, os
import torch
from fp8ptq.runtime.usage import peak_stage, time_line, timed, usage
seconds = {}
before = peak_stage()
with timed(seconds, "load"):
    x = torch.ones(300 * 2**18); del x
with timed(seconds, "quantize"):
    y = torch.ones(2**10)
first = (time_line(seconds), usage(seconds)["peak_rss_stage"])
import resource
peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # past every earlier stage's
with timed(seconds, "write"):
    z = torch.ones((peak_kib + 200 * 1024) * 256); del z
print(json.dumps([before, *first, time_line(seconds), peak_stage()]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    before, line, stage, line2, stage2 = json.loads(out.stdout)
    assert before is None
    assert re.search(r"; peak RSS \d+ MiB in load$", line) and stage == "load"
    assert line2.endswith(" in write") and stage2 == "write"


_HEAP_PROBE = """
import ctypes, sys, torch
from fp8ptq.runtime.usage import bound_heap
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


def test_hugepage_env_leaves_what_it_cannot_improve_alone():
    env = {"PATH": "/bin"}
    assert hugepage_env(env, "madvise", (2, 36)) == {"PATH": "/bin",
                                                     "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert hugepage_env(env, "madvise", (2, 34)) is None  # no such tunable before 2.35
    assert hugepage_env(env, "always", (2, 36)) is None  # huge pages already
    assert hugepage_env(env, "never", (2, 36)) is None
    assert hugepage_env(env, "madvise", None) is None  # not glibc
    # the user's own tunables win, an empty value included (the way to keep 4 KiB pages)
    assert hugepage_env({**env, "GLIBC_TUNABLES": ""}, "madvise", (2, 36)) is None


def test_command_name_skips_options_and_their_values():
    from fp8ptq.runtime.usage import command_name
    assert command_name(["fp8ptq", "--debug", "quantize", "m", "--format", "e4m3"]) == "quantize"
    assert command_name(["fp8ptq", "--verbose", "--debug", "eval", "x"]) == "eval"
    assert command_name(["fp8ptq", "--help"]) is None
    assert command_name(["fp8ptq"]) is None
    # a group option that takes a value must be named, else its value is taken for the command
    assert command_name(["fp8ptq", "--log", "eval", "quantize"]) == "eval"
    assert command_name(["fp8ptq", "--log", "eval", "quantize"], frozenset({"--log"})) == "quantize"
    assert command_name(["fp8ptq", "--log=eval", "quantize"], frozenset({"--log"})) == "quantize"
    assert command_name(["fp8ptq", "--", "quantize"]) == "quantize"


def test_group_value_options_match_the_click_group():
    """``fp8ptq.cli`` finds the subcommand before click is imported, so it must know which of
    the group's options take a value: this fails when one is added without naming it there."""
    from fp8ptq.cli.entry import GROUP_VALUE_OPTIONS
    from fp8ptq.cli.main import main
    taking_value = {name for p in main.params if not getattr(p, "is_flag", False)
                    and getattr(p, "nargs", 1) != 0 for name in p.opts}
    assert taking_value == set(GROUP_VALUE_OPTIONS)


_THP_PROBE = """
import os
from fp8ptq.runtime.usage import bound_heap, exec_with_hugepages
exec_with_hugepages()
import torch
bound_heap()
x = torch.ones(64 << 18)  # 64 MiB, its own mapping under bound_heap, touched
huge = [line.split()[1] for line in open("/proc/self/smaps_rollup") if "AnonHuge" in line]
print(os.environ.get("GLIBC_TUNABLES"), int(huge[0]) >> 10)
"""


def _thp_available() -> bool:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    return hugepage_env(env, _thp_mode(), _glibc_version()) is not None


@pytest.mark.skipif(not _thp_available(), reason="needs glibc >= 2.35 and THP in madvise mode")
def test_exec_with_hugepages_backs_large_tensors_with_huge_pages():
    """The re-executed process has the tunable and its 64 MiB tensor sits in 2 MiB pages; with
    the tunable set empty by the user nothing is re-executed and no huge page is used."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    run = subprocess.run([sys.executable, "-c", _THP_PROBE], capture_output=True, text=True,
                         env=env)
    assert run.returncode == 0, run.stderr
    tunable, huge_mib = run.stdout.split()
    assert tunable == "glibc.malloc.hugetlb=1" and int(huge_mib) >= 32
    run = subprocess.run([sys.executable, "-c", _THP_PROBE], capture_output=True, text=True,
                         env={**env, "GLIBC_TUNABLES": ""})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["", "0"] or run.stdout.split() == ["0"]


@pytest.mark.skipif(not _thp_available(), reason="needs glibc >= 2.35 and THP in madvise mode")
def test_fp8ptq_quantize_reexecutes_once_before_torch(tmp_path):
    """``quantize`` through both entry points starts twice (the second start with the tunable)
    and then runs; another subcommand (``eval``, whose peak RSS huge pages raise) and a program
    that merely imports fp8ptq.cli start once. Seen through a ``sitecustomize`` that logs each
    interpreter start's GLIBC_TUNABLES."""
    log = tmp_path / "starts.log"
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nwith open(os.environ['STARTS_LOG'], 'a') as f:\n"
        "    f.write(os.environ.get('GLIBC_TUNABLES', '-') + '\\n')\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update(PYTHONPATH=str(tmp_path), STARTS_LOG=str(log))
    script = Path(sys.executable).parent / "fp8ptq"
    entries = [[sys.executable, "-m", "fp8ptq.cli"]] + ([[str(script)]] if script.is_file() else [])
    for entry in entries:
        for args, starts in ((["--debug", "quantize", "--help"], ["-", "glibc.malloc.hugetlb=1"]),
                             (["eval", "--help"], ["-"])):
            log.unlink(missing_ok=True)
            run = subprocess.run(entry + args, capture_output=True, text=True, env=env)
            assert run.returncode == 0 and "Usage" in run.stdout, run.stderr
            assert log.read_text().split() == starts, entry + args
    log.unlink(missing_ok=True)
    run = subprocess.run([sys.executable, "-c", "import fp8ptq.cli"], capture_output=True,
                         text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert log.read_text().split() == ["-"]


def test_heap_threshold_is_roomy_only_for_a_small_model_and_no_budget():
    """The bounded 1 MiB heap under a host budget, for an unknown model size or free memory,
    and for a model whose weights are large beside the free memory; 32 MiB otherwise."""
    gib = 1 << 30
    assert heap_threshold(gib, available=64 * gib) == ROOMY_MMAP_THRESHOLD
    assert heap_threshold(gib, budgeted=True, available=64 * gib) == MMAP_THRESHOLD
    assert heap_threshold(None, available=64 * gib) == MMAP_THRESHOLD
    assert heap_threshold(16 * gib, available=64 * gib) == MMAP_THRESHOLD  # an 8B in bf16
    assert heap_threshold(gib, available=8 * gib + (4 << 30) - 1) == MMAP_THRESHOLD
    assert heap_threshold(gib, available=8 * gib + (4 << 30)) == ROOMY_MMAP_THRESHOLD


def test_available_bytes_reads_memavailable(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemAvailable:   12000000 kB\n")
    assert available_bytes(str(info)) == 12000000 * 1024
    info.write_text("MemTotal:       24000000 kB\n")
    assert available_bytes(str(info)) is None
    assert available_bytes(str(tmp_path / "absent")) is None


def test_weights_on_disk_from_file_sizes(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"\0" * 100)
    assert weights_on_disk(str(tmp_path / "m.gguf")) == 100 * GGUF_EXPANSION
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 300)
    assert weights_on_disk(str(folder)) == 300
    assert weights_on_disk("org/model") is None  # a hub id: not looked up


@pytest.mark.parametrize("budget", [None, "4GiB"])
def test_quantize_command_sets_the_heap_threshold(budget, monkeypatch, tmp_path):
    """``fp8ptq quantize`` of a small model on a roomy machine raises the threshold to 32 MiB,
    and keeps the bounded heap under ``--max-memory``."""
    from click.testing import CliRunner

    from fp8ptq.cli import quantize_cmd
    seen = []
    monkeypatch.setattr(quantize_cmd, "bound_heap", seen.append)
    monkeypatch.setattr(quantize_cmd, "quantize", lambda *a, **k: None)
    monkeypatch.setattr(usage_module, "available_bytes", lambda: 64 << 30)
    (tmp_path / "m.gguf").write_bytes(b"\0" * 1000)
    args = ["quantize", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "out")]
    res = CliRunner().invoke(quantize_cmd.command, args[1:] + (["--max-memory", budget]
                                                               if budget else []))
    assert res.exit_code == 0, (res.output, res.exception)
    assert seen == [MMAP_THRESHOLD if budget else ROOMY_MMAP_THRESHOLD]
