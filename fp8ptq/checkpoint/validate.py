"""Will a runtime accept this checkpoint, and compute what fp8ptq measured? (``fp8ptq validate``)

Two parts:

* **Static rules** (``RULES``), each read from the runtime's own source and cited there, checked
  against ``fp8ptq.json`` / ``config.json`` / the tensors: what vLLM's compressed-tensors scheme
  selection accepts, what its block-FP8 and fused-MoE kernels need, how it names KV-cache scales,
  what it does with fused shards. Each violation is one line: module, rule, fix.
* **Reload** through transformers (with compressed-tensors) and through ``fp8ptq.load``: a few
  tokens through both, the largest logit difference reported; above ``TOLERANCE`` of the logit
  range it fails. transformers decompresses the weights exactly (tested bit for bit) and
  quantizes Linear inputs like fp8ptq; it does not quantize the inputs of fused MoE experts,
  which is what the tolerance leaves room for.

Exit codes (CLI): 0 valid for every runtime asked for, 4 invalid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from ..taps.taps import model_taps
from .reader import load_quantized
from .runtime_rules import RULES, Rule, Violation, read_checkpoint, served, vllm_linear_scheme

RUNTIMES = ("vllm", "transformers")
TOLERANCE = 0.02  # max |logit difference| / max |logit| between transformers and fp8ptq.load


@dataclass
class Report:
    path: str
    runtimes: list[str]
    violations: list[Violation] = field(default_factory=list)
    reload: dict | None = None

    @property
    def valid(self) -> bool:
        return not [v for v in self.violations if v.severity == "error"] and (
            self.reload is None or self.reload.get("ok", True))

    def as_dict(self) -> dict:
        return {"path": self.path, "runtimes": self.runtimes, "valid": self.valid,
                "violations": [vars(v) for v in self.violations], "reload": self.reload,
                "rules": [{"name": r.name, "runtime": r.runtime, "source": r.source}
                          for r in RULES if r.runtime in self.runtimes]}


# --- reload ----------------------------------------------------------------------------------


def reload_difference(path, tokens: int = 16, seed: int = 0) -> dict:
    """Logits of a few random tokens through ``fp8ptq.load`` and through transformers'
    ``from_pretrained`` (compressed-tensors), both in float32."""
    from transformers import AutoModelForCausalLM

    ours = load_quantized(path, dtype=torch.float32).model
    vocab = getattr(ours.config, "vocab_size", 128)
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        a = ours(input_ids=ids).logits.float()
        theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        b = theirs(input_ids=ids).logits.float()
        a_plain = _without_kv_cache(ours, ids)
    diff = float((a - b).abs().max())
    scale = float(a.abs().max()) or 1.0
    out = {"tokens": tokens, "max_abs_logit_diff": diff, "relative": diff / scale,
           "tolerance": TOLERANCE, "ok": diff / scale <= TOLERANCE}
    if a_plain is not None:  # is it transformers that leaves the KV cache unquantized?
        plain = float((a_plain - b).abs().max())
        out["kv_cache_off"] = {"max_abs_logit_diff": plain, "relative": plain / scale}
        out["transformers_quantizes_kv_cache"] = diff <= plain
        out["ok"] = min(diff, plain) / scale <= TOLERANCE
    return out


def _without_kv_cache(model, ids) -> torch.Tensor | None:
    """``model``'s logits with its KV-cache taps passing K and V through (None: it has none):
    transformers quantizes the KV cache only where compressed-tensors treats the attention as
    KV-cached, which depends on the installed versions."""
    taps = model_taps(model)
    if taps is None or "kv" not in taps.kinds.values():
        return None
    with taps.paused():
        return model(input_ids=ids).logits.float()


def validate(path, runtimes=RUNTIMES, *, reload: bool = True) -> Report:
    ck = read_checkpoint(path)
    report = Report(str(path), list(runtimes))
    for rule in RULES:
        if rule.runtime in runtimes:
            report.violations += [v for v in rule.check(ck) if v not in report.violations]
    if reload and "transformers" in runtimes and served(ck, "transformers"):
        try:
            report.reload = reload_difference(ck["path"])
        except Exception as e:  # noqa: BLE001 - transformers refused: that is the finding
            report.reload = {"ok": False, "error": f"{type(e).__name__}: "
                                                  f"{str(e).splitlines()[0] if str(e) else ''}"}
    return report


def static_violations(path, runtime: str = "vllm") -> list[Violation]:
    """The static rules of ``runtime`` (no reload): what ``quantize`` checks on what it wrote."""
    ck = read_checkpoint(path)
    return [v for rule in RULES if rule.runtime == runtime for v in rule.check(ck)]


def dumps(report: Report, **extra) -> str:
    """The report as JSON, ``extra`` fields (the command's seconds and peak RSS) after it."""
    return json.dumps({**report.as_dict(), **extra}, indent=2, default=str)


__all__ = ["validate", "static_violations", "reload_difference", "dumps", "Report", "Violation",
           "Rule", "RULES", "RUNTIMES", "TOLERANCE", "vllm_linear_scheme"]
