"""Recipe flags shared by ``quantize``, ``eval`` and ``sensitivity``, derived from the Recipe's
fields (``fp8ptq.config.recipe.flag``: one definition, so they cannot drift)."""

from __future__ import annotations

import typing

import click

from fp8ptq.config.moot import moot_options
from fp8ptq.config.recipe import Recipe, flag_spec
from fp8ptq.errors import UsageError
from fp8ptq.io.loading import is_torch_module_file, source_note
from fp8ptq.io.placement import parse_placement


def _opt(*decls: str, **attrs):
    """The arguments of one ``click.option``; built later so a command can rename the flag."""
    return decls, attrs


# ``--recipe`` reads a recipe; every other recipe flag is derived from its Recipe field.
RECIPE_FILE = _opt("--recipe", "recipe_path", type=click.Path(),
                   help="YAML/JSON recipe (or an fp8ptq.json / output folder to reproduce a "
                        "run).")


def field_option(field: str, info) -> tuple[tuple, dict] | None:
    """The click option (decls, attrs) of Recipe field ``field`` (its ``FieldInfo``), from its
    ``flag`` declaration (``fp8ptq.config.recipe.flag``) and its type; None for a field no
    flag sets."""
    spec = flag_spec(info)
    if spec is None:
        return None
    name = spec.get("name", "--" + field.replace("_", "-"))
    param = spec.get("param", field)
    attrs: dict = {"help": info.description}
    if "off" in spec:  # --on/--off: None (not given), True or False
        return (f"{name}/{spec['off']}", param), {**attrs, "default": None}
    if info.annotation is bool:
        attrs.update(is_flag=True, default=None)
    elif typing.get_origin(info.annotation) in (list, dict):
        attrs["multiple"] = True
    elif "choices" in spec:
        attrs["type"] = click.Choice(spec["choices"])
    elif (kind := _number_type(info.annotation)) is not None:
        attrs["type"] = kind
    return (name, param), attrs


def _number_type(annotation) -> type | None:
    """int or float for a field typed so, or that number or None (an automatic default)."""
    if annotation in (int, float):
        return annotation
    args = set(typing.get_args(annotation))
    if len(args) == 2 and type(None) in args:
        (kind,) = args - {type(None)}
        return kind if kind in (int, float) else None
    return None


def recipe_specs(recipe_type: type[Recipe] = Recipe) -> list:
    """``--recipe``, then the option of every flagged field, in the Recipe's field order."""
    fields = recipe_type.model_fields
    return [RECIPE_FILE, *(o for o in (field_option(n, i) for n, i in fields.items()) if o)]


_SPECS = recipe_specs()


def _param_name(decls) -> str:
    named = [d for d in decls if not d.startswith("-")]
    return named[0] if named else decls[0].split("/")[0].lstrip("-").replace("-", "_")


def recipe_option_list(flag_names: dict[str, str] | None = None,
                       recipe_type: type[Recipe] = Recipe) -> list:
    """The recipe flags as click options; ``flag_names`` maps a parameter name to the flag a
    command shows instead (``eval`` has its own --seq-len/--batch-size), the parameter name
    (what ``build_recipe`` reads) stays."""
    flag_names = flag_names or {}
    specs = _SPECS if recipe_type is Recipe else recipe_specs(recipe_type)
    unknown = set(flag_names) - {_param_name(decls) for decls, _ in specs}
    if unknown:
        raise ValueError(f"no recipe flag with parameter {sorted(unknown)}")
    out = []
    for decls, attrs in specs:
        param = _param_name(decls)
        if param in flag_names:
            decls = (flag_names[param], param)
        out.append(click.option(*decls, **attrs))
    return out


RECIPE_OPTIONS = recipe_option_list()


def recipe_options(f=None, *, flag_names: dict[str, str] | None = None,
                   recipe_type: type[Recipe] = Recipe):
    """Decorator adding every recipe flag: ``@recipe_options`` or
    ``@recipe_options(flag_names={"calib_seq_len": "--calib-seq-len"})``."""

    def decorate(f):
        options = recipe_option_list(flag_names, recipe_type) \
            if flag_names or recipe_type is not Recipe else RECIPE_OPTIONS
        for option in reversed(options):
            f = option(f)
        return f

    return decorate(f) if f is not None else decorate


def loading_options(f):
    """How a model is loaded: ``--device-map``, ``--max-memory``, ``--offload-folder`` (handed to
    accelerate, see ``fp8ptq.io.placement``), ``--trust-pickle`` and
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
                     help="Memory budget: SIZE (the host) or DEVICE=SIZE[,...], e.g. "
                          "0=20GiB,cpu=64GiB (GPU 0 and the host); with --device-map, "
                          "accelerate's limits per device."),
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


# Recipe flags whose value is text parsed into the field's value (PATTERN=FORMAT, LOW,HIGH); every
# other flag's value is the field's own (a repeated flag's values: a list). The flags and the
# parameters that are not the field's name come from the Recipe (``field_option``), so a new
# recipe field is its Recipe line alone (tests/test_recipe_flags.py).
PARSE = {"overrides": parse_overrides, "pow2_range": parse_range}


def _field_of(recipe_type: type[Recipe] = Recipe) -> dict[str, str]:
    """{parameter: Recipe field} for the flags whose parameter is not the field's name."""
    return {spec["param"]: n for n, i in recipe_type.model_fields.items()
            if "param" in (spec := flag_spec(i) or {})}


FIELD_OF = _field_of()  # calib_seq_len -> seq_len, calib_batch_size -> batch_size


def recipe_params(recipe_type: type[Recipe] = Recipe) -> list[str]:
    """The parameter names of the recipe flags that set a Recipe field (not ``--recipe``)."""
    specs = _SPECS if recipe_type is Recipe else recipe_specs(recipe_type)
    return [p for p in (_param_name(decls) for decls, _ in specs) if p != "recipe_path"]


def _value(param: str, value):
    if param in PARSE:
        return PARSE[param](value)
    return (list(value) or None) if isinstance(value, tuple) else value


def build_recipe(kwargs: dict, *, model: str | None = None,
                 recipe_type: type[Recipe] = Recipe, flags_only: bool = False,
                 **extra) -> Recipe:
    """Recipe file (if any) < flags given on the command line. Pops the recipe flags. With
    ``model``, the options the resolved recipe makes moot are named in one ``warning:`` line
    (refused where the command line contradicts itself, ``check_moot``); what every command
    taking recipe flags (quantize, eval, sensitivity) passes. ``flags_only``: name only the
    flags given, not what the recipe file says (eval's file is the checkpoint's own, unasked)."""
    path = kwargs.pop("recipe_path", None)
    base = recipe_type.load(path) if path else recipe_type()
    field_of = FIELD_OF if recipe_type is Recipe else _field_of(recipe_type)
    flags = {field_of.get(p, p): _value(p, kwargs.pop(p)) for p in recipe_params(recipe_type)}
    flags.update(extra)
    recipe = base.merged(**flags)
    if model is not None:
        check_moot(recipe, {k for k, v in flags.items() if v is not None},
                   convolutions=is_torch_module_file(model), flags_only=flags_only)
    return recipe


def check_moot(recipe: Recipe, on_command_line: set[str], *, convolutions: bool = False,
               flags_only: bool = False):
    """One ``warning:`` line (stderr) naming every option ``recipe`` makes moot (``flags_only``:
    every one given on the command line); a ``UsageError`` where the command line names both a
    moot option and what makes it moot (``--act-granularity token --act-calib mse``): that can
    only be a mistake."""
    moot = [m for m in moot_options(recipe, convolutions=convolutions)
            if not flags_only or m.field in on_command_line]
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

