"""The model card (``README.md``) written into every checkpoint folder.

A release engineer who finds the folder months later must be able to tell, from the folder
alone: what it was made from, how (the recipe and the exact command), on which calibration
data, what stayed in high precision, how to load it, and what it cost in accuracy. The front
matter follows the Hugging Face model-card metadata (``base_model``, ``tags``,
``library_name``) so that the hub indexes it. ``fp8ptq eval CKPT --update-card`` replaces the
evaluation section (between the markers) atomically.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import yaml

from ..files.atomic import write_text
from ..model.auto import is_causal_lm_name
from .layouts import get_layout

CARD_NAME = "README.md"
EVAL_BEGIN = "<!-- fp8ptq:eval:begin -->"
EVAL_END = "<!-- fp8ptq:eval:end -->"


def command_line() -> str:
    """The command that is running, as a user would type it."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("fp8ptq", "__main__.py"):
        argv[0] = "fp8ptq"
    return " ".join(shlex.quote(a) for a in argv)


def render(meta: dict, config: dict) -> str:
    layout = meta.get("layout")
    stored = get_layout(layout)
    source = meta.get("source") or {}
    base = source.get("model") or "unknown"
    recipe = meta.get("recipe") or {}
    tags = ["fp8", "fp8ptq", "quantized", *stored.card_tags]
    front = {"base_model": base if source.get("kind") == "hub" else None,
             "library_name": stored.library_name,
             "tags": tags, "pipeline_tag": "text-generation"
             if any(is_causal_lm_name(a) for a in meta.get("architectures") or []) else None}
    front = {k: v for k, v in front.items() if v is not None}
    modules = meta.get("modules") or {}
    formats = sorted({(m["weight_format"]["name"], (m.get("act_format") or {}).get("name"),
                       m.get("weight_granularity"), m.get("act_granularity"))
                      for m in modules.values()})
    experts = meta.get("experts") or {}
    calib = meta.get("calibration") or {}
    hp = ((meta.get("extras") or {}).get("high_precision") or {})
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {Path(base).name} ({', '.join(sorted({f[0] for f in formats}) or ['?'])}, "
             "fp8ptq)", "",
             f"Post-training quantized with fp8ptq {meta.get('version', '')} from `{base}` "
             f"({source.get('kind', '?')}: `{source.get('path', '')}`).", "",
             "## How it was made", "",
             f"- command: `{meta.get('command') or 'fp8ptq quantize ...'}`",
             f"- layout: **{layout}** ({meta.get('layout_reason', '')})",
             f"- quantized modules: {len(modules)}"
             + (f" GEMMs and {len(experts)} fused-experts modules" if experts else " GEMMs"),
             "- schemes (weight format, activation format, weight / activation granularity): "
             + "; ".join(f"{w}/{a or 'none'} {wg}/{ag or '-'}" for w, a, wg, ag in formats)]
    if calib:
        lines.append(f"- calibration: {calib.get('num_samples')} x {calib.get('seq_len')} "
                     f"tokens of `{calib.get('source')}` (seed {calib.get('seed')}, token ids "
                     f"sha256 `{str(calib.get('sha256', ''))[:16]}`)")
    skipped = meta.get("skipped") or []
    lines.append(f"- kept in high precision: {', '.join(f'`{s}`' for s in skipped) or 'none'}"
                 + (f" ({100 * hp['high_precision_fraction']:.1f}% of parameters)"
                    if hp else ""))
    lines += ["", "Recipe (`fp8ptq quantize --recipe` reproduces it from this folder):", "",
              "```yaml", yaml.safe_dump({k: v for k, v in recipe.items() if v not in (None, [],
                                                                                      {})},
                                        sort_keys=True).strip(), "```", "",
              "## How to load it", ""]
    if "transformers" in stored.runtimes:
        lines += ["```python", "from transformers import AutoModelForCausalLM",
                  "model = AutoModelForCausalLM.from_pretrained(\"PATH\")  # needs "
                  "compressed-tensors", "```", "", "```bash", "vllm serve PATH", "```", ""]
    lines += ["```python", "import fp8ptq", "loaded = fp8ptq.load(\"PATH\")  # exact CPU "
              "simulation; loaded.model, loaded.tokenizer", "```", "",
              "`fp8ptq validate PATH` checks it against what vLLM and transformers accept.", "",
              "## Evaluation", "", EVAL_BEGIN,
              "Not evaluated yet: `fp8ptq eval PATH --update-card` adds the table here.",
              EVAL_END, ""]
    warnings = meta.get("warnings") or []
    if warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in warnings[:20]] + [""]
    return "\n".join(lines)


def write(folder: Path, meta: dict, config: dict) -> None:
    (Path(folder) / CARD_NAME).write_text(render(meta, config))


def update_evaluation(folder: Path, markdown_table: str, protocol_lines: list[str]) -> Path:
    """Replace the evaluation section of ``folder``'s card (written atomically)."""
    card = Path(folder) / CARD_NAME
    text = card.read_text() if card.is_file() else f"{EVAL_BEGIN}\n{EVAL_END}\n"
    if EVAL_BEGIN not in text or EVAL_END not in text:
        text += f"\n## Evaluation\n\n{EVAL_BEGIN}\n{EVAL_END}\n"
    head, rest = text.split(EVAL_BEGIN, 1)
    _, tail = rest.split(EVAL_END, 1)
    body = markdown_table.strip() + "\n\n" + "\n".join(f"- {p}" for p in protocol_lines)
    write_text(card, f"{head}{EVAL_BEGIN}\n{body}\n{EVAL_END}{tail}")
    return card
