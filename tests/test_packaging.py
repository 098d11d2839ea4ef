"""The built wheel ships fp8ptq.calibrators / .cli / .evals from the top-level folders (and no
generic top-level ``cli`` / ``evals`` packages), and imports from the wheel alone."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_maps_the_top_level_folders_into_fp8ptq(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")], check=True,
                   capture_output=True)
    wheel = next((tmp_path / "dist").glob("fp8ptq-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"fp8ptq"}
    for module in ("fp8ptq/calibrators/max.py", "fp8ptq/cli/main.py", "fp8ptq/evals/runner.py",
                   "fp8ptq/formats/codec.py", "fp8ptq/checkpoint/writer.py",
                   "fp8ptq/runtime/csrc/codec.c", "fp8ptq/runtime/csrc/common.h"):
        assert module in names
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "fp8ptq = fp8ptq.cli.entry:main" in entry_points

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import fp8ptq, fp8ptq.calibrators, fp8ptq.cli.main, fp8ptq.evals.report; "
            "print(fp8ptq.__file__, fp8ptq.calibrators.__file__, fp8ptq.cli.main.__file__)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}).stdout
    assert all(path.startswith(str(site)) for path in out.split()), out
