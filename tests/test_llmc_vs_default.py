"""benchmarks/llmc_vs_default.py: the paired difference fp8ptq minus llm-compressor and the
section that says when it is strictly better (its interval entirely below zero)."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import llmc_vs_default as lvd  # noqa: E402

METRIC = lvd.SCORE.metric


def _row(name: str, nll_per_word: list[float]) -> dict:
    words = np.array([100.0, 120.0, 90.0, 110.0, 80.0])
    nll = np.array(nll_per_word) * words
    ppl = float(np.exp(nll.sum() / words.sum()))
    return {"name": name, "metrics": {METRIC: ppl},
            "records": {"wikitext": {"ids": [0, 1, 2, 3, 4],
                                     "columns": {"nll": (-nll).tolist(),
                                                 "words": words.tolist()},
                                     "formulas": {"word_perplexity": ["ppl", "nll", "words"]},
                                     "scale": {}}}}


def test_paired_difference_is_ours_minus_theirs_in_percent_of_theirs():
    theirs = _row("llmc", [3.50, 3.40, 3.60, 3.45, 3.55])
    ours = _row("fp8ptq", [3.48, 3.39, 3.58, 3.44, 3.52])  # lower on every article
    diff, ci = lvd.paired_diff(ours, theirs)
    assert diff == 100 * (ours["metrics"][METRIC] / theirs["metrics"][METRIC] - 1) < 0
    assert ci[0] <= diff <= ci[1] < 0
    back, ci_back = lvd.paired_diff(theirs, ours)
    assert back > 0 and ci_back[0] > 0


def test_section_marks_strictly_better_only_when_the_interval_is_below_zero():
    base = _row("baseline", [3.40, 3.30, 3.50, 3.35, 3.45])
    theirs = _row("llmc-n64-seed0", [3.50, 3.40, 3.60, 3.45, 3.55])
    better = _row("fp8ptq-n64-seed0", [3.48, 3.39, 3.58, 3.44, 3.52])
    mixed = _row("fp8ptq-x-n64-seed0", [3.40, 3.45, 3.58, 3.50, 3.52])
    by_name = {r["name"]: {**r, "deltas_pct": {METRIC: 1.0},
                           "deltas_pct_ci95": {METRIC: [0.5, 1.5]}}
               for r in (base, theirs, better, mixed)}
    common = {"seed": 0, "cq": 10.0, "wall": 20.0, "rss": 1000.0, "load_after": [1.0, 1.0, 1.0]}
    facts = {"llmc-n64-seed0": {**common, "label": "llm-compressor", "row": theirs},
             "fp8ptq-n64-seed0": {**common, "label": "fp8ptq default", "row": better,
                                  "against": "llmc-n64-seed0"},
             "fp8ptq-x-n64-seed0": {**common, "label": "fp8ptq default `-x`", "row": mixed,
                                    "against": "llmc-n64-seed0", "flags": ["-x"]}}
    args = lvd.parser().parse_args(["--seeds", "0", "--threads", "1", "--variant", "x=-x"])
    meta = {"llmc": "llm-compressor 0.14.0.1", "fp8ptq": "0 (torch, transformers)",
            "written": "now", "load": "1.0"}
    text = lvd.section([base, theirs, better, mixed], by_name, facts, args, meta)
    lines = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| 0 ")}
    assert "**" in lines["fp8ptq default"]
    assert "**" not in lines["fp8ptq default `-x`"]
    assert "llm-compressor 0.14.0.1" in text and "--variant 'x=-x'" in text
    assert "strictly better (paired interval below zero) at 1 of 1 seed(s) (0)." in text
    assert "`-x` against the default, seed 0: +" in text
    assert "recorded by both runs agrees at every seed" in text
    # a row calibrated on other windows by its flags is not a mismatch; the default's is
    facts["fp8ptq-x-n64-seed0"].update(label="fp8ptq default `--num-samples 8`",
                                       windows_sha256="other")
    text = lvd.section([base, theirs, better, mixed], by_name, facts, args, meta)
    assert "except for the rows whose flags choose other windows" in text
    facts["fp8ptq-n64-seed0"]["windows_sha256"] = "other"
    text = lvd.section([base, theirs, better, mixed], by_name, facts, args, meta)
    assert "DIFFERS for fp8ptq default)" in text


def test_pooled_rows_sum_each_articles_columns():
    a = _row("a", [3.50, 3.40, 3.60, 3.45, 3.55])
    b = _row("b", [3.40, 3.30, 3.50, 3.35, 3.45])
    same = lvd.pooled([a, a])
    assert np.isclose(same["metrics"][METRIC], a["metrics"][METRIC])
    both = lvd.pooled([a, b])
    lo, hi = sorted([a["metrics"][METRIC], b["metrics"][METRIC]])
    assert lo < both["metrics"][METRIC] < hi
    diff, ci = lvd.paired_diff(lvd.pooled([b, b]), both)
    assert diff < 0 and ci[1] < 0


def test_the_comparison_installs_nothing_by_itself(tmp_path, monkeypatch):
    """Without llm-compressor's venv both comparison scripts stop with one ``error:`` line
    naming the command that builds it (``--setup-only``), before converting or writing
    anything, and create no venv."""
    import pytest

    cl = lvd.cl
    venv = tmp_path / "llmc-venv"
    monkeypatch.setattr(cl, "VENV", venv)
    out = tmp_path / "out"
    for main, argv in ((cl.main, ["smollm2", "--no-eval", "--out", str(out)]),
                       (lvd.main, ["--steps", "quantize", "--tools", "llmc",
                                   "--llmc-python", str(venv / "bin/python"),
                                   "--out", str(out)])):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert str(stop.value).startswith("error: llm-compressor does not import")
        assert "--setup-only" in str(stop.value)
    assert not venv.exists() and not (out / "smollm2-hf").exists()


def test_the_study_steps_are_arguments_their_scripts_accept():
    """``compare_llmcompressor.py --study`` runs each step through its script's ``main``: every
    step's arguments parse with that script's parser (a renamed or removed flag fails here, not
    hours into a study), and every SmolLM2 variant is a flag ``fp8ptq quantize`` takes."""
    import importlib

    from fp8ptq.cli.main import main as cli

    cl = lvd.cl
    assert [name for name, *_ in cl.STUDY] == ["accuracy", "minilm", "budget", "squad-budget",
                                               "speed"]
    quantize = cli.get_command(None, "quantize")
    known = {o for p in quantize.params for o in (*p.opts, *p.secondary_opts)}
    for _name, _what, script, argv in cl.STUDY:
        args = importlib.import_module(script).parser().parse_args([*argv, "--assets", "x"])
        for spec in getattr(args, "variant", []):
            _, _, flags = lvd.parse_variant(spec, 0)
            for flag in (f for f in flags.split() if f.startswith("--")):
                assert flag in known, flag
    minilm = lvd.parser().parse_args(cl.STUDY[1][3])
    assert minilm.model == "minilm" and minilm.schemes == "FP8_DYNAMIC,FP8_BLOCK"
    # the squad budget reads the minilm step's FP8_DYNAMIC checkpoints and evaluations
    import squad_budget
    budget = squad_budget.parser().parse_args(cl.STUDY[3][3])
    out = Path(minilm.out).resolve() / f"minilm-{minilm.questions}"
    tag = lvd.SCHEMES["FP8_DYNAMIC"][2]
    rows = [f"{tool}-{tag}n{minilm.num_samples}-seed{s}" for tool in ("fp8ptq", "llmc")
            for s in minilm.seeds.split(",")]
    assert budget.checkpoint == [str(out / r) for r in rows]
    files = [f.split("=", 1)[1].split(",") for f in budget.against]
    assert sorted(sum(files, [])) == sorted(str(out / f"{r}.json") for r in rows)


def test_squad_differences_are_points_and_better_is_higher():
    """MiniLM's rows: F1 differences in points, strictly better when the interval is above
    zero; pooled F1 is the mean over seeds."""
    score = lvd.SCORES["minilm"]

    def row(f1):
        f1 = np.array(f1, dtype=float)
        return {"metrics": {score.metric: float(f1.mean())},
                "records": {"squad": {"ids": list(range(len(f1))), "columns": {"f1": f1.tolist()},
                                      "formulas": {"f1": ["mean", "f1", None]}, "scale": {}}}}

    theirs = row([50, 60, 70, 80, 90, 40, 30, 20])
    ours = row([52, 61, 71, 83, 91, 42, 31, 22])
    d, ci = lvd.paired_diff(ours, theirs, score)
    assert np.isclose(d, 1.625) and score.strict(ci) and ci[0] > 0
    back, ci_back = lvd.paired_diff(theirs, ours, score)
    assert back < 0 and not score.strict(ci_back)
    both = lvd.pooled([ours, theirs], score)
    assert np.isclose(both["metrics"][score.metric],
                      (ours["metrics"][score.metric] + theirs["metrics"][score.metric]) / 2)


def test_llm_compressor_runs_once_per_folder_with_its_facts(tmp_path, monkeypatch):
    """Both comparison scripts run llm-compressor through one launcher: the child once per
    folder (cached), its facts kept with the process's wall time, the windows' sha256 and the
    caller's own facts read after the child ended."""
    cl = lvd.cl
    runs = tmp_path / "runs.txt"
    child = ("import json, pathlib, sys\n"
             "src, scheme, dest = sys.argv[1:4]\n"
             f"open({str(runs)!r}, 'a').write(scheme + '\\n')\n"
             "pathlib.Path(dest).mkdir(parents=True, exist_ok=True)\n"
             "(pathlib.Path(dest) / 'llmc_run.json').write_text(json.dumps({'scheme': scheme}))\n")
    monkeypatch.setattr(cl, "CHILD", child)
    windows = tmp_path / "windows.json"
    windows.write_text('{"sha256": "abc", "input_ids": [[1, 2]]}')
    dest = tmp_path / "llmc-n64-seed0"
    for _ in range(2):
        facts = lvd.quantize_llmc(Path(sys.executable), tmp_path, windows, 64, dest, threads=1)
    assert runs.read_text().split() == ["GPTQ-FP8_DYNAMIC"]  # the second call read the cache
    assert facts["scheme"] == "GPTQ-FP8_DYNAMIC" and facts["windows_sha256"] == "abc"
    assert facts["threads"] == 1 and len(facts["load_after"]) == 3 and facts["wall_seconds"] > 0
    row = cl.run_llmc(Path(sys.executable), tmp_path, "FP8_DYNAMIC", tmp_path / "cmp",
                      tmp_path / "calib.txt", 8, "causal-lm", [])
    assert row["path"] == str(tmp_path / "cmp" / "llmc-FP8_DYNAMIC") and "windows_sha256" not in row
