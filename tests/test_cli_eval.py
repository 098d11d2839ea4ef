"""``fp8ptq eval`` end to end: a tiny Llama and a tiny BERT QA model, tiny WikiText/SQuAD files."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from fp8ptq.config.recipe import Recipe
from fp8ptq.evals.compare import Variant, evaluate_variants
from fp8ptq.execution import job
from tiny_models import invoke, tiny

SENTENCES = [
    "the quick brown fox jumps over the lazy dog .",
    "a small model reads a few words of text .",
    "hello world and hello again .",
]
ARTICLES = [
    " = hello world = \n the quick brown fox jumps over the lazy dog . \n"
    " = = a few words = = \n a small model reads a few words of text . \n",
    " = the lazy dog = \n hello world and hello again . the dog reads text . \n",
    " = a brown fox = \n a small fox jumps over a brown dog and the world . \n",
]
QUESTIONS = [("what jumps over the lazy dog", "the quick brown fox"),
             ("what does the model read", "a few words of text"),
             ("who is lazy", "the lazy dog")]
SQUAD = {"version": "1.1", "data": [{"title": "fox", "paragraphs": [{
    "context": " ".join(SENTENCES),
    "qas": [{"id": f"q{i}", "question": q, "answers": [{"text": a, "answer_start": 0}]}
            for i, (q, a) in enumerate(QUESTIONS)]}]}]}
WIKI_METRICS = {"wikitext.word_perplexity", "wikitext.byte_perplexity", "wikitext.bits_per_byte",
                "wikitext.token_perplexity"}


@pytest.fixture(scope="module")
def files(tmp_path_factory, word_tokenizer):
    root = tmp_path_factory.mktemp("eval")
    for model, name in ((tiny("llama"), "llama"), (tiny("bert"), "bert-qa")):
        model.save_pretrained(root / name)
        word_tokenizer.save_pretrained(root / name)
    (root / "wiki.test.raw").write_text("".join(ARTICLES))
    (root / "calib.txt").write_text("\n".join(SENTENCES * 20))
    (root / "squad.json").write_text(json.dumps(SQUAD))
    return SimpleNamespace(root=root, llama=str(root / "llama"), bert=str(root / "bert-qa"),
                           wiki=str(root / "wiki.test.raw"), calib=str(root / "calib.txt"),
                           squad=str(root / "squad.json"))


def calib_flags(f, seq_len_flag="--calib-seq-len"):
    return ["--calib-data", f.calib, "--num-samples", "4", seq_len_flag, "16", "--dtype", "float32"]


def run(*args):
    return invoke([str(a) for a in args])


def eval_wiki(f, model, *args):
    return run("eval", model, "--tasks", "wikitext", "--data", f"wikitext={f.wiki}",
               *calib_flags(f), *args)


@pytest.fixture(scope="module")
def checkpoint(files):
    out = files.root / "ckpt-e4m3"
    res = run("quantize", files.llama, "--format", "e4m3", "-o", out,
              *calib_flags(files, "--seq-len"))  # quantize keeps the plain calibration flags
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture
def no_model_loading(monkeypatch):
    """Bad input must be refused before any model is loaded."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(job, "load", refuse)


@pytest.mark.slow
def test_baseline_int8_e4m3_table_json_markdown_plot(files, tmp_path):
    out = tmp_path / "out"
    res = eval_wiki(files, files.llama, "--compare", "int8,e4m3,fp32,bf16", "--batch-size", 2,
                    "--calib-batch-size", 3, "--json", out / "r.json", "--markdown", out / "r.md",
                    "--plot", out / "r.png", "--max-delta", "wikitext.word_perplexity=50%",
                    "--max-delta", "token_perplexity=5")
    assert res.exit_code == 0, res.output
    for text in ("evaluation (delta to baseline)", "baseline", "int8", "e4m3", "bf16",
                 "wikitext.word_perplexity", "protocol wikitext: context_length=", "stride=",
                 "bos=", "split=articles on ' = X = ' headings", "documents=3"):
        assert text in res.stdout, text
    assert "gate failed" not in res.output
    # on the CPU every quantized GEMM is simulated, and the report says so
    ran = re.search(r"protocol gemms: int8 real FP8 kernels 0 of (\d+), simulated (\d+); "
                    r"e4m3 real FP8 kernels 0 of (\d+), simulated (\d+)", res.stdout)
    assert ran and len(set(ran.groups())) == 1 and int(ran.group(1)) > 0, res.stdout

    doc = json.loads((out / "r.json").read_text())
    variants = doc["variants"]
    gemms = int(ran.group(1))
    assert [v["gemm_paths"] for v in variants] == [{"gemms": 0, "real_fp8": 0, "simulated": 0}] \
        + [{"gemms": gemms, "real_fp8": 0, "simulated": gemms}] * 2 \
        + [{"gemms": 0, "real_fp8": 0, "simulated": 0}]
    # fp32 is the baseline's own dtype: folded into it, not evaluated twice
    assert [v["name"] for v in variants] == ["baseline", "int8", "e4m3", "bf16"]
    assert [v["kind"] for v in variants] == ["baseline", "quantized", "quantized", "dtype"]
    assert [v["dtype"] for v in variants] == ["float32"] * 3 + ["bfloat16"]
    assert [v["recipe"] and v["recipe"]["format"] for v in variants] == [None, "int8", "e4m3", None]
    base = variants[0]["metrics"]
    assert set(base) == WIKI_METRICS and all(d == 0 for d in variants[0]["deltas"].values())
    for v in variants[1:]:
        assert set(v["metrics"]) == WIKI_METRICS
        for key, value in v["metrics"].items():
            assert math.isfinite(value) and value != base[key], (v["name"], key)
            assert abs(value / base[key] - 1) < 0.1, (v["name"], key)  # tiny model: close
            assert v["deltas"][key] == pytest.approx(value - base[key])
    assert all(v["seconds"] > 0 and v["timings"]["eval"]["wikitext"] > 0 for v in variants)
    assert "calibrate+quantize" in variants[1]["timings"]
    assert doc["protocol"]["wikitext"]["documents"] == 3
    assert doc["protocol"]["wikitext"]["source"] == files.wiki
    # --seq-len/--batch-size are eval's; the calibration ones arrive under their own names
    assert doc["eval"]["batch_size"] == 2
    assert doc["recipe"]["seq_len"] == 16 and doc["recipe"]["batch_size"] == 3
    assert doc["calibration"]["num_samples"] == 4 and doc["calibration"]["seq_len"] == 16

    # the CLI's baseline is exactly what the library computes on the same model
    from fp8ptq.evals.runner import run_tasks

    loaded = job.load(files.llama, Recipe(dtype="float32"))
    direct = run_tasks(loaded.model, loaded.tokenizer, ["wikitext"],
                       data={"wikitext": files.wiki}, batch_size=2)
    assert direct.metrics == pytest.approx(base, rel=1e-9)

    markdown = (out / "r.md").read_text().splitlines()
    assert markdown[0].startswith("| variant | wikitext.word_perplexity")
    assert [line.split("|")[1].strip() for line in markdown[2:]] == ["baseline", "int8", "e4m3",
                                                                      "bf16"]
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.iterdir()) == ["r.json", "r.md", "r.png"]  # no temp files


@pytest.mark.slow
def test_failed_gate_exits_3_and_names_the_metric(files, tmp_path):
    res = eval_wiki(files, files.llama, "--compare", "int8,e4m3,e3m0,bf16", "--json",
                    tmp_path / "r.json", "--max-delta", "wikitext.word_perplexity=0",
                    "--max-delta", "wikitext.token_perplexity=100%")
    doc = json.loads((tmp_path / "r.json").read_text())  # the report is written before the gates
    # a random model's perplexity may go either way; each variant that got worse fails the gate
    worse = [v["name"] for v in doc["variants"]
             if v["kind"] == "quantized" and v["deltas"]["wikitext.word_perplexity"] > 0]
    assert worse  # deterministic: all three are worse on this model and text
    assert res.exit_code == 3, res.output
    failed = [line for line in res.stderr.splitlines() if line.startswith("gate failed:")]
    assert [line.split(":")[1].strip() for line in failed] == worse  # bf16 is no quantized variant
    assert all(" wikitext.word_perplexity " in line and "token_perplexity" not in line
               for line in failed)
    assert f"error: {len(worse)} of 6 gate checks failed" in res.stderr


@pytest.mark.usefixtures("no_model_loading")
def test_calibration_file_used_for_evaluation_is_refused(files, tmp_path):
    alias = tmp_path / "same-file.raw"
    alias.symlink_to(files.wiki)
    res = run("eval", files.llama, "--tasks", "wikitext", "--data", f"wikitext={alias}",
              "--compare", "int8", "--calib-data", files.wiki)
    assert res.exit_code == 2, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: calibration data ")
    assert "is also the wikitext evaluation data" in res.stderr
    assert "--allow-calib-overlap" in res.stderr


@pytest.mark.usefixtures("no_model_loading")
def test_window_start_every_needs_a_prefix_token(files):
    res = run("eval", files.llama, "--tasks", "wikitext", "--data", f"wikitext={files.wiki}",
              "--prefix-token", "none", "--window-start", "every")
    assert res.exit_code == 2, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: --window-start every")


def test_window_start_every_is_in_the_protocol(files, tmp_path):
    res = eval_wiki(files, files.llama, "--window-start", "every", "--prefix-token", "eos",
                    "--seq-len", 8, "--limit", 1, "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    protocol = json.loads((tmp_path / "r.json").read_text())["protocol"]["wikitext"]
    assert protocol["window_start"] == "every" and protocol["stride"] == 7
    assert "window_start=every" in res.stdout


@pytest.mark.slow
def test_calibration_overlap_allowed_is_noted(files, tmp_path):
    res = run("eval", files.llama, "--tasks", "wikitext", "--data", f"wikitext={files.wiki}",
              "--compare", "int8", "--calib-data", files.wiki, "--num-samples", 2,
              "--calib-seq-len", 8, "--dtype", "float32", "--limit", 1, "--allow-calib-overlap",
              "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "r.json").read_text())
    notes = doc["notes"]
    assert len(notes) == 1 and "optimistic" in notes[0]
    assert doc["peak_rss_mb"] > 0 and set(doc["seconds"]) >= {"load", "eval"}
    assert doc["seconds"]["eval"] == pytest.approx(sum(
        sum(v["timings"]["eval"].values()) for v in doc["variants"]), abs=0.01)
    time_re = r"^time: load \d+\.\ds, .*eval \d+\.\ds.*; peak RSS \d+ MiB( in \w+)?$"
    assert re.search(time_re, res.stdout, re.M)
    assert "note: calibration data" in res.stdout


@pytest.mark.usefixtures("no_model_loading")
def test_checkpoint_calibrated_on_the_eval_file_is_refused(files, checkpoint):
    res = run("eval", checkpoint, "--tasks", "wikitext", "--data", f"wikitext={files.calib}")
    assert res.exit_code == 2, res.output
    assert f"the calibration data of {checkpoint.name} {files.calib} is also" in res.stderr


@pytest.mark.slow
def test_checkpoint_folder_in_compare_and_as_model(files, checkpoint, tmp_path):
    res = eval_wiki(files, files.llama, "--compare", f"{checkpoint},e4m3", "--limit", 2,
                    "--json", tmp_path / "a.json")
    assert res.exit_code == 0, res.output
    a = {v["name"]: v for v in json.loads((tmp_path / "a.json").read_text())["variants"]}
    assert list(a) == ["baseline", "ckpt-e4m3", "e4m3"]
    # under the table, how each variant was made: a checkpoint and an on-the-fly variant of the
    # same recipe read the same but for where they came from
    recipe = ("e4m3, gptq channel weights, token activations (sequential GPTQ), "
              "4 x 16 calibration tokens")
    lines = res.stdout.splitlines()
    assert f"baseline: {files.llama} unquantized, float32" in lines
    assert f"ckpt-e4m3: checkpoint {checkpoint}, {recipe}" in lines
    assert f"e4m3: {files.llama} quantized in this run, {recipe}" in lines
    assert a["ckpt-e4m3"]["kind"] == "checkpoint" and a["ckpt-e4m3"]["recipe"]["format"] == "e4m3"
    # written with the same recipe and calibration data: the reloaded checkpoint computes the
    # same as the variant quantized on the fly
    assert a["ckpt-e4m3"]["metrics"] == pytest.approx(a["e4m3"]["metrics"], rel=1e-9)
    assert a["e4m3"]["metrics"] != a["baseline"]["metrics"]

    # MODEL = the checkpoint: evaluated as quantized, its recorded source is the baseline
    res = run("eval", checkpoint, "--tasks", "wikitext", "--data", f"wikitext={files.wiki}",
              "--limit", 2, "--json", tmp_path / "b.json", "--max-delta", "word_perplexity=10%")
    assert res.exit_code == 0, res.output
    b = {v["name"]: v for v in json.loads((tmp_path / "b.json").read_text())["variants"]}
    assert list(b) == ["baseline", "ckpt-e4m3"]
    assert b["baseline"]["metrics"] == pytest.approx(a["baseline"]["metrics"], rel=1e-9)
    assert b["ckpt-e4m3"]["metrics"] == pytest.approx(a["ckpt-e4m3"]["metrics"], rel=1e-9)


def test_checkpoint_whose_base_model_is_gone(files, checkpoint, tmp_path):
    moved = tmp_path / "orphan"
    shutil.copytree(checkpoint, moved)
    meta = json.loads((moved / "fp8ptq.json").read_text())
    meta["source"] = {"model": str(tmp_path / "gone"), "kind": "local",
                      "path": str(tmp_path / "gone")}
    (moved / "fp8ptq.json").write_text(json.dumps(meta))

    res = run("eval", moved, "--tasks", "wikitext", "--data", f"wikitext={files.wiki}",
              "--limit", 1, "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [v["name"] for v in doc["variants"]] == ["orphan"]
    assert math.isfinite(doc["variants"][0]["metrics"]["wikitext.word_perplexity"])
    assert doc["notes"][0].startswith("no baseline:") and "note: no baseline" in res.stdout

    for extra in (["--max-delta", "word_perplexity=1%"], ["--compare", "int8"]):
        res = run("eval", moved, "--tasks", "wikitext", *extra)
        assert res.exit_code == 2 and "not reachable" in res.stderr, res.output


@pytest.mark.usefixtures("no_model_loading")
@pytest.mark.parametrize(("args", "message"), [
    (["--data", "wikitext=/no/such/wiki.raw"], "wikitext data file not found"),
    (["--data", "wikitext"], "--data expects TASK=PATH"),
    (["--data", "hellaswag={wiki}"], "data files are read by wikitext and squad only"),
    (["--compare", "e4m3,e9m9x"], "--compare 'e9m9x' is neither a format"),
    (["--compare", "{root}"], "is not an fp8ptq checkpoint"),
    (["--max-delta", "wikitext.word_perplexity"], "bad gate"),
    (["--max-delta", "word_perplexity=-1"], "bad gate"),
    (["--max-delta", "word_perplexity=abc%"], "bad gate"),
    (["--max-delta", "squad.f1=1"], "task 'squad' is not in --tasks"),
    (["--max-delta", "wikitext.mystery=1"], "higher or lower is better"),
    (["--plot", "deltas.txt"], "--plot deltas.txt: expected a .png"),
    (["--include-path", "/no/such/dir"], "include path is not a directory"),
    (["--compare", "int8", "--calib-data", "/no/such/calib.txt"],
     "calibration data file not found"),
])
def test_bad_input_is_one_error_line_and_exit_2(files, args, message):
    args = [a.format(wiki=files.wiki, root=files.root) for a in args]
    res = run("eval", files.llama, "--tasks", "wikitext", *args)
    assert res.exit_code == 2, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: "), res.stderr
    assert message in res.stderr


@pytest.mark.usefixtures("no_model_loading")
def test_unknown_task_is_refused_before_loading(files, monkeypatch, tmp_path):
    from fp8ptq.evals import runner

    # lm-eval's full task index takes ~15 s to build; an empty one says the same here
    monkeypatch.setattr(runner, "TaskManager", lambda **kwargs: SimpleNamespace(all_tasks=[]))
    res = run("eval", files.llama, "--tasks", "wikitext,no_such_task")
    assert res.exit_code == 2
    assert res.stderr.startswith("error: unknown task 'no_such_task'")


@pytest.mark.slow
def test_extractive_squad_on_a_tiny_bert(files, tmp_path):
    res = run("eval", files.bert, "--tasks", "squad", "--data", f"squad={files.squad}",
              "--compare", "int8", *calib_flags(files), "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [v["name"] for v in doc["variants"]] == ["baseline", "int8"]
    for v in doc["variants"]:
        assert set(v["metrics"]) == {"squad.exact_match", "squad.f1"}
        assert 0 <= v["metrics"]["squad.exact_match"] <= v["metrics"]["squad.f1"] <= 100
    assert doc["protocol"]["squad"]["mode"] == "extractive"
    assert doc["protocol"]["squad"]["questions"] == len(QUESTIONS)


def test_flag_names_of_eval_and_quantize():
    eval_help = run("eval", "--help").stdout
    assert "--calib-seq-len" in eval_help and "--calib-batch-size" in eval_help
    assert "Maximum evaluation context" in run("eval", "--help-all").stdout
    quantize_help = run("quantize", "--help").stdout
    assert "--seq-len" in quantize_help and "--batch-size" in quantize_help
    assert "--calib-seq-len" not in quantize_help


@pytest.mark.slow
def test_python_m_fp8ptq_cli_eval(files, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fp8ptq.cli", "eval", files.llama, "--tasks", "wikitext",
         "--data", f"wikitext={files.wiki}", "--compare", "e4m3", *calib_flags(files),
         "--limit", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [v["name"] for v in doc["variants"]] == ["baseline", "e4m3"]
    assert "baseline" in proc.stdout and "e4m3" in proc.stdout


def test_each_variant_calibrates_on_its_own_windows(files):
    """``evaluate_variants`` cuts a variant's calibration set by its own recipe
    (``calib_windows``), not by the shared one: a documents-window variant scores what it
    scores alone, and not what the random-window variant scores."""
    base = Recipe(calib_data=files.calib, num_samples=4, seq_len=16, dtype="float32",
                  act_granularity="tensor", weight_calib="max",  # static: the data matter
                  calib_windows="random")
    docs = base.merged(calib_windows="documents")
    texts = job.calibration_texts(base, files.llama)
    kw = dict(device="cpu", data={"wikitext": files.wiki}, limit=None, seq_len=None,
              batch_size=None)
    rows, _, calib = evaluate_variants(
        [Variant("random", "quantized", files.llama, base),
         Variant("documents", "quantized", files.llama, docs)], base, texts, ["wikitext"], [],
        **kw)
    assert calib.windows == "random"
    alone, _, calib_alone = evaluate_variants(
        [Variant("documents", "quantized", files.llama, docs)], base, texts, ["wikitext"], [],
        **kw)
    assert calib_alone.windows == "documents"
    ppl = {r["name"]: r["metrics"]["wikitext.word_perplexity"] for r in rows}
    assert ppl["documents"] == alone[0]["metrics"]["wikitext.word_perplexity"]
    assert ppl["documents"] != ppl["random"]


@pytest.mark.slow
def test_variants_calibrate_opening_as_the_evaluation_opens(files, word_tokenizer):
    """The variants ``eval --compare`` quantizes cut document windows that open with the token
    the evaluation conditions each document on (``--prefix-token``): the EOS for ``auto`` with
    this BOS-less tokenizer, nothing for ``none`` (they opened with the EOS whatever the
    evaluation did)."""
    docs = Recipe(calib_data=files.calib, num_samples=4, seq_len=16, dtype="float32",
                  calib_windows="documents")
    texts = job.calibration_texts(docs, files.llama)
    kw = dict(device="cpu", data={"wikitext": files.wiki}, limit=None, seq_len=None,
              batch_size=None)
    eos = word_tokenizer.eos_token_id
    for choice, want in (("auto", (eos,)), ("none", ())):
        rows, protocol, calib = evaluate_variants(
            [Variant("documents", "quantized", files.llama, docs)], docs, texts, ["wikitext"],
            [], prefix_token=choice, **kw)
        assert calib.start_ids == want
        assert (calib.input_ids[:, 0] == eos).all() == bool(want)
