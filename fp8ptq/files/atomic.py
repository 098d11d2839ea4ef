"""Every file and folder fp8ptq writes appears complete or not at all.

One mechanism for all writers (checkpoints, the GGUF conversion cache, eval and sensitivity
reports, plots, the model card): write into a temporary sibling, then ``rename`` it into place.
A rename within one folder is atomic on POSIX, so a reader (vLLM, a CI job, a second run) never
sees half a checkpoint, and an interrupted, failed or killed run never leaves a half-written
output under the name the user asked for.

Temporary names say whose they are: ``.NAME.fp8ptq-tmp-PID-XXXX`` next to ``NAME`` (files keep
their suffix, matplotlib picks the plot format from it). The next run writing ``NAME`` removes
the ones whose process is gone (a run killed with SIGKILL cannot clean up after itself); one of a
live process is left alone.

Two runs writing the same folder at once: **rename semantics, no lock file**. Both write their
own temporary folder; the first to finish renames it into place; the second finds the output
there and fails cleanly (``UsageError``, exit 2), removing only its own temporary folder, unless
``if_exists="replace"`` (``--force``), which swaps the old folder out only once the new one is
complete and puts it back if the swap fails. A lock file was not chosen because a killed run
would leave a stale lock that blocks the next run, which is exactly what a SIGKILL must not do.

Errors are mapped here, where the output is written: a full disk is one line ("no space left on
device writing DIR; nothing was written"), as is a folder we may not write to.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from ..errors import Fp8ptqError, UsageError

MARK = ".fp8ptq-tmp-"
# safetensors reports an I/O failure as a SafetensorError whose message ends with the OS error
# (``Error while serializing: I/O error: No space left on device (os error 28)``), not OSError
_OS_ERROR = re.compile(r"I/O error: (.*) \(os error (\d+)\)")
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
TAKEN = (errno.EEXIST, errno.ENOTEMPTY)
IF_EXISTS = ("fail", "replace", "keep")


def temporary_prefix(out: Path) -> str:
    """``.NAME.fp8ptq-tmp-PID-``: whose temporary this is, and for which output."""
    return f".{Path(out).name}{MARK}{os.getpid()}-"


def temporary_owner(path: Path) -> int | None:
    """The process id in a temporary's name, None when ``path`` is not one of ours."""
    _, sep, rest = Path(path).name.partition(MARK)
    head = rest.split("-", 1)[0]
    return int(head) if sep and head.isdigit() else None


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove the temporaries of ``out`` whose writing process no longer exists (a run killed
    with SIGKILL or by a power loss); returns what was removed."""
    out = Path(out)
    removed = []
    if not out.parent.is_dir():
        return removed
    for tmp in out.parent.glob(f".{_glob_escape(out.name)}{MARK}*"):
        pid = temporary_owner(tmp)
        if pid is None or pid == os.getpid() or _process_alive(pid):
            continue
        _remove(tmp)
        removed.append(tmp)
    return removed


def check_writable(path) -> None:
    """Fail before any work (``UsageError``, exit 2) when ``path`` could not be written: its
    nearest existing ancestor must be a folder this process may write into. Commands call this
    up front, so a typo in ``--output`` / ``--json`` does not cost a whole calibration."""
    p = Path(path).expanduser().absolute()
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"cannot write {p}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {p}: no permission to write in {parent}")


@contextmanager
def atomic_dir(out, *, if_exists: str = "fail") -> Iterator[Path]:
    """``with atomic_dir(OUT) as tmp:`` write the folder's files into ``tmp``; when the block
    ends normally ``tmp`` becomes ``OUT``; on any exception (an interruption included) ``tmp``
    is removed and nothing is left.

    ``if_exists``: what to do when ``OUT`` exists at the end (for instance another run finished
    first): "fail" (``UsageError``), "replace" (swap the old folder out once the new one is
    complete) or "keep" (keep the existing folder, drop ours: a cache filled by someone else).
    """
    if if_exists not in IF_EXISTS:
        raise ValueError(f"if_exists must be one of {IF_EXISTS}")
    out = Path(out).expanduser().absolute()
    with _mapped(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=temporary_prefix(out)))
    try:
        with _mapped(out):
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the output is not
            yield tmp
            _move_into_place(tmp, out, if_exists)
    finally:
        _remove(tmp)


@contextmanager
def scratch_dir(out) -> Iterator[Path]:
    """A work folder beside ``out`` for the run's own temporary files (``--sequential``'s
    spilled activations), named like a temporary of ``out`` so that one left by a killed run is
    removed by the next; always removed when the block ends."""
    out = Path(out).expanduser().absolute()
    with _mapped(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=temporary_prefix(out) + "scratch-"))
    try:
        yield tmp  # errors of the work itself are not write errors of ``out``: not mapped
    finally:
        _remove(tmp)


@contextmanager
def atomic_file(path) -> Iterator[Path]:
    """``with atomic_file(PATH) as tmp:`` write ``tmp`` (same folder, same suffix); when the
    block ends normally it replaces ``PATH``; on any exception it is removed and an existing
    ``PATH`` is left as it was."""
    path = Path(path).expanduser().absolute()
    with _mapped(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=temporary_prefix(path),
                                    suffix=path.suffix)
        os.close(fd)
    tmp = Path(name)
    try:
        with _mapped(path):
            yield tmp
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_file(path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` then rename ``tmp`` over ``path``: readers never see a partial file."""
    with atomic_file(path) as tmp:
        write(tmp)
    return Path(path).expanduser().absolute()


def write_text(path, text: str) -> Path:
    return write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _move_into_place(tmp: Path, out: Path, if_exists: str) -> None:
    if out.exists() or out.is_symlink():
        if if_exists == "keep":
            return
        if if_exists == "fail":
            raise _taken(out)
        if not out.is_dir() or out.is_symlink():
            raise UsageError(f"{out} exists and is not a directory; refusing to replace it")
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=temporary_prefix(out) + "old-"))
        os.rmdir(old)
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)  # put the previous output back
            raise
        _remove(old)
        return
    try:
        os.rename(tmp, out)  # atomic; fails (ENOTEMPTY) if another run got there in between
    except OSError as e:
        if e.errno not in TAKEN:
            raise
        if if_exists == "fail":
            raise _taken(out) from None
        if if_exists == "replace":
            _move_into_place(tmp, out, if_exists)


def _taken(out: Path) -> UsageError:
    return UsageError(f"{out} was created by another run while this one was writing; nothing "
                      "was written (use --force to replace it)")


@contextmanager
def _mapped(out: Path):
    """OSErrors (safetensors' I/O errors included) while writing ``out`` -> one line naming
    ``out`` (``Fp8ptqError``, exit 1)."""
    try:
        try:
            yield
        except SafetensorError as e:
            wrapped = _os_error_in(e)
            if wrapped is None:
                raise
            raise wrapped from e
    except OSError as e:
        if e.errno in NO_SPACE:
            raise Fp8ptqError(f"no space left on device writing {out}; nothing was "
                              "written") from None
        if e.errno in (errno.EEXIST, errno.ENOTDIR) and e.filename and \
                Path(e.filename).is_file():
            reason = f"{e.filename} is a file, not a folder"
        else:
            where = f" ({e.filename})" if e.filename and str(e.filename) != str(out) else ""
            reason = f"{e.strerror or e}{where}"
        raise Fp8ptqError(f"cannot write {out}: {reason}; nothing was written") from None


def _os_error_in(e: SafetensorError) -> OSError | None:
    """The ``OSError`` safetensors' I/O failure wraps (None for its other errors), so a full
    disk reads the same whichever library was writing."""
    found = _OS_ERROR.search(str(e))
    return OSError(int(found[2]), found[1]) if found else None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _remove(path: Path) -> None:
    """Remove a temporary; a second Ctrl-C while it is being removed waits until it is gone
    (it is delivered right after), so an impatient user does not leave half of it behind."""
    deferred = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, deferred)
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
