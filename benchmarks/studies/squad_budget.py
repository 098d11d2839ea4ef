"""Where FP8_DYNAMIC's MiniLM SQuAD F1 loss comes from, GEMM kind by kind.

On an extractive-QA encoder: weights or activations, which GEMMs, and how far each checkpoint
sits from the float model.

    python benchmarks/studies/squad_budget.py CHECKPOINT [CHECKPOINT ...] [--source FLOAT_FOLDER]
        [--questions 1000] [--threads 2] [--out out/squad-budget]
        [--doc docs/results/llm-compressor.md]
        [--assets ../shared/assets]

``CHECKPOINT``: e4m3 checkpoints with channel weight scales (``weight`` codes and
``weight_scale``: fp8ptq's and llm-compressor's ``FP8_DYNAMIC`` alike) of one float model,
``--source`` (default: ``models/minilm-squad`` of the assets). The float model is run with
parts of the quantization switched on (``error_budget.Switches``: each GEMM's weight the
checkpoint's dequantized one and/or its input rounded per token to e4m3 as the runtime does)
on the first ``--questions`` questions of the held-out SQuAD v1.1 split, and scored two ways:

- F1 against the float model's, with the paired bootstrap 95% interval over the questions;
- the KL divergence of the quantized model's answer-start and answer-end distributions from
  the float model's (softmax over each window's tokens; the mean over windows of the two).
  Continuous: it does not hinge on which answers happen to flip, which is most of an F1
  difference between two checkpoints this close to the float model.

Rows: the activations alone (every GEMM's input rounded, then one GEMM kind's at a time),
which do not depend on the checkpoint; then per checkpoint everything and the weights alone.

``--against LABEL=EVAL.json,...`` (repeatable): the evaluation files of a comparison
(``llmc_vs_default.py``'s, one per calibration seed) to hold the activations-alone model
against, on the first ``--oracle-questions`` questions: float weights with the runtime's
input rounding is what a weight algorithm that made no weight error at all would give, so
where it is not strictly better than a tool's checkpoints (pooled over the seeds), no weight
algorithm that leaves FP8_DYNAMIC's activations alone can be.
Written to ``--out/report.json`` / ``section.md`` and the ``squad-budget`` block of ``--doc``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from error_budget import Switches, dequantized  # noqa: E402
from recipe_study import records_from_json  # noqa: E402
from results_page import study_args, write_section  # noqa: E402

from fp8ptq.evals.stats import Records, paired_interval  # noqa: E402

# BERT's GEMMs by the end of their module name (``attention.output.dense`` before
# ``output.dense``: the first match wins)
KINDS = (("q/k/v", ("attention.self.query", "attention.self.key", "attention.self.value")),
         ("attention output", ("attention.output.dense",)),
         ("intermediate", ("intermediate.dense",)),
         ("output", ("output.dense",)),
         ("qa_outputs", ("qa_outputs",)))


def kind_of(name: str) -> str | None:
    return next((kind for kind, ends in KINDS if name.endswith(ends)), None)


class Scorer:
    """The float model, the questions, and the float model's logits and F1 to score against."""

    def __init__(self, source: str, data: Path, questions: int):
        from transformers import AutoModelForQuestionAnswering, AutoTokenizer

        from fp8ptq.evals import squad
        self.model = AutoModelForQuestionAnswering.from_pretrained(
            source, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(source)
        self.examples = squad.load_examples(data, limit=questions)
        self._logits: list = []
        forward = self.model.forward

        def recording(*args, **kwargs):  # the harness's own forward, logits kept
            out = forward(*args, **kwargs)
            self._logits.append((out.start_logits.float(), out.end_logits.float(),
                                 kwargs["attention_mask"].bool()))
            return out

        self.model.forward = recording
        self.f1_float, self.float_logits = self.run()

    def run(self) -> tuple[np.ndarray, list]:
        from fp8ptq.evals import squad
        from fp8ptq.evals.extractive_qa import predict_answers
        self._logits = []
        answers = predict_answers(self.model, self.tok, self.examples)
        f1 = np.array([squad.score(a, e["answers"])["f1"]
                       for a, e in zip(answers, self.examples)])
        return f1, self._logits

    def score(self) -> dict:
        """F1, its paired difference to the float model (95% interval) and the KL."""
        f1, logits = self.run()
        return {"f1": float(f1.mean()), **paired(f1, self.f1_float),
                "kl": kl(self.float_logits, logits)}


def kl(ref: list, got: list) -> float:
    """Mean over windows of KL(float || quantized) of the start and the end distributions."""
    total, n = 0.0, 0
    for (s0, e0, mask), (s1, e1, _) in zip(ref, got):
        for a, b in ((s0, s1), (e0, e1)):
            p = a.masked_fill(~mask, -1e9).log_softmax(-1)
            q = b.masked_fill(~mask, -1e9).log_softmax(-1)
            total += float((p.exp() * (p - q)).sum())
            n += a.shape[0]
    return total / n


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="+")
    ap.add_argument("--source")
    ap.add_argument("--questions", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", action="append", default=[], metavar="LABEL=EVAL.json,...")
    ap.add_argument("--oracle-questions", type=int, default=3335)
    study_args(ap, "squad-budget", "squad-budget")
    return ap


def main(argv=None) -> str:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    assets = Path(args.assets)
    source = args.source or str(assets / "models/minilm-squad")
    cks = [Path(c) for c in args.checkpoint]
    t0 = time.perf_counter()
    data = assets / "squad-v1.1/dev-heldout.json"
    weights = [dequantized(ck) for ck in cks]
    oracle = against(Scorer(source, data, args.oracle_questions), weights[0], args.against) \
        if args.against else None
    scorer = Scorer(source, data, args.questions)
    names = sorted(set(weights[0]))
    rows = [{"label": "activations only", **activations(scorer, weights[0], set(names))}]
    for kind, _ in KINDS:
        chosen = {n for n in names if kind_of(n) == kind}
        if chosen:
            rows.append({"label": f"activations of {kind} only",
                         **activations(scorer, weights[0], chosen)})
    columns = []
    for ck, w in zip(cks, weights):
        every = set(w)
        col = {"checkpoint": ck.name}
        for key, ins in (("everything", every), ("weights", set())):
            with switched(scorer, w, every, ins):
                col[key] = scorer.score()
            print(f"{ck.name} {key}: {col[key]}", flush=True)
        columns.append(col)
    report = {"source": source, "questions": args.questions,
              "f1_float": float(scorer.f1_float.mean()), "rows": rows, "columns": columns,
              "checkpoints": [str(c) for c in cks], "oracle": oracle,
              "seconds": time.perf_counter() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return write_section(out, report, section(report, args), args.doc, "squad-budget")


def against(scorer: Scorer, weights: dict, specs: list[str]) -> dict:
    """The activations-alone model (every GEMM's input rounded, float weights) against each
    ``LABEL=EVAL.json,...``: its F1 minus the seeds' mean F1, question by question (matched by
    id), with the paired bootstrap 95% interval."""
    with switched(scorer, weights, set(), set(weights)):
        f1, _ = scorer.run()
    ids = [e["id"] for e in scorer.examples]
    out = {"questions": len(ids), "f1_float": float(scorer.f1_float.mean()),
           "f1_activations": float(f1.mean()), "against": {}}
    for spec in specs:
        label, _, files = spec.partition("=")
        per_seed = []
        for f in files.split(","):
            rec = records_from_json(json.loads(Path(f).read_text())["records"])["squad"]
            by_id = dict(zip(rec.ids, rec.columns["f1"]))
            per_seed.append(np.array([by_id[i] for i in ids]))
        theirs = np.mean(per_seed, axis=0)
        out["against"][label] = {"seeds": len(per_seed), "f1": float(theirs.mean()),
                                 **paired(f1, theirs)}
    return out


def paired(ours: np.ndarray, theirs: np.ndarray) -> dict:
    """``ours - theirs`` (mean) with its paired bootstrap 95% interval over the samples (the
    evaluation report's own, ``fp8ptq.evals.stats.paired_interval``)."""
    def records(x):
        return Records(list(range(len(x))), {"f1": np.asarray(x, dtype=float)},
                       {"f1": ("mean", "f1", None)})
    iv = paired_interval(records(theirs), records(ours), "f1")
    return {"delta": float(np.mean(ours) - np.mean(theirs)), "ci95": iv["ci95"]}


@contextmanager
def switched(scorer: Scorer, weights: dict, quantized: set[str], rounded: set[str]):
    """The float model with the checkpoint weights of ``quantized`` and the inputs of
    ``rounded`` rounded (``error_budget.Switches``), restored afterwards."""
    sw = Switches(scorer.model, weights)
    try:
        sw.set(quantized, rounded)
        yield
    finally:
        sw.remove()
        sw.set_float()


def activations(scorer: Scorer, weights: dict, rounded: set[str]) -> dict:
    """The score with the inputs of ``rounded`` rounded and every weight float."""
    with switched(scorer, weights, set(), rounded):
        got = scorer.score()
    print(f"activations of {len(rounded)} GEMMs: {got}", flush=True)
    return got


def _cell(s: dict) -> str:
    lo, hi = s["ci95"]
    return f"{s['delta']:+.2f} ({lo:+.2f}..{hi:+.2f}) | {s['kl']:.4f}"


def section(report: dict, args) -> str:
    cols = report["columns"]
    lines = [
        "## MiniLM SQuAD: where the FP8_DYNAMIC loss comes from", "",
        "Generated by `python benchmarks/studies/squad_budget.py "
        + " ".join(Path(c).name for c in report["checkpoints"])
        + f" --questions {report['questions']}` (folders of `out/llmc-vs-default/minilm-3335`, "
        f"the comparison above) on {time.strftime('%Y-%m-%d', time.gmtime())}, "
        f"{platform.machine()} {os.cpu_count()} cores, {report['seconds'] / 60:.0f} min. "
        "The float MiniLM (float32) with parts of the quantization switched on: each GEMM's "
        "weight the checkpoint's dequantized one and/or its input rounded per token to e4m3 as "
        f"the runtime does. SQuAD v1.1 held-out split, first {report['questions']:,} questions "
        f"(float model F1 {report['f1_float']:.3f}). Delta: F1 points against the float model, "
        "paired bootstrap 95% interval over the questions; KL: of the quantized model's "
        "answer-start and -end distributions from the float model's, mean over windows "
        "(0: the float model's).", "",
        "| what is quantized | delta F1 (95% CI) | KL |", "|---|---|---|"]
    lines += [f"| {r['label']} | {_cell(r)} |" for r in report["rows"]]
    lines += ["", "| checkpoint | everything: delta F1 (95% CI) | KL | weights only: delta F1 "
              "(95% CI) | KL |", "|---|---|---|---|---|"]
    lines += [f"| `{c['checkpoint']}` | {_cell(c['everything'])} | {_cell(c['weights'])} |"
              for c in cols]
    for prefix in ("fp8ptq", "llmc"):
        mine = [c for c in cols if c["checkpoint"].startswith(prefix)]
        if mine:
            lines.append("")
            lines.append(f"Mean over the `{prefix}` checkpoints: KL everything "
                         f"{np.mean([c['everything']['kl'] for c in mine]):.4f}, weights only "
                         f"{np.mean([c['weights']['kl'] for c in mine]):.4f}.")
    if report["oracle"]:
        o = report["oracle"]
        lines += ["", f"Float weights with the runtime's input rounding (activations only) on all "
                  f"{o['questions']:,} questions of the comparison: F1 {o['f1_activations']:.3f} "
                  f"(float {o['f1_float']:.3f}); against each tool's checkpoints, question by "
                  "question with the F1 averaged over its seeds (paired 95% interval): "
                  + "; ".join(f"{label} ({a['seeds']} seeds, F1 {a['f1']:.3f}) "
                              f"{a['delta']:+.2f} ({a['ci95'][0]:+.2f}..{a['ci95'][1]:+.2f})"
                              for label, a in o["against"].items()) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
