"""Reruns the paper analogues (SmolLM2-135M, MiniLM, digits CNN) into docs/results/accuracy.md.

Every number comes from the fp8ptq CLI on the offline assets; the page's marked blocks are kept.

    python benchmarks/reproduce.py [--assets ../shared/assets] [--out out/results]
        [--only NAME[,NAME]] [--quick]

Each experiment is one CLI command writing a JSON file under ``--out``; an experiment whose JSON
already exists is not run again (delete it, or pass ``--rerun``), so an interrupted run resumes.
``--quick`` shrinks every slice (for checking the script, not for publishing numbers).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Setup:
    assets: Path
    out: Path
    quick: bool

    @property
    def smollm2(self) -> str:
        return str(self.assets / "models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")

    @property
    def minilm(self) -> str:
        return str(self.assets / "models/minilm-squad")

    @property
    def calib(self) -> list[str]:
        n = "8" if self.quick else "32"
        return ["--calib-data", str(self.assets / "calib/wiki-paragraphs.txt"),
                "--num-samples", n, "--calib-seq-len", "512"]

    def wikitext(self, articles: int) -> list[str]:
        return ["--tasks", "wikitext", "--data",
                f"wikitext={self.assets / 'wikitext-2-raw/wiki.test.raw'}",
                "--limit", str(1 if self.quick else articles), "--seq-len", "2048"]

    def squad(self, questions: int) -> list[str]:
        return ["--tasks", "squad", "--data",
                f"squad={self.assets / 'squad-v1.1/dev-heldout.json'}",
                "--limit", str(50 if self.quick else questions)]


@dataclass
class Experiment:
    name: str
    argv: list[str]  # after "fp8ptq" (or a python script path ending in .py)
    seconds: float | None = None
    result: dict = field(default_factory=dict)


def experiments(s: Setup) -> list[Experiment]:
    wt = s.wikitext(3)
    all_formats = "e4m3,e5m2,e4m3fnuz,e5m2fnuz,hfp8,hif8,int8"
    exps = [
        Experiment("table5_smollm2", ["eval", s.smollm2, *wt, "--compare", "int8,e4m3",
                                      "--act-calib", "best", *s.calib]),
        Experiment("table5_minilm", ["eval", s.minilm, *s.squad(1000), "--compare", "int8,e4m3",
                                     "--act-calib", "best", *s.calib]),
        Experiment("format_sweep", ["eval", s.smollm2, *wt, "--compare", all_formats,
                                    *s.calib]),
    ]
    for method, formats in (("percentile", "e4m3,int8"), ("mse", "e4m3,int8"),
                            ("pow2-search", "e4m3,int8,hif8")):
        exps.append(Experiment(f"calib_{method}", [
            "eval", s.smollm2, *wt, *s.calib, "--compare", formats, "--act-calib", method]))
    exps.append(Experiment("calib_smoothquant", [
        "eval", s.smollm2, *wt, *s.calib, "--compare", "e4m3,int8,hif8", "--smoothquant", "0.5"]))
    exps.append(Experiment("table8_hif8_cast", [
        "eval", s.smollm2, *wt, "--compare", "hif8", "--act-calib", "cast",
        "--weight-calib", "cast", *s.calib]))
    biases = "e4m3b3fn,e4m3b5fn,e4m3b7fn,e4m3b9fn,e4m3b11fn"
    for residual in (False, True):
        exps.append(Experiment(f"fig2_bias_sweep{'_residual' if residual else ''}", [
            "eval", s.smollm2, *s.wikitext(1), "--compare", biases, "--act-calib", "cast",
            "--weight-calib", "cast", *s.calib, *(["--quantize-residual"] if residual else [])]))
    exps.append(Experiment("table1_digits_cnn", [str(ROOT / "benchmarks/studies/digits_cnn.py")]))
    exps.append(Experiment("sensitivity", [
        "sensitivity", s.smollm2, "--format", "e4m3", "--granularity-level", "block",
        "--calib-data", str(s.assets / "calib/wiki-paragraphs.txt"), "--num-samples", "8",
        "--seq-len", "256", "--eval-data", str(s.assets / "wikitext-2-raw/wiki.test.raw"),
        "--eval-tokens", "1024" if s.quick else "2048",
        "--plot", str(s.out / "sensitivity.png")]))
    return exps


def run(exp: Experiment, s: Setup, rerun: bool) -> None:
    path = s.out / f"{exp.name}.json"
    if path.exists() and not rerun:
        exp.result = json.loads(path.read_text())
        exp.seconds = exp.result.get("_wall_seconds")
        return
    if exp.argv[0].endswith(".py"):
        cmd = [sys.executable, *exp.argv, "--json", str(path)]
    else:
        cmd = [sys.executable, "-m", "fp8ptq.cli", *exp.argv, "--json", str(path)]
    print(f"$ {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT)
    exp.seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{exp.name} failed with exit code {proc.returncode}")
    exp.result = json.loads(path.read_text())
    exp.result["_wall_seconds"] = exp.seconds
    path.write_text(json.dumps(exp.result, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--assets", default=str(ROOT.parent / "shared/assets"))
    ap.add_argument("--out", default=str(ROOT / "out/results"))
    ap.add_argument("--only", help="comma-separated experiment names")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rerun", action="store_true")
    ap.add_argument("--doc", default=str(ROOT / "docs/results/accuracy.md"))
    args = ap.parse_args()
    s = Setup(Path(args.assets).resolve(), Path(args.out).resolve(), args.quick)
    s.out.mkdir(parents=True, exist_ok=True)
    exps = experiments(s)
    if args.only:
        wanted = set(args.only.split(","))
        exps = [e for e in exps if e.name in wanted]
    for exp in exps:
        run(exp, s, args.rerun)
    from results_page import kept_blocks, render, splice  # noqa: PLC0415 (sibling module)

    every = experiments(s)
    for exp in every:
        path = s.out / f"{exp.name}.json"
        if path.exists():
            exp.result = json.loads(path.read_text())
    doc = Path(args.doc)
    old = doc.read_text() if doc.exists() else ""
    page = render({e.name: e for e in every}, s, plt)
    for name, block in kept_blocks(old).items():  # written by hand or by other scripts
        page = splice(page, block, name)
    doc.write_text(page)
    print(f"wrote {args.doc}")


if __name__ == "__main__":
    main()
