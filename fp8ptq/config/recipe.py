"""A quantization recipe: everything the ``quantize`` flags can say, as data.

Recipes load from YAML/JSON (``--recipe``; an ``fp8ptq.json`` works too: its ``recipe`` key is
used), flags override them, and the merged recipe is recorded in ``fp8ptq.json``.
Reading a recipe file and checking each value's type: ``recipe_values``; the fields a resolved
recipe leaves without effect: ``moot``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..calibrators import registry as calibrators
from ..errors import UsageError
from ..formats import ROUNDINGS, get_format
from ..formats.granularity import ACT_GRANULARITIES, WEIGHT_GRANULARITIES
from .recipe_values import OVERRIDE_KEYS, _check_type, _choice, load_recipe_dict  # noqa: F401 - OVERRIDE_KEYS re-exported
from .schemes import expand_scheme, scheme_names

# How calibration samples are cut from the documents (``fp8ptq.io.data.build_calibration_set``):
# "random": seeded random offsets into the concatenated documents; "documents": each sample
# opens a seeded random document after the token every sequence opens with.
CALIB_WINDOWS = ("random", "documents")
START_TOKENS = ("auto", "bos", "eos", "none")  # what a sequence opens with (io.data.start_ids)
SMOOTHQUANT_INTO = ("norms", "gemms", "all")  # where --smoothquant folds 1/s (smoothquant.py)
KV_CACHE_FORMATS = {"fp8": "e4m3"}  # --kv-cache value -> the format of the cached K / V
KV_GRANULARITIES = ("tensor", "head")  # compressed-tensors strategies "tensor" / "attn_head"
ROTATIONS = ("hadamard",)  # --rotate (fp8ptq.algorithms.rotation)
DTYPES = ("float32", "bfloat16", "float16")  # what the model is loaded and run in

# the non-format keys of a partial plan: recipe fields the matching modules take instead
OVERRIDE_FIELDS = ("weight_calib", "weight_granularity", "act_granularity")


def flag(default: Any, help: str, *, name: str | None = None, param: str | None = None,
         choices=None, off: str | None = None) -> Any:
    """A ``Recipe`` field that is also a flag of ``quantize``, ``eval`` and ``sensitivity``:
    the click option is derived from this declaration (``fp8ptq.cli.options``), so a new flag
    is this one field. ``default``: the value, or a callable making it (a list or dict);
    ``help``: the flag's help text (the field's description); ``name``: the flag, when not
    ``--field-name``; ``param``: the option's parameter, when not the field's name (a command
    may show the flag under another name: ``eval``'s ``--calib-seq-len``); ``choices``: the
    values click accepts (``check_values`` checks recipe files); ``off``: the flag that sets a
    boolean False (without it the flag only sets True). The rest follows from the field's
    type: an int or float flag takes that type, a bool is a switch, a list or dict a flag
    given once per item."""
    spec = {"name": name, "param": param, "off": off,
            "choices": None if choices is None else list(choices)}
    value = {"default_factory": default} if callable(default) else {"default": default}
    return Field(**value, description=help,
                 json_schema_extra={"flag": {k: v for k, v in spec.items() if v is not None}})


def flag_spec(info) -> dict | None:
    """The ``flag`` declaration of a field (its ``FieldInfo``), or None for a field no flag
    sets (``format``: each command has its own ``--format``)."""
    extra = info.json_schema_extra
    return extra.get("flag") if isinstance(extra, dict) else None


def _auto_dtype(name: str, device):
    """A dtype field's torch dtype on ``device``: ``auto`` is float64 on the CPU (host memory is
    cheap) and float32 elsewhere."""
    import torch  # the recipe module itself stays importable without torch
    if name == "auto":
        name = "float64" if torch.device(device).type == "cpu" else "float32"
    return getattr(torch, name)


class Recipe(BaseModel):
    """Every field is one line: its type (checked, with a plain message, from the annotation),
    its default and a comment; a field the commands take as a flag is declared with ``flag``
    (its help text, and the flag's name or choices where they are not derived). Value checks
    that need more than a type are in ``check_values``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False,
                              arbitrary_types_allowed=True)

    # a named preset (``fp8ptq.config.schemes``): its fields are the defaults under the fields given
    # explicitly; the name stays recorded
    scheme: str | None = flag(
        None, "Named preset: " + ", ".join(scheme_names()) + " (fp8ptq schemes lists them); "
        "explicit flags override its fields.")
    format: str = "e4m3"  # the commands' own --format
    weight_format: str | None = flag(  # default: ``format``
        None, "Weight format when it differs from --format.")
    act_format: str | None = flag(  # default: ``format``; "none" = weight-only
        None, "Activation format when it differs from --format; 'none' = weight-only (W8A16).")
    weight_granularity: str = flag(
        "channel", "Weight scales per tensor, output channel or 2-D block [channel].",
        choices=WEIGHT_GRANULARITIES)
    block_size: int = flag(128, "Block edge for --weight-granularity block [128].")
    # token (dynamic per token: FP8_DYNAMIC, the default) | tensor (static) | group (dynamic);
    # the default on convolutions is "tensor" (a conv input has no token axis: plan.py)
    act_granularity: str = flag(
        "token", "token = dynamic per token (FP8_DYNAMIC); tensor = static calibrated scales; "
        "group = dynamic per --act-group-size features of each token (with "
        "--weight-granularity block: FP8_BLOCK) [token; tensor on convolutions].",
        choices=ACT_GRANULARITIES)
    act_group_size: int = flag(  # features per dynamic activation group (act_granularity group)
        128, "Features per dynamic activation group (--act-granularity group) [128].")
    # "gptq" by default when the recipe has calibration data and names no weight calibrator
    # (``_default_weight_calib``): the most accurate recipe vLLM serves at full FP8 speed
    weight_calib: str = flag(
        "max", f"Weight calibrator: {calibrators.help_text('weight')} "
        "[gptq with --calib-data, else max].")
    act_calib: str = flag(
        "max", f"Activation calibrator: {calibrators.help_text('activation')} [max].")
    percentile: float = flag(99.99, "Percentile for --act-calib percentile [99.99].")
    gptq_damp: float = flag(  # GPTQ dampening, a fraction of the Hessian's mean diagonal
        0.01, "GPTQ dampening, fraction of the Hessian's mean diagonal [0.01].")
    gptq_act_order: bool = flag(  # GPTQ: columns in order of decreasing input energy
        True, "GPTQ: quantize columns in order of decreasing input energy [on].",
        off="--no-gptq-act-order")
    gptq_block: int = 128  # GPTQ lazy-update block (columns)
    # what GPTQ's Hessian sums are accumulated in (each batch's product is float32 either way);
    # float32 is llm-compressor's, halves the sums' memory, and is a factor of the comparison;
    # auto: float32 on a GPU (there the Cholesky factor follows: memory is the GPU's scarcest
    # resource), float64 on the CPU (``hessian_dtype_on``)
    gptq_hessian_dtype: str = flag(
        "auto", "GPTQ: accumulate the Hessian sums (and factor them) in this dtype [auto: "
        "float32 on a GPU, float64 on the CPU].", choices=("auto", "float64", "float32"))
    # the column sweep's dtype (weight copy, inverse factor, errors); mixed: float32 storage,
    # each 128-column block's loop in float64 (``sweep.Precision``). auto (``sweep_dtype_on``):
    # float64 on the CPU, mixed on a GPU (float32's memory): each better than float32 on both
    # families over five seeds (docs/results/studies.md, "Two families for every default")
    gptq_sweep_dtype: str = flag(
        "auto", "GPTQ: run the column sweep in this dtype; mixed: float32 storage, float64 "
        "inside each block [auto: float64 on the CPU, mixed on a GPU].",
        choices=("auto", "float64", "float32", "mixed"))
    # GPTQ Hessians from the already-quantized model, group by group in run order
    # (``fp8ptq.algorithms.gptq.sequential``); False: all from one pass over the float model
    gptq_sequential: bool = flag(
        True, "GPTQ: take each GEMM's Hessian from the model quantized so far, group by group "
        "in run order (errors of earlier layers compensated), or all from one pass over the "
        "float model [sequential].", off="--no-gptq-sequential")
    # asymmetric GPTQ (``fp8ptq.algorithms.gptq.asym``, sequential only): each GEMM aims at the
    # float model's
    # output on the float model's inputs, not its own output on the quantized model's inputs
    gptq_asym: bool = flag(
        False, "Sequential GPTQ aims each GEMM at the float model's output (asymmetric GPTQ, "
        "GPTAQ): a float stream runs beside the quantized one [off].", off="--no-gptq-asym")
    # sink-aware GPTQ (``fp8ptq.algorithms.gptq.sink``, sequential only): the first token of each
    # calibration sequence (the attention sink) weighted in, with its real quantized input
    gptq_sink: float | None = flag(  # None: 1 for causal language models, else 0
        None, "Sequential GPTQ also keeps each sequence's first token (the attention sink) "
        "exact through the GEMM's own input rounding, weighted W against all tokens (0: off) "
        "[1 for causal language models, else 0].")
    # what sink-aware GPTQ keeps each first token's output at (``fp8ptq.algorithms.gptq.sink``):
    # "layer", the float weight's output on the input the quantized model gives the GEMM;
    # "float", the float model's output, from a float stream of the first positions alone
    gptq_sink_target: str = flag(
        "layer", "Sink-aware GPTQ keeps the first token's output at the float weight's on the "
        "quantized model's input (layer), or at the float model's (float: each GEMM also "
        "undoes the drift the layers before left in the first token) [layer].",
        choices=("layer", "float"))
    # MoE (``fp8ptq.algorithms.gptq.experts``): each expert's GPTQ Hessians from every
    # calibration token instead of the tokens the router sends it
    gptq_all_experts: bool = flag(
        False, "MoE: each expert's GPTQ Hessians from every calibration token (llm-compressor's "
        "moe_calibrate_all_experts) instead of the tokens the router sends it [off].")
    rounding: str | None = flag(  # default: the format's own
        None, "Rounding of weights (default: the format's own).", choices=ROUNDINGS)
    scale_pow2: bool = flag(
        False, "Round every scale up to a power of two (an exponent-bias shift).")
    skip: list[str] = flag(
        list, "Glob of module names to keep in high precision (repeatable). lm_head is skipped "
        "unless --quantize-lm-head.")
    quantize_lm_head: bool = flag(False, "Quantize lm_head too.")
    # glob -> format name / "none", or a partial plan {format, weight_format, act_format}
    overrides: dict[str, Any] = flag(
        dict, "PATTERN=FORMAT per-module format, FORMAT 'none' keeps it high precision.",
        name="--override")
    smoothquant: float | str | None = flag(  # alpha in [0, 1], or "auto" (searched per layer)
        None, "SmoothQuant: migration strength ALPHA in [0, 1] (e.g. 0.5) or 'auto' (alpha "
        "searched per layer by output error).")
    # where SmoothQuant folds 1/s (SMOOTHQUANT_INTO): "norms" (norm -> q/k/v, gate/up),
    # "gemms" (GEMM -> GEMM: up -> down, v -> o; fp8ptq.algorithms.smoothquant.pairs) or "all"
    # (both)
    smoothquant_into: str = flag(
        "norms", "Where --smoothquant folds 1/s: 'norms' (norm -> q/k/v, gate/up), 'gemms' "
        "(exact GEMM -> GEMM pairs: up -> down_proj, v -> o_proj, found by tracing) or 'all' "
        "[norms].", choices=SMOOTHQUANT_INTO)
    # "hadamard": random Hadamard folded into the weights (rotation.py)
    rotate: str | None = flag(
        None, "Fold a random Hadamard rotation of the residual stream (and per-head V/O path) "
        "into the weights before calibration; norms folded, embeddings untied; standard "
        "architecture (Llama/Qwen2/Mistral/Qwen3/GPT-2).", choices=ROTATIONS)
    pow2_range: tuple[int, int] = flag(  # exponents searched by --act-calib pow2-search
        (-4, 5), "Exponent range LOW,HIGH searched by --act-calib pow2-search [-4,5].")
    bn_retune: bool = flag(
        False, "Re-estimate BatchNorm statistics with quantization active (CNNs).")
    keep_depthwise: bool = flag(False, "Keep depthwise convolutions in high precision.")
    keep_first_last: bool = flag(
        False, "Keep the first and the last GEMM in high precision (CNNs).")
    quantize_attention: bool = flag(
        False, "Also quantize the inputs of the attention batched matmuls (Q, K, V, P; "
        "simulation only). With --kv-cache fp8: FP8 attention as vLLM serves it, Q / K / V "
        "scales per --kv-granularity written as llm-compressor writes them (q_scale).")
    # "fp8": K (after RoPE) and V quantized to e4m3 with static scales from the calibration
    # pass, written as vLLM's kv_cache_scheme + <attention>.k_scale / .v_scale
    kv_cache: str | None = flag(
        None, "Quantize the KV cache: K (after RoPE) and V in e4m3 with static scales from the "
        "calibration pass, written as vLLM reads them (kv_cache_scheme, <attention>.k_scale / "
        ".v_scale) and simulated by eval.", choices=KV_CACHE_FORMATS)
    kv_granularity: str = flag(  # one K / V scale per attention layer, or per KV head
        "tensor", "--kv-cache scales: one per attention layer, or one per KV head [tensor].",
        choices=KV_GRANULARITIES)
    quantize_residual: bool = flag(False, "Also quantize the inputs of residual additions.")
    calibrate_all_experts: bool = flag(  # MoE: every token also observed through every expert
        True, "MoE: observe every expert on every calibration token (outputs still combined by "
        "the router's choice) [on]; off: each expert sees only its routed tokens.",
        off="--routed-experts-only")
    quantize_router: bool = flag(  # MoE: router / shared-expert gate GEMMs quantized too
        False, "MoE: quantize the router / shared-expert gate GEMMs too (high precision by "
        "default).")
    unify_fused_scales: bool | None = flag(  # None: on for e4m3 / int8 (compressed-tensors)
        None, "One input scale (and, with per-tensor weights, one weight scale) per group of "
        "shards a runtime fuses (q/k/v, gate/up) [on for e4m3 / int8].",
        off="--no-unify-fused-scales")
    calib_data: str | None = flag(
        None, "Calibration text: .txt/.json/.jsonl/.parquet file or hub dataset "
        "'name[:config][:split]' (default: wikitext-2-raw-v1 train, needs the hub); for CNNs "
        "an image tensor file (.pt/.npz) or 'digits'.")
    text_field: str | None = flag(None, "Text field of .json/.jsonl/.parquet calibration data.")
    # 64 x 512 calibration tokens: every forward and Hessian of sequential GPTQ scales with
    # them; benchmarks/studies/calib_size_study.py measures the default recipe at other sizes and
    # seeds (docs/results/studies.md, "Calibration size of the default recipe")
    num_samples: int = flag(64, "Calibration sequences [64].")
    seq_len: int = flag(512, "Calibration sequence length [512].", param="calib_seq_len")
    # how the samples are cut (``fp8ptq.io.data.CALIB_WINDOWS``): "documents" (each opens a
    # document after the BOS; the default: on SmolLM2 both the default GPTQ recipe and
    # weight-only GPTQ lose less with them than with random windows, docs/results/studies.md), or
    # "random" offsets into the concatenated documents
    calib_windows: str = flag(
        "documents", "How calibration samples are cut: 'random' offsets into the concatenated "
        "documents, or 'documents' (each sample opens a document after the start token: "
        "the BOS the tokenizer adds, else the chat template's first token, else BOS, else "
        "EOS, as eval's --prefix-token auto) [documents].", choices=CALIB_WINDOWS)
    # the token document windows open with (``fp8ptq.io.data.start_ids``): auto is the one
    # evaluation (``eval --prefix-token auto``) and serving open with; another is for a stack
    # that opens sequences otherwise (``eval --compare`` sets it to its ``--prefix-token``)
    calib_prefix_token: str = flag(
        "auto", "Token each calibration document window opens with; match how the model is "
        "served and evaluated (eval's --prefix-token) [auto].", choices=START_TOKENS)
    batch_size: int = flag(8, "Calibration batch size [8].", param="calib_batch_size")
    seed: int = flag(0, "Seed for sampling calibration windows [0].")
    dtype: str = flag("bfloat16", "Dtype the model is loaded and run in [bfloat16].",
                      choices=DTYPES)

    def __init__(self, *args, **data):
        if args:  # positional construction, in field order (as the dataclass allowed)
            data = {**dict(zip(type(self).model_fields, args)), **data}
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _types(cls, data: Any) -> Any:
        """Recipe files are hand-written YAML: catch unknown keys and wrong types with a clear
        ``UsageError`` (a bare string for ``skip`` would otherwise be split into one-character
        globs). Types come from the annotations, so a new field needs no code here."""
        if not isinstance(data, dict):
            return data
        unknown = sorted(set(data) - set(cls.model_fields))
        if unknown:
            raise UsageError(f"unknown recipe key(s): {', '.join(unknown)}; valid: "
                             f"{', '.join(sorted(cls.model_fields))}")
        data = dict(data)
        for key, value in data.items():
            data[key] = _check_type(key, value, cls.model_fields[key].annotation)
        if data.get("scheme") is not None:  # the preset under what this dict says itself
            data = {**expand_scheme(data["scheme"]), **data}
            data["scheme"] = expand_scheme(data["scheme"])["scheme"]  # canonical name
        return data

    @model_validator(mode="after")
    def _values(self) -> Recipe:
        self._default_weight_calib()
        self.check_values()
        return self

    def _default_weight_calib(self) -> None:
        """GPTQ (sequential, act-order) when calibration data is given and no weight
        calibrator was named (a scheme names one): on SmolLM2 it is the most accurate e4m3
        recipe that vLLM serves at full speed (docs/results/studies.md). Without calibration data
        the default stays plain round-to-nearest (``max``), which needs no data at all. The field
        stays "not given" (``model_fields_set``), so ``replace`` / ``merged`` re-decide it
        when calibration data arrives later."""
        if "weight_calib" not in self.model_fields_set and self.calib_data is not None:
            object.__setattr__(self, "weight_calib", "gptq")

    def given(self) -> dict:
        """The fields set explicitly (by a file, flags or a scheme), as ``to_dict`` writes
        them; defaults left out, so that a default that depends on other fields (the weight
        calibrator) is decided again."""
        return {k: v for k, v in self.to_dict().items() if k in self.model_fields_set}

    def check_values(self) -> None:
        """The value checks: names, choices, ranges."""
        for name in (self.format, self.weight_format):
            if name is not None:
                get_format(name)
        if self.act_format not in (None, "none"):
            get_format(self.act_format)
        for pattern, value in self.overrides.items():
            for fmt in override_formats(value).values():
                if fmt != "none":
                    try:
                        get_format(fmt)
                    except UsageError as e:
                        raise UsageError(f"override {pattern}={fmt}: {e}") from None
            if isinstance(value, dict):
                for key in OVERRIDE_FIELDS:
                    if key in value:
                        valid = {"weight_calib": calibrators.names("weight"),
                                 "weight_granularity": WEIGHT_GRANULARITIES,
                                 "act_granularity": ACT_GRANULARITIES}[key]
                        _choice(f"override {pattern} {key}", value[key], valid)
        _choice("weight_granularity", self.weight_granularity, WEIGHT_GRANULARITIES)
        _choice("act_granularity", self.act_granularity, ACT_GRANULARITIES)
        _choice("calib_windows", self.calib_windows, CALIB_WINDOWS)
        _choice("calib_prefix_token", self.calib_prefix_token, START_TOKENS)
        _choice("dtype", self.dtype, DTYPES)
        _choice("act_calib", self.act_calib, calibrators.names("activation"))
        _choice("weight_calib", self.weight_calib, calibrators.names("weight"))
        for key in ("gptq_hessian_dtype", "gptq_sweep_dtype", "gptq_sink_target"):
            _choice(key, getattr(self, key), flag_spec(type(self).model_fields[key])["choices"])
        if self.rounding is not None:
            _choice("rounding", self.rounding, ROUNDINGS)
        for key in ("block_size", "act_group_size", "num_samples", "seq_len", "batch_size",
                    "gptq_block"):
            if getattr(self, key) < 1:
                raise UsageError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.smoothquant is not None and self.smoothquant != "auto":
            if not 0 <= self.smoothquant <= 1:
                raise UsageError(f"smoothquant alpha must be in [0, 1], got {self.smoothquant}")
        _choice("smoothquant_into", self.smoothquant_into, SMOOTHQUANT_INTO)
        if self.rotate is not None:
            _choice("rotate", self.rotate, ROTATIONS)
        if self.pow2_range[0] > self.pow2_range[1]:
            raise UsageError(f"pow2_range must be LOW,HIGH with LOW <= HIGH, got {self.pow2_range}")
        if not 0 < self.percentile <= 100:
            raise UsageError(f"percentile must be in (0, 100], got {self.percentile}")
        if not 0 <= self.gptq_damp <= 1:
            raise UsageError(f"gptq_damp must be in [0, 1], got {self.gptq_damp}")
        if self.kv_cache is not None:
            _choice("kv_cache", self.kv_cache, KV_CACHE_FORMATS)
        _choice("kv_granularity", self.kv_granularity, KV_GRANULARITIES)
        if self.kv_cache is not None and self.quantize_attention:
            _check_fp8_attention(self)
        if self.gptq_asym and not self.gptq_sequential and "gptq_asym" in self.model_fields_set:
            raise UsageError("gptq_asym needs sequential GPTQ (the float stream runs beside the "
                             "quantized one); drop --no-gptq-sequential")
        if self.gptq_sink is not None and not 0 <= self.gptq_sink < float("inf"):
            raise UsageError(f"gptq_sink must be a finite weight >= 0, got {self.gptq_sink}")
        if self.gptq_sink and "gptq_sink" in self.model_fields_set:
            if not self.gptq_sequential:
                raise UsageError("gptq_sink needs sequential GPTQ (the first tokens' inputs "
                                 "come from the model quantized so far); drop "
                                 "--no-gptq-sequential")
            if self.gptq_asym:
                raise UsageError("gptq_sink and gptq_asym aim each GEMM at different targets: "
                                 "pick one")

    def hessian_dtype_on(self, device):
        """``gptq_hessian_dtype`` as the torch dtype the Hessian collectors sum in on
        ``device`` (``auto``: float32 on a GPU, float64 elsewhere)."""
        return _auto_dtype(self.gptq_hessian_dtype, device)

    def sweep_dtype_on(self, device):
        """``gptq_sweep_dtype`` as the ``(storage, loop)`` torch dtypes of a column sweep on
        ``device`` (``sweep.Precision``'s fields; ``mixed``: float32, float64; ``auto``:
        float64 on the CPU, mixed elsewhere, where the weight-sized and ``in x in`` storage
        is the GPU's scarcest resource)."""
        import torch
        name = self.gptq_sweep_dtype
        if name == "auto":
            name = "float64" if torch.device(device).type == "cpu" else "mixed"
        if name == "mixed":
            return torch.float32, torch.float64
        dtype = getattr(torch, name)
        return dtype, dtype

    @property
    def skip_patterns(self) -> list[str]:
        return list(self.skip) + ([] if self.quantize_lm_head else ["lm_head"])

    def to_dict(self) -> dict:
        data = self.model_dump()
        data["pow2_range"] = list(self.pow2_range)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Recipe:
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        return cls.from_dict(load_recipe_dict(path))

    def replace(self, **changes) -> Recipe:
        """A validated copy with ``changes``."""
        return type(self).from_dict({**self.given(), **changes})

    def merged(self, **flags) -> Recipe:
        """A copy with the given (non-None) flag values on top; a ``scheme`` among them goes
        on top of this recipe first, then the other flags on top of it."""
        data = self.given()
        flags = {k: v for k, v in flags.items() if v is not None}
        if "scheme" in flags:
            data.update(expand_scheme(flags["scheme"]))
        data.update(flags)
        return type(self).from_dict(data)


def override_formats(value) -> dict[str, str]:
    """An override's formats as ``{weight_format?, act_format?}``: a format name (or "none")
    sets both; a partial plan sets what it names (``format`` = both)."""
    if isinstance(value, str):
        return {"weight_format": value, "act_format": value}
    out = {k: value["format"] for k in ("weight_format", "act_format")} \
        if "format" in value else {}
    out.update({k: value[k] for k in ("weight_format", "act_format") if k in value})
    return out



def _check_fp8_attention(recipe: Recipe) -> None:
    """FP8 attention (``--kv-cache fp8 --quantize-attention``) is written for vLLM, which reads
    the query / key / value scales only from a compressed-tensors ``kv_cache_scheme``, and the
    checkpoint is compressed-tensors only when weights and activations share an 8-bit type that
    compressed-tensors stores (e4m3 or int8): refused up front for any other format, before a
    model loads."""
    weight = get_format(recipe.format)
    act = recipe.act_format or recipe.format
    act_type = weight.compressed_tensors_type if act == "none" else \
        get_format(act).compressed_tensors_type
    if weight.compressed_tensors_type is None or act_type != weight.compressed_tensors_type:
        raise UsageError(f"--kv-cache fp8 --quantize-attention writes FP8 attention for vLLM, "
                         f"which reads it from compressed-tensors checkpoints only; --format "
                         f"{recipe.format} / activations {act} would be written fp8ptq-native: "
                         "use e4m3 or int8 (or drop --quantize-attention for the "
                         "simulation-only Q/K/V/P rounding)")
