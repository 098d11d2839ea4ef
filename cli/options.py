"""Recipe flags shared by ``quantize`` and ``eval`` (one definition, so they cannot drift)."""

from __future__ import annotations

import click

from fp8ptq.calibrators import registry as calibrators
from fp8ptq.config.recipe import CALIB_WINDOWS, SMOOTHQUANT_INTO, Recipe, moot_options
from fp8ptq.config.schemes import scheme_names
from fp8ptq.errors import UsageError
from fp8ptq.execution.placement import parse_placement
from fp8ptq.formats import ROUNDINGS
from fp8ptq.formats.granularity import ACT_GRANULARITIES, WEIGHT_GRANULARITIES
from fp8ptq.io.loading import is_torch_module_file, source_note


def _opt(*decls: str, **attrs):
    """The arguments of one ``click.option``; built later so a command can rename the flag."""
    return decls, attrs


_SPECS = [
    _opt("--recipe", "recipe_path", type=click.Path(),
         help="YAML/JSON recipe (or an fp8ptq.json / output folder to reproduce a run)."),
    _opt("--scheme", help="Named preset: " + ", ".join(scheme_names()) + " (fp8ptq schemes "
         "lists them); explicit flags override its fields."),
    _opt("--calib-data", help="Calibration text: .txt/.json/.jsonl/.parquet file or hub "
         "dataset 'name[:config][:split]' (default: wikitext-2-raw-v1 train, needs the hub); for "
                 "CNNs an image tensor file (.pt/.npz) or 'digits'."),
    _opt("--text-field", help="Text field of .json/.jsonl/.parquet calibration data."),
    _opt("--num-samples", type=int, help="Calibration sequences [64]."),
    _opt("--seq-len", "calib_seq_len", type=int, help="Calibration sequence length [512]."),
    _opt("--seed", type=int, help="Seed for sampling calibration windows [0]."),
    _opt("--calib-windows", type=click.Choice(CALIB_WINDOWS),
         help="How calibration samples are cut: 'random' offsets into the concatenated "
              "documents, or 'documents' (each sample opens a document after the BOS, as "
              "in evaluation and in llm-compressor) [documents]."),
    _opt("--batch-size", "calib_batch_size", type=int, help="Calibration batch size [8]."),
    _opt("--weight-format", help="Weight format when it differs from --format."),
    _opt("--act-format", help="Activation format when it differs from --format; 'none' = "
         "weight-only (W8A16)."),
    _opt("--weight-granularity", type=click.Choice(WEIGHT_GRANULARITIES),
         help="Weight scales per tensor, output channel or 2-D block [channel]."),
    _opt("--block-size", type=int, help="Block edge for --weight-granularity block [128]."),
    _opt("--act-granularity", type=click.Choice(ACT_GRANULARITIES),
         help="token = dynamic per token (FP8_DYNAMIC); tensor = static calibrated scales; "
              "group = dynamic per --act-group-size features of each token (with "
              "--weight-granularity block: FP8_BLOCK) [token; tensor on convolutions]."),
    _opt("--act-group-size", type=int,
         help="Features per dynamic activation group (--act-granularity group) [128]."),
    _opt("--weight-calib", help=f"Weight calibrator: {calibrators.help_text('weight')} "
         "[gptq with --calib-data, else max]."),
    _opt("--gptq-damp", type=float, help="GPTQ dampening, fraction of the Hessian's mean "
         "diagonal [0.01]."),
    _opt("--gptq-act-order/--no-gptq-act-order", default=None,
         help="GPTQ: quantize columns in order of decreasing input energy [on]."),
    _opt("--gptq-sequential/--no-gptq-sequential", default=None,
         help="GPTQ: take each GEMM's Hessian from the model quantized so far, group by group "
              "in run order (errors of earlier layers compensated), or all from one pass over "
              "the float model [sequential]."),
    _opt("--gptq-asym/--no-gptq-asym", default=None,
         help="Sequential GPTQ aims each GEMM at the float model's output (asymmetric GPTQ, "
              "GPTAQ): a float stream runs beside the quantized one [off]."),
    _opt("--act-calib",
         help=f"Activation calibrator: {calibrators.help_text('activation')} [max]."),
    _opt("--percentile", type=float, help="Percentile for --act-calib percentile [99.99]."),
    _opt("--rounding", type=click.Choice(ROUNDINGS),
         help="Rounding of weights (default: the format's own)."),
    _opt("--scale-pow2", is_flag=True, default=None,
         help="Round every scale up to a power of two (an exponent-bias shift)."),
    _opt("--skip", multiple=True, help="Glob of module names to keep in high precision "
         "(repeatable). lm_head is skipped unless --quantize-lm-head."),
    _opt("--quantize-lm-head", is_flag=True, default=None, help="Quantize lm_head too."),
    _opt("--override", "overrides", multiple=True,
         help="PATTERN=FORMAT per-module format, FORMAT 'none' keeps it high precision."),
    _opt("--smoothquant", help="SmoothQuant: migration strength ALPHA in [0, 1] "
         "(e.g. 0.5) or 'auto' (alpha searched per layer by output error)."),
    _opt("--smoothquant-into", type=click.Choice(SMOOTHQUANT_INTO),
         help="Where --smoothquant folds 1/s: 'norms' (norm -> q/k/v, gate/up), 'gemms' "
         "(exact GEMM -> GEMM pairs: up -> down_proj, v -> o_proj, found by tracing) or "
         "'all' [norms]."),
    _opt("--rotate", type=click.Choice(["hadamard"]),
         help="Fold a random Hadamard rotation of the residual stream (and per-head V/O path) "
         "into the weights before calibration; norms folded, embeddings untied; standard "
         "architecture (Llama/Qwen2/Mistral/Qwen3/GPT-2)."),
    _opt("--pow2-range", help="Exponent range LOW,HIGH searched by --act-calib "
         "pow2-search [-4,5]."),
    _opt("--bn-retune", is_flag=True, default=None,
         help="Re-estimate BatchNorm statistics with quantization active (CNNs)."),
    _opt("--keep-depthwise", is_flag=True, default=None,
         help="Keep depthwise convolutions in high precision."),
    _opt("--keep-first-last", is_flag=True, default=None,
         help="Keep the first and the last GEMM in high precision (CNNs)."),
    _opt("--quantize-attention", is_flag=True, default=None,
         help="Also quantize the inputs of the attention batched matmuls (Q, K, V, P)."),
    _opt("--kv-cache", type=click.Choice(["fp8"]),
         help="Quantize the KV cache: K (after RoPE) and V in e4m3 with static scales from the "
              "calibration pass, written as vLLM reads them (kv_cache_scheme, "
              "<attention>.k_scale / .v_scale) and simulated by eval."),
    _opt("--kv-granularity", type=click.Choice(["tensor", "head"]),
         help="--kv-cache scales: one per attention layer, or one per KV head [tensor]."),
    _opt("--quantize-residual", is_flag=True, default=None,
         help="Also quantize the inputs of residual additions."),
    _opt("--calibrate-all-experts/--routed-experts-only", "calibrate_all_experts", default=None,
         help="MoE: observe every expert on every calibration token (outputs still combined "
              "by the router's choice) [on]; off: each expert sees only its routed tokens."),
    _opt("--quantize-router", is_flag=True, default=None,
         help="MoE: quantize the router / shared-expert gate GEMMs too (high precision by "
              "default)."),
    _opt("--unify-fused-scales/--no-unify-fused-scales", "unify_fused_scales", default=None,
         help="One input scale (and, with per-tensor weights, one weight scale) per group of "
              "shards a runtime fuses (q/k/v, gate/up) [on for e4m3 / int8]."),
    _opt("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
         help="Dtype the model is loaded and run in [bfloat16]."),
]


def _param_name(decls) -> str:
    named = [d for d in decls if not d.startswith("-")]
    return named[0] if named else decls[0].split("/")[0].lstrip("-").replace("-", "_")


def recipe_option_list(flag_names: dict[str, str] | None = None) -> list:
    """The recipe flags as click options; ``flag_names`` maps a parameter name to the flag a
    command shows instead (``eval`` has its own --seq-len/--batch-size), the parameter name
    (what ``build_recipe`` reads) stays."""
    flag_names = flag_names or {}
    unknown = set(flag_names) - {_param_name(decls) for decls, _ in _SPECS}
    if unknown:
        raise ValueError(f"no recipe flag with parameter {sorted(unknown)}")
    out = []
    for decls, attrs in _SPECS:
        param = _param_name(decls)
        if param in flag_names:
            decls = (flag_names[param], param)
        out.append(click.option(*decls, **attrs))
    return out


RECIPE_OPTIONS = recipe_option_list()


def recipe_options(f=None, *, flag_names: dict[str, str] | None = None):
    """Decorator adding every recipe flag: ``@recipe_options`` or
    ``@recipe_options(flag_names={"calib_seq_len": "--calib-seq-len"})``."""

    def decorate(f):
        options = recipe_option_list(flag_names) if flag_names else RECIPE_OPTIONS
        for option in reversed(options):
            f = option(f)
        return f

    return decorate(f) if f is not None else decorate


def loading_options(f):
    """How a model is loaded: ``--device-map``, ``--max-memory``, ``--offload-folder`` (handed to
    accelerate, see ``fp8ptq.execution.placement``), ``--trust-pickle`` and
    ``--trust-remote-code``; the
    command reads them with ``loading_from``."""
    options = [
        click.option("--trust-pickle", is_flag=True, default=False,
                     help="Allow full unpickling of .pt models / checkpoint skeletons that name "
                          "classes beyond torch.nn (runs code from the file: trusted files "
                          "only)."),
        click.option("--trust-remote-code", is_flag=True, default=False,
                     help="Let transformers run the model repository's own code (trusted "
                          "repositories only)."),
        click.option("--device-map", default=None,
                     help="accelerate device map: auto|balanced|balanced_low_0|sequential, a "
                          "JSON object {module: device} ('disk' offloads) or a .json file."),
        click.option("--max-memory", default=None,
                     help="Memory per device for the device map: SIZE (CPU) or "
                          "DEVICE=SIZE[,...], e.g. 0=20GiB,cpu=64GiB (needs --device-map)."),
        click.option("--offload-folder", type=click.Path(), default=None,
                     help="Where disk-offloaded weights go [a temporary folder]."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def note_source(model: str) -> None:
    """One ``note:`` line (stderr) when MODEL is another tool's FP8 checkpoint, dequantized on
    load (``fp8ptq.io.loading.source_note``)."""
    note = source_note(model)
    if note:
        click.echo(f"note: {note}", err=True)


def loading_from(kwargs: dict) -> dict:
    """Pops the ``loading_options`` flags into keyword arguments of ``job.load``."""
    device_map, max_memory = kwargs.pop("device_map"), kwargs.pop("max_memory")
    folder = kwargs.pop("offload_folder")
    placement = None if device_map is None and max_memory is None else parse_placement(
        device_map, max_memory, folder)
    return {"device_map": placement, "trust_pickle": kwargs.pop("trust_pickle"),
            "trust_remote_code": kwargs.pop("trust_remote_code")}


def parse_overrides(items) -> dict[str, str] | None:
    if not items:
        return None
    out = {}
    for item in items:
        pattern, sep, fmt = (part.strip() for part in item.partition("="))
        if not sep or not pattern or not fmt:
            raise UsageError(f"--override expects PATTERN=FORMAT, got {item!r}")
        out[pattern] = fmt
    return out


def parse_range(text):
    if text is None:
        return None
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"--pow2-range expects LOW,HIGH integers, got {text!r}") from None
    return (low, high)


# Recipe flags whose parameter is not the Recipe field's name, and those parsed from text; every
# other recipe flag's parameter IS a Recipe field (tests/test_recipe_flags.py checks both), so a
# new recipe field needs its Recipe line and its _SPECS line, nothing here.
FIELD_OF = {"calib_seq_len": "seq_len", "calib_batch_size": "batch_size"}
PARSE = {"overrides": parse_overrides, "pow2_range": parse_range, "skip": lambda v: list(v) or None}


def recipe_params() -> list[str]:
    """The parameter names of the recipe flags that set a Recipe field (not ``--recipe``)."""
    return [p for p in (_param_name(decls) for decls, _ in _SPECS) if p != "recipe_path"]


def build_recipe(kwargs: dict, *, model: str | None = None, **extra) -> Recipe:
    """Recipe file (if any) < flags given on the command line. Pops the recipe flags. With
    ``model``, the options the resolved recipe makes moot are named in one ``warning:`` line
    (refused where the command line contradicts itself, ``check_moot``)."""
    path = kwargs.pop("recipe_path", None)
    base = Recipe.load(path) if path else Recipe()
    flags = {FIELD_OF.get(p, p): PARSE.get(p, lambda v: v)(kwargs.pop(p))
             for p in recipe_params()}
    flags.update(extra)
    recipe = base.merged(**flags)
    if model is not None:
        check_moot(recipe, {k for k, v in flags.items() if v is not None},
                   convolutions=is_torch_module_file(model))
    return recipe


def check_moot(recipe: Recipe, on_command_line: set[str], *, convolutions: bool = False):
    """One ``warning:`` line (stderr) naming every option ``recipe`` makes moot; a
    ``UsageError`` where the command line names both a moot option and what makes it moot
    (``--act-granularity token --act-calib mse``): that can only be a mistake."""
    moot = moot_options(recipe, convolutions=convolutions)
    mistakes = [m for m in moot if m.field in on_command_line
                and on_command_line.intersection(m.causes)]
    if mistakes:
        m = mistakes[0]
        causes = " ".join(_flag(recipe, c) for c in m.causes if c in on_command_line)
        raise UsageError(f"{_flag(recipe, m.field)} has no effect with {causes}: {m.reason}; "
                         "drop one of them")
    if moot:
        click.echo("warning: options with no effect under this recipe: " + "; ".join(
            f"{_flag(recipe, m.field)} ({m.reason})" for m in moot), err=True)
    return moot


def _flag(recipe: Recipe, field: str) -> str:
    """``field``'s value as the flag that sets it (``--act-calib best``, ``--no-gptq-asym``)."""
    value = getattr(recipe, field)
    name = {"seq_len": "seq-len", "batch_size": "batch-size"}.get(field, field.replace("_", "-"))
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no-{name}"
    if isinstance(value, tuple):
        value = ",".join(map(str, value))
    return f"--{name} {value}"

