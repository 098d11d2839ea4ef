"""fp8ptq.files.atomic: every output appears complete or not at all (one mechanism for all
writers)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from fp8ptq.errors import Fp8ptqError, UsageError
from fp8ptq.files.atomic import (
    atomic_dir,
    atomic_file,
    check_writable,
    remove_stale_temporaries,
    scratch_dir,
    temporary_owner,
    write_file,
    write_text,
)


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_folder_appears_only_when_complete(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("a")
        assert not out.exists() and temporary_owner(tmp) == os.getpid()
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.fp8ptq-tmp-")
    assert names(tmp_path) == ["out"] and names(out) == ["a.txt"]


def test_failure_leaves_nothing_and_keeps_the_exception(tmp_path):
    with pytest.raises(KeyError):
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "a.txt").write_text("half")
            raise KeyError("boom")
    assert names(tmp_path) == []


def test_disk_full_is_one_line(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(Fp8ptqError) as e:
        with atomic_dir(out):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(e.value) == f"no space left on device writing {out}; nothing was written"
    assert names(tmp_path) == []
    with pytest.raises(Fp8ptqError, match="no space left on device writing .*r.json"):
        write_file(tmp_path / "r.json", lambda tmp: (_ for _ in ()).throw(
            OSError(errno.EDQUOT, "Disk quota exceeded")))
    assert names(tmp_path) == []


def test_unwritable_folder_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(Fp8ptqError, match=r"cannot write .*file/out: .*file is a file, not a "
                                          r"folder; nothing was written"):
        with atomic_dir(blocker / "out"):
            pass


def test_existing_output_is_kept_replaced_or_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(UsageError, match="created by another run"):
        with atomic_dir(out) as tmp:
            (tmp / "new.txt").write_text("new")
    assert names(out) == ["old.txt"] and names(tmp_path) == ["out"]
    with atomic_dir(out, if_exists="keep") as tmp:
        (tmp / "new.txt").write_text("new")
    assert names(out) == ["old.txt"] and names(tmp_path) == ["out"]
    with pytest.raises(RuntimeError):  # replace: the old folder stays until the new is done
        with atomic_dir(out, if_exists="replace") as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError
    assert names(out) == ["old.txt"]
    with atomic_dir(out, if_exists="replace") as tmp:
        (tmp / "new.txt").write_text("new")
    assert names(out) == ["new.txt"] and names(tmp_path) == ["out"]


def test_two_writers_one_wins_the_other_fails_cleanly(tmp_path):
    """Both write their own temporary folder at the same time and rename at the same moment:
    exactly one output, exactly one UsageError, no temporary left, never a mixed folder."""
    out = tmp_path / "out"
    barrier = threading.Barrier(2)
    outcome = {}

    def writer(tag):
        try:
            with atomic_dir(out) as tmp:
                for i in range(20):
                    (tmp / f"{i}.txt").write_text(tag)
                barrier.wait()
            outcome[tag] = "won"
        except UsageError as e:
            outcome[tag] = str(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [t for t, o in outcome.items() if o == "won"]
    assert len(won) == 1, outcome
    lost = outcome["b" if won == ["a"] else "a"]
    assert "created by another run" in lost
    assert names(tmp_path) == ["out"]
    assert {p.read_text() for p in out.iterdir()} == set(won)  # one run's files only


def test_file_keeps_its_suffix_and_the_old_content_on_failure(tmp_path):
    path = tmp_path / "plot.png"
    seen = []
    write_file(path, lambda tmp: seen.append(tmp.suffix) or tmp.write_bytes(b"one"))
    assert seen == [".png"] and path.read_bytes() == b"one"
    with pytest.raises(ValueError):
        with atomic_file(path) as tmp:
            tmp.write_bytes(b"half")
            raise ValueError
    assert path.read_bytes() == b"one" and names(tmp_path) == ["plot.png"]
    write_text(tmp_path / "sub" / "r.json", "{}")  # missing folders are made
    assert (tmp_path / "sub" / "r.json").read_text() == "{}"


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    return int(proc.stdout)


def test_stale_temporaries_of_dead_runs_are_removed(tmp_path):
    dead = _dead_pid()
    stale_dir = tmp_path / f".out.fp8ptq-tmp-{dead}-abc"
    stale_dir.mkdir()
    stale_file = tmp_path / f".out.fp8ptq-tmp-{dead}-xyz.json"
    stale_file.write_text("half")
    live = tmp_path / f".out.fp8ptq-tmp-{os.getpid()}-abc"
    live.mkdir()
    other = tmp_path / f".other.fp8ptq-tmp-{dead}-abc"  # another output's: not ours to judge
    other.mkdir()
    assert sorted(remove_stale_temporaries(tmp_path / "out")) == sorted([stale_dir, stale_file])
    assert names(tmp_path) == sorted([live.name, other.name])


# The child restores Python's own SIGINT handler: a process started from a background job (CI
# runners, `cmd &`) inherits SIGINT as ignored, and then Python installs no KeyboardInterrupt.
WRITER = """
import signal, sys, time
from fp8ptq.files.atomic import atomic_dir
signal.signal(signal.SIGINT, signal.default_int_handler)
with atomic_dir(sys.argv[1]) as tmp:
    (tmp / "half.bin").write_bytes(b"x" * 1000)
    print("writing", flush=True)
    time.sleep(60)
"""


def test_a_sigkilled_writer_leaves_a_named_temporary_the_next_run_removes(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = names(tmp_path)
    assert len(left) == 1 and left[0].startswith(f".out.fp8ptq-tmp-{proc.pid}-")  # named
    with atomic_dir(out) as tmp:
        (tmp / "done.txt").write_text("ok")
    assert names(tmp_path) == ["out"]  # the next run cleaned it up


def test_an_interrupted_writer_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # KeyboardInterrupt unwinds through the with block
    proc.wait(timeout=30)
    assert proc.returncode != 0
    assert names(tmp_path) == []


def test_scratch_folder_is_named_and_always_removed(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with scratch_dir(out) as scratch:
            (scratch / "act.bin").write_bytes(b"x")
            assert temporary_owner(scratch) == os.getpid() and "scratch-" in scratch.name
            raise RuntimeError
    assert names(tmp_path) == []


def test_unwritable_outputs_are_refused_before_any_work(tmp_path):
    (tmp_path / "f").write_text("x")
    check_writable(tmp_path / "new" / "deeper" / "out")  # folders are made when writing
    with pytest.raises(UsageError, match="is a file, not a folder"):
        check_writable(tmp_path / "f" / "deeper" / "out.json")
