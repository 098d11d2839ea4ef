"""Broken and hostile inputs, table-driven: every case exits with its code, prints exactly one
``error:`` line on stderr, and leaves no output and no temporary folder behind. Plus fuzzing of
the parsers (never a traceback), the hostile-pickle case (nothing runs), and interruptions of a
real run in each phase (load, calibrate, write)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import fp8ptq
import fp8ptq.io.loading  # fp8ptq.io.loading.load_model below: the package imports no submodule
from fp8ptq.errors import DataError, Fp8ptqError, UsageError
from tiny_models import STATIC, invoke, tiny

HERE = Path(__file__).parent
DOCS = ["the quick brown fox jumps over the lazy dog", "a small model reads a few words of text",
        "hello world and hello again"]
CALIB = ["--num-samples", "4", "--seq-len", "8", "--batch-size", "2"]
GGUF = Path(__file__).resolve().parents[1].parent / "shared" / "assets" / "models" / \
    "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"


class Evil:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def A(tmp_path_factory, word_tokenizer):
    root = tmp_path_factory.mktemp("bad")
    tiny("llama").save_pretrained(root / "llama")
    word_tokenizer.save_pretrained(root / "llama")
    (root / "calib.txt").write_text("\n".join(DOCS * 10) + "\n")
    (root / "wiki.raw").write_text(" = a = \n the quick brown fox . \n = b = \n hello world . \n")
    res = invoke(["quantize", str(root / "llama"), "-o", str(root / "ckpt"),
                  "--calib-data", str(root / "calib.txt"), *CALIB, *STATIC])
    assert res.exit_code == 0, res.output
    res = invoke(["quantize", str(root / "llama"), "-o", str(root / "native"),
                  "--format", "e5m2", "--calib-data", str(root / "calib.txt"),
                  *CALIB, *STATIC])
    assert res.exit_code == 0, res.output
    assert json.loads((root / "native" / "fp8ptq.json").read_text())["layout"] == "fp8ptq-native"
    return root


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_tensor(ckpt: Path, key: str, fn) -> Path:
    tensors = load_file(ckpt / "model.safetensors")
    tensors = fn(tensors, key)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    return ckpt


def set_value(value):
    def fn(tensors, key):
        tensors[key] = torch.full_like(tensors[key], value)
        return tensors
    return fn


def drop(tensors, key):
    del tensors[key]
    return tensors


def wrong_dtype(tensors, key):
    tensors[key] = tensors[key].view(torch.uint8)
    return tensors


def wrong_shape(tensors, key):
    tensors[key] = tensors[key][:-1].contiguous()
    return tensors


Q = "model.layers.0.self_attn.q_proj"


def model_case(prepare, *extra):
    """A broken MODEL for quantize: ``prepare(tmp, A)`` returns its path."""
    def args(tmp, A):
        model = prepare(tmp, A)
        calib = "digits" if model.suffix == ".pt" else str(A / "calib.txt")  # CNNs: images
        return ["quantize", str(model), "-o", str(tmp / "out"), "--calib-data", calib, *CALIB,
                *extra]
    return args


def eval_args(ck, A, tmp):
    return ["eval", str(ck), "--tasks", "wikitext", "--data", f"wikitext={A / 'wiki.raw'}",
            "--json", str(tmp / "out")]


def ckpt_case(key, fn, source="ckpt"):
    """A checkpoint edited by ``fn`` on tensor ``key``, evaluated with ``eval``."""
    def args(tmp, A):
        return eval_args(edit_tensor(copy(A / source, tmp / "ck"), key, fn), A, tmp)
    return args


def ckpt_edit(edit, source="ckpt"):
    """A checkpoint folder changed by ``edit(folder, tmp)``, evaluated with ``eval``."""
    def args(tmp, A):
        ck = copy(A / source, tmp / "ck")
        edit(ck, tmp)
        return eval_args(ck, A, tmp)
    return args


def edit_json(name, fn):
    def edit(ck, tmp):
        doc = json.loads((ck / name).read_text())
        fn(doc)
        (ck / name).write_text(json.dumps(doc))
    return edit


def ct_group(fn):
    return edit_json("config.json", lambda c: fn(c["quantization_config"]["config_groups"]
                                                 ["group_0"]))


def to_index(ck, tmp):
    """A sharded layout whose index names a shard that is not there."""
    (ck / "model.safetensors").rename(ck / "model-00001-of-00002.safetensors")
    keys = load_file(ck / "model-00001-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in keys}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def hostile_skeleton(ck, tmp):
    from fp8ptq.checkpoint.skeleton import SKELETON_NAME

    cfg = json.loads((ck / "config.json").read_text())
    cfg["fp8ptq_module"] = {"skeleton": SKELETON_NAME, "class": "x.Y"}
    (ck / "config.json").write_text(json.dumps(cfg))
    torch.save(Evil(tmp / "MARKER"), ck / SKELETON_NAME)


def model_file(name, content):
    """A model folder whose file ``name`` is replaced by ``content``."""
    def prepare(tmp, A):
        m = copy(A / "llama", tmp / "m")
        (m / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        return m
    return prepare


def remote_code(tmp, A):
    """A folder whose config names its own Python module: loading it would import (run) it."""
    m = copy(A / "llama", tmp / "m")
    cfg = json.loads((m / "config.json").read_text())
    cfg.update(model_type="mine", auto_map={"AutoConfig": "configuration_mine.MineConfig",
                                            "AutoModelForCausalLM": "modeling_mine.Mine"})
    (m / "config.json").write_text(json.dumps(cfg))
    for module in ("configuration_mine.py", "modeling_mine.py"):
        (m / module).write_text(f"open({str(tmp / 'MARKER')!r}, 'w').close()\n")
    return m


def file_case(name, content, flag="--calib-data", command="quantize"):
    def args(tmp, A):
        f = tmp / name
        f.write_bytes(content if isinstance(content, bytes) else content.encode())
        out = ["-o", str(tmp / "out")] if command == "quantize" else ["--metric", "sqnr"]
        return [command, str(A / "llama"), *out, flag, str(f), *CALIB] + (
            ["--calib-data", str(A / "calib.txt")] if flag != "--calib-data" else [])
    return args


def flags_case(*extra, command="quantize"):
    def args(tmp, A):
        base = {"quantize": ["quantize", str(A / "llama"), "-o", str(tmp / "out"),
                             "--calib-data", str(A / "calib.txt"), *CALIB],
                "quantize-pt": ["quantize", str(A / "calib.txt"), "-o", str(tmp / "out"),
                                "--calib-data", str(A / "calib.txt"), *CALIB],
                "eval": ["eval", str(A / "llama"), "--tasks", "wikitext", "--data",
                         f"wikitext={A / 'wiki.raw'}", "--json", str(tmp / "out")],
                "sensitivity": ["sensitivity", str(A / "llama"), "--calib-data",
                                str(A / "calib.txt"), "--metric", "sqnr", "--json",
                                str(tmp / "out"), *CALIB]}[command]
        return [*base, *(e.format(calib=A / "calib.txt") for e in extra)]
    return args


def broken_config(tmp, A):
    m = copy(A / "llama", tmp / "m")
    (m / "config.json").write_text("{not json")
    return m


def config_not_object(tmp, A):
    m = copy(A / "llama", tmp / "m")
    (m / "config.json").write_text("[1, 2]")
    return m


def unknown_model_type(tmp, A):
    m = copy(A / "llama", tmp / "m")
    cfg = json.loads((m / "config.json").read_text())
    cfg["model_type"] = "no-such-architecture"
    (m / "config.json").write_text(json.dumps(cfg))
    return m


def truncated_weights(tmp, A):
    m = copy(A / "llama", tmp / "m")
    with open(m / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    return m


def missing_tensor(tmp, A):
    m = copy(A / "llama", tmp / "m")
    edit_tensor(m, "model.norm.weight", drop)
    return m


def nan_weight(tmp, A):
    m = copy(A / "llama", tmp / "m")
    edit_tensor(m, "model.layers.1.mlp.down_proj.weight", set_value(float("nan")))
    return m


def no_config(tmp, A):
    m = copy(A / "llama", tmp / "m")
    (m / "config.json").unlink()
    return m


def broken_tokenizer(tmp, A):
    m = copy(A / "llama", tmp / "m")
    (m / "tokenizer.json").write_text("garbage")
    return m


def truncated_gguf(tmp, A):
    if not GGUF.is_file():
        pytest.skip("shared assets not present")
    f = tmp / "t.gguf"
    with open(GGUF, "rb") as src:
        f.write_bytes(src.read(100_000))
    return f


def text_gguf(tmp, A):
    f = tmp / "t.gguf"
    f.write_text("this is not a gguf file")
    return f


def garbage_pt(tmp, A):
    f = tmp / "m.pt"
    f.write_bytes(b"\x80\x04garbage")
    return f


def hostile_pt(tmp, A):
    f = tmp / "m.pt"
    torch.save(Evil(tmp / "MARKER"), f)
    return f


def legacy_hostile_pt(tmp, A):
    f = tmp / "m.pt"
    f.write_bytes(pickle.dumps(Evil(tmp / "MARKER")))
    return f


def ckpt_json(text):
    def args(tmp, A):
        ck = copy(A / "ckpt", tmp / "ck")
        (ck / "fp8ptq.json").write_text(text)
        return ["eval", str(ck), "--tasks", "wikitext", "--data", f"wikitext={A / 'wiki.raw'}"]
    return args


def ckpt_truncated(tmp, A):
    ck = copy(A / "ckpt", tmp / "ck")
    with open(ck / "model.safetensors", "r+b") as f:
        f.truncate(500)
    return ["eval", str(ck), "--tasks", "wikitext", "--data", f"wikitext={A / 'wiki.raw'}"]


def ckpt_format_spec(tmp, A):
    ck = copy(A / "ckpt", tmp / "ck")
    meta = json.loads((ck / "fp8ptq.json").read_text())
    meta["modules"][Q]["weight_format"] = {"name": "bogus", "bits": 8}
    (ck / "fp8ptq.json").write_text(json.dumps(meta))
    return ["eval", str(ck), "--tasks", "wikitext", "--data", f"wikitext={A / 'wiki.raw'}"]


def ckpt_config_disagrees(tmp, A):
    ck = copy(A / "ckpt", tmp / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["quantization_config"]
    (ck / "config.json").write_text(json.dumps(cfg))
    return ["eval", str(ck), "--tasks", "wikitext", "--data", f"wikitext={A / 'wiki.raw'}"]


def existing_output(tmp, A):
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine")
    return ["quantize", str(A / "llama"), "-o", str(tmp / "out"), "--calib-data",
            str(A / "calib.txt"), *CALIB]


def nan_weights(tmp, A):
    m = copy(A / "llama", tmp / "m")
    edit_tensor(m, f"{Q}.weight", set_value(float("nan")))
    return ["quantize", str(m), "-o", str(tmp / "out"), "--calib-data", str(A / "calib.txt"),
            *CALIB]


CASES = {
    # quantize: the model
    "missing-model": (lambda t, A: ["quantize", "/no/such/model", "-o", str(t / "out")], 2,
                      "no such file or folder"),
    "missing-model-before-calib": (lambda t, A: ["quantize", "/no/such/model", "-o",
                                                 str(t / "out"), "--calib-data",
                                                 "/no/such/calib.txt"], 2, "cannot load model"),
    "config-not-json": (model_case(broken_config), 2, "config.json:1:2"),
    "config-not-object": (model_case(config_not_object), 2, "not a JSON object"),
    "config-no-file": (model_case(no_config), 2, "no config.json"),
    "unknown-model-type": (model_case(unknown_model_type), 2, "cannot load model"),
    "truncated-safetensors": (model_case(truncated_weights), 2, "corrupt or truncated"),
    "broken-tokenizer": (model_case(broken_tokenizer), 2, "tokenizer"),
    "truncated-gguf": (model_case(truncated_gguf), 2, "t.gguf: it ends at byte 100,000, inside "
                       "its header"),
    "text-gguf": (model_case(text_gguf), 2, "not a valid GGUF file"),
    "garbage-pt": (model_case(garbage_pt), 2, "cannot load model"),
    "hostile-pt": (model_case(hostile_pt), 2, "--trust-pickle"),
    "legacy-hostile-pt": (model_case(legacy_hostile_pt), 2, "--trust-pickle"),
    "nan-weights": (nan_weights, 1, "NaN"),
    # quantize: data and recipe files
    "calib-missing": (flags_case("--calib-data", "/no/such/calib.txt"), 2, "not found"),
    "calib-not-utf8": (file_case("c.txt", b"\xff\xfe bad bytes\n"), 2, "not UTF-8"),
    "calib-empty": (file_case("c.txt", "\n\n"), 2, "no text"),
    "calib-bad-jsonl": (file_case("c.jsonl", '{"text": "a"}\n{broken\n'), 2, "c.jsonl"),
    "calib-bad-json": (file_case("c.json", "[1, 2"), 2, "c.json"),
    "recipe-yaml-syntax": (file_case("r.yaml", "format: e4m3\nskip: [a, b\n", "--recipe"), 2,
                           "r.yaml:3:1"),
    "recipe-json-syntax": (file_case("r.json", '{"format": }', "--recipe"), 2, "r.json:1:12"),
    "recipe-unknown-key": (file_case("r.yaml", "colour: red\n", "--recipe"), 2,
                           "unknown recipe key"),
    "recipe-wrong-type": (file_case("r.yaml", "num_samples: many\n", "--recipe"), 2,
                          "num_samples"),
    "recipe-not-mapping": (file_case("r.yaml", "- a\n- b\n", "--recipe"), 2, "mapping"),
    "recipe-not-utf8": (file_case("r.yaml", b"\xff\xfe\n", "--recipe"), 2, "not UTF-8"),
    # quantize: flags
    "unknown-format": (flags_case("--format", "e9m9x"), 2, "format"),
    "bad-override": (flags_case("--override", "no-equals-sign"), 2, "--override"),
    "override-unknown-format": (flags_case("--override", "*q_proj=e0m0"), 2, "override"),
    "bad-pow2-range": (flags_case("--pow2-range", "5"), 2, "--pow2-range"),
    "bad-smoothquant": (flags_case("--smoothquant", "2"), 2, "smoothquant"),
    "bad-percentile": (flags_case("--percentile", "0"), 2, "percentile"),
    "bad-act-calib": (flags_case("--act-calib", "magic"), 2, "act_calib"),
    "bad-device-map": (flags_case("--device-map", "everywhere"), 2, "--device-map"),
    "bad-max-memory": (flags_case("--device-map", "auto", "--max-memory", "lots"), 2,
                       "--max-memory"),
    "max-memory-gpu-on-cpu": (flags_case("--max-memory", "0=20GiB,cpu=64GiB"), 2,
                              "GPU budget but the run is on the CPU"),
    "max-memory-other-gpu": (flags_case("--max-memory", "1=20GiB", "--device", "cuda"), 2,
                             "names GPU 1 but the run computes on GPU 0"),
    "max-memory-bad-size": (flags_case("--max-memory", "4 bananas"), 2, "--max-memory"),
    "eval-max-memory-alone": (flags_case("--max-memory", "4GB", command="eval"), 2,
                              "needs --device-map"),
    "zero-samples": (flags_case("--num-samples", "0"), 2, "num_samples"),
    "existing-output": (existing_output, 2, "already exists"),
    "unknown-flag": (flags_case("--no-such-flag"), 2, "No such option"),
    # eval
    "eval-missing-model": (lambda t, A: ["eval", "/no/such/model", "--tasks", "wikitext"], 2,
                           "cannot load model"),
    "eval-unknown-task": (flags_case("--tasks", "no_such_task_xyz", command="eval"), 2,
                          "no_such_task_xyz"),
    "eval-bad-data": (flags_case("--data", "wikitext", command="eval"), 2, "--data"),
    "eval-missing-data": (flags_case("--data", "wikitext=/no/such.raw", command="eval"), 2,
                          "no/such.raw"),
    "eval-bad-gate": (flags_case("--max-delta", "perplexity", command="eval"), 2, "gate"),
    "eval-unknown-compare": (flags_case("--compare", "e9m9x", command="eval"), 2, "e9m9x"),
    "ckpt-nan-input-scale": (ckpt_case(f"{Q}.input_scale", set_value(float("nan"))), 2,
                             f"{Q}.input_scale"),
    "ckpt-zero-weight-scale": (ckpt_case(f"{Q}.weight_scale", set_value(0.0)), 2,
                               f"{Q}.weight_scale"),
    "ckpt-inf-scale": (ckpt_case(f"{Q}.weight_scale", set_value(float("inf"))), 2,
                       "finite and > 0"),
    "ckpt-missing-tensor": (ckpt_case(f"{Q}.weight", drop), 2, f"{Q}.weight is missing"),
    "ckpt-codes-dtype": (ckpt_case(f"{Q}.weight", wrong_dtype), 2, "stores its codes as"),
    "ckpt-codes-shape": (ckpt_case(f"{Q}.weight", wrong_shape), 2, "has shape"),
    "ckpt-truncated": (ckpt_truncated, 2, "corrupt or truncated"),
    "ckpt-json-syntax": (ckpt_json("{broken"), 2, "fp8ptq.json:1:2"),
    "ckpt-json-not-ours": (ckpt_json('{"tool": "other"}'), 2, "not an fp8ptq checkpoint"),
    "ckpt-format-spec": (ckpt_format_spec, 2, "does not describe a format"),
    "ckpt-config-disagrees": (ckpt_config_disagrees, 2, "quantization_config"),
    "ckpt-missing-input-scale": (ckpt_case(f"{Q}.input_scale", drop), 2,
                                 f"{Q}.input_scale is missing"),
    "ckpt-ct-type-disagrees": (ckpt_edit(ct_group(lambda g: g["weights"].update(type="int"))), 2,
                               "group_0 says int weights"),
    "ckpt-ct-strategy-disagrees": (ckpt_edit(ct_group(
        lambda g: g["weights"].update(strategy="tensor"))), 2, "says tensor weight scales"),
    "ckpt-ct-ignores-module": (ckpt_edit(edit_json("config.json", lambda c: c[
        "quantization_config"]["ignore"].append(Q))), 2, f"no quantization_config group "
        f"quantizes {Q}"),
    "ckpt-ct-invalid": (ckpt_edit(ct_group(lambda g: g["weights"].update(num_bits="eight"))), 2,
                        "does not validate"),
    "ckpt-ct-no-act-scheme": (ckpt_edit(ct_group(lambda g: g.update(input_activations=None))),
                              2, "has no input_activations"),
    "ckpt-index-missing-shard": (ckpt_edit(to_index), 2, "model-00002-of-00002.safetensors is "
                                 "missing"),
    "ckpt-no-weights": (ckpt_edit(lambda ck, t: (ck / "model.safetensors").unlink()), 2,
                        "has no model.safetensors"),
    "ckpt-no-config": (ckpt_edit(lambda ck, t: (ck / "config.json").unlink()), 2,
                       "config.json is missing"),
    "ckpt-hostile-skeleton": (ckpt_edit(hostile_skeleton), 2, "--trust-pickle"),
    "native-nan-weight-scale": (ckpt_case(f"{Q}.weight_scale", set_value(float("nan")),
                                          "native"), 2, f"{Q}.weight_scale has"),
    "native-codes-dtype": (ckpt_case(f"{Q}.weight_codes", lambda t, k: t.update(
        {k: t[k].view(torch.int8)}) or t, "native"), 2, "stores its codes as uint8"),
    "native-codes-shape": (ckpt_case(f"{Q}.weight_codes", wrong_shape, "native"), 2,
                           "has shape"),
    "native-bad-format": (ckpt_edit(edit_json("fp8ptq.json", lambda m: m["modules"][Q][
        "weight_format"].update(exponent_bits="four")), "native"), 2,
        "does not describe a format"),
    "eval-compare-broken-ckpt": (lambda t, A: ["eval", str(A / "llama"), "--tasks", "wikitext",
                                               "--data", f"wikitext={A / 'wiki.raw'}",
                                               "--compare", str(edit_tensor(
                                                   copy(A / "ckpt", t / "ck"), f"{Q}.input_scale",
                                                   set_value(-1.0)))], 2, f"{Q}.input_scale"),
    "eval-json-inside-file": (flags_case("--json", "{calib}/r.json", command="eval"), 2,
                              "is a file, not a folder"),
    # quantize: tokenizer, remote code, output
    "tokenizer-config-not-json": (model_case(model_file("tokenizer_config.json", "{oops")), 2,
                                  "tokenizer_config.json:1:2"),
    "tokenizer-not-utf8": (model_case(model_file("tokenizer.json", b"\xff\xfe")), 2,
                           "tokenizer.json: not UTF-8"),
    "config-not-utf8": (model_case(model_file("config.json", b"\xff{}")), 2,
                        "config.json: not UTF-8"),
    "remote-code": (model_case(remote_code), 2, "--trust-remote-code"),
    "output-inside-file": (lambda t, A: ["quantize", str(A / "llama"), "-o",
                                         str(A / "calib.txt" / "out"), "--calib-data",
                                         str(A / "calib.txt"), *CALIB], 2,
                           "is a file, not a folder"),
    "recipe-missing": (flags_case("--recipe", "/no/such/recipe.yaml"), 2, "not found"),
    "calib-is-folder": (lambda t, A: ["quantize", str(A / "llama"), "-o", str(t / "out"),
                                      "--calib-data", str(t), *CALIB], 2, "is a folder"),
    "sequential-truncated-safetensors": (model_case(truncated_weights, "--sequential"), 2,
                                         "corrupt or truncated"),
    "sequential-unknown-model-type": (model_case(unknown_model_type, "--sequential"), 2,
                                      "cannot load model"),
    "sequential-remote-code": (model_case(remote_code, "--sequential"), 2,
                               "--trust-remote-code"),
    "sequential-not-a-folder": (flags_case("--sequential", command="quantize-pt"), 2,
                                "--sequential"),
    "model-free-truncated-safetensors": (model_case(truncated_weights, "--model-free",
                                                    "--act-granularity", "token",
                                                    "--weight-calib", "max"), 2,
                                         "corrupt or truncated"),
    "model-free-missing-tensor": (model_case(missing_tensor, "--model-free", "--act-format",
                                             "none", "--weight-calib", "max"), 2,
                                  "missing from the checkpoint: model.norm.weight"),
    "model-free-nan-weight": (model_case(nan_weight, "--act-granularity", "token"), 1,
                              "model.layers.1.mlp.down_proj contains NaN"),
    "model-free-static-recipe": (flags_case("--model-free", *STATIC), 2,
                                 "--model-free: static activation scales"),
    "model-free-gptq": (flags_case("--model-free", "--act-format", "none", "--weight-calib",
                                   "gptq"), 2, "GPTQ (--weight-calib gptq) needs calibration"),
    "model-free-not-safetensors": (flags_case("--model-free", "--act-format", "none",
                                              "--weight-calib", "max", command="quantize-pt"), 2,
                                   "--model-free reads safetensors checkpoints"),
    "model-free-and-sequential": (flags_case("--model-free", "--sequential", "--act-format",
                                             "none"), 2, "two different paths"),
    # sensitivity, validate and formats
    "sens-calib-not-utf8": (file_case("c.txt", b"\xff\xfe bad\n", command="sensitivity"), 2,
                            "not UTF-8"),
    "sens-json-inside-file": (flags_case("--json", "{calib}/r.json", command="sensitivity"), 2,
                              "does not exist"),
    "validate-missing": (lambda t, A: ["validate", "/no/such/ckpt"], 2, "not an fp8ptq"),
    "formats-codes-without-name": (lambda t, A: ["formats", "--codes"], 2, "needs a format"),
    "sens-missing-model": (lambda t, A: ["sensitivity", "/no/such/model"], 2,
                           "cannot load model"),
    "sens-bad-target": (flags_case("--target-delta", "lots", command="sensitivity"), 2,
                        "target"),
    "formats-unknown": (lambda t, A: ["formats", "e9m9x"], 2, "e9m9x"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_one_error_line_nothing_left(A, tmp_path, case):
    build, code, fragment = CASES[case]
    args = build(tmp_path, A)
    before = {p.name for p in tmp_path.iterdir()}
    res = invoke([str(a) for a in args])
    assert res.exit_code == code, (res.output, res.exception)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, res.stderr
    assert fragment in errors[0], errors[0]
    assert not any("Traceback" in ln for ln in lines)
    left = {p.name for p in tmp_path.iterdir()} - before
    assert "out" not in left or case == "existing-output"
    assert not [n for n in left if "fp8ptq-tmp" in n or n.startswith(".tmp")], left
    assert not (tmp_path / "MARKER").exists()  # nothing in a hostile file ran


def test_cases_cover_forty_inputs():
    assert len(CASES) >= 40


LOAD_CASES = sorted(c for c in CASES if c.startswith(("ckpt-", "native-")))


@pytest.mark.parametrize("case", LOAD_CASES)
def test_python_load_refuses_the_same_checkpoints(A, tmp_path, case):
    """``fp8ptq.load`` (the Python API) refuses every broken checkpoint the CLI does, with the
    same one-line message, before it builds a model."""
    build, code, fragment = CASES[case]
    ck = build(tmp_path, A)[1]
    with pytest.raises(UsageError) as e:  # DataError is a UsageError: both exit 2
        fp8ptq.load(ck)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "MARKER").exists()


def test_hostile_pickle_runs_only_with_trust(A, tmp_path):
    f = hostile_pt(tmp_path, A)
    with pytest.raises(DataError, match="--trust-pickle"):
        fp8ptq.io.loading.load_model(str(f))
    assert not (tmp_path / "MARKER").exists()
    with pytest.raises(Fp8ptqError):  # it runs (and is then not a module): only when asked
        fp8ptq.io.loading.load_model(str(f), trust_pickle=True)
    assert (tmp_path / "MARKER").exists()


def test_hostile_checkpoint_skeleton_is_refused(A, tmp_path):
    from fp8ptq.checkpoint.skeleton import SKELETON_NAME

    ck = copy(A / "ckpt", tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["fp8ptq_module"] = {"skeleton": SKELETON_NAME, "class": "x.Y"}
    (ck / "config.json").write_text(json.dumps(cfg))
    torch.save(Evil(tmp_path / "MARKER"), ck / SKELETON_NAME)
    with pytest.raises(DataError, match="--trust-pickle"):
        fp8ptq.load(ck)
    assert not (tmp_path / "MARKER").exists()


def test_python_load_validates_before_building(A, tmp_path):
    ck = edit_tensor(copy(A / "ckpt", tmp_path / "ck"), f"{Q}.input_scale",
                     set_value(float("nan")))
    with pytest.raises(DataError, match=f"{Q}.input_scale .*finite and > 0"):
        fp8ptq.load(ck)


# what a full disk raises: an OSError from Python's own writes; safetensors' save_file raises
# its SafetensorError with this message (seen writing to a full 64 KiB tmpfs, safetensors 0.8)
DISK_FULL = {"oserror": lambda: OSError(errno.ENOSPC, "No space left on device"),
             "safetensors": lambda: SafetensorError(
                 "Error while serializing: I/O error: No space left on device (os error 28)")}


@pytest.mark.parametrize("raised", DISK_FULL)
def test_disk_full_is_one_line_and_leaves_nothing(A, tmp_path, monkeypatch, raised):
    import safetensors.torch

    def full(*args, **kwargs):
        raise DISK_FULL[raised]()

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    res = invoke(["quantize", str(A / "llama"), "-o", str(tmp_path / "out"),
                  "--calib-data", str(A / "calib.txt"), *CALIB])
    assert res.exit_code == 1
    assert [ln for ln in res.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: no space left on device writing {tmp_path / 'out'}; nothing was written"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_debug_shows_the_traceback(A, tmp_path, monkeypatch):
    res = invoke(["--debug", "quantize", "/no/such/model", "-o",
                  str(tmp_path / "o")])
    assert res.exit_code != 0 and isinstance(res.exception, UsageError)
    monkeypatch.setenv("FP8PTQ_DEBUG", "1")
    res = invoke(["eval", str(A / "llama"), "--tasks", "no_such_task_xyz"])
    assert isinstance(res.exception, UsageError)  # raised, so the traceback is printed


CHATTER = ("it/s", "%|", "Loading weights", "pretrained", "WARNING", "INFO", "TaskManager")


def chatter(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if any(c in ln for c in CHATTER)]


@pytest.mark.slow
def test_quiet_by_default(A, tmp_path):
    """A successful quantize and eval print no library chatter on stderr (transformers'
    "Loading weights" bars, lm-eval's notes about ``pretrained``, tqdm bars) unless
    ``--verbose``: a fresh process each, so no earlier test has silenced anything."""
    ck = tmp_path / "ck"
    res = invoke(["quantize", str(A / "llama"), "-o", str(ck),
                  "--calib-data", str(A / "calib.txt"), *CALIB])
    assert res.exit_code == 0 and chatter(res.stderr) == [], res.stderr
    cli = [sys.executable, "-m", "fp8ptq.cli"]
    quiet = subprocess.run([*cli, "eval", str(ck), "--tasks", "wikitext", "--data",
                            f"wikitext={A / 'wiki.raw'}"], capture_output=True, text=True)
    loud = subprocess.run([*cli, "--verbose", "eval", str(ck), "--tasks", "wikitext", "--data",
                           f"wikitext={A / 'wiki.raw'}"], capture_output=True, text=True)
    assert quiet.returncode == 0 and loud.returncode == 0, quiet.stderr + loud.stderr
    assert chatter(quiet.stderr) == [], quiet.stderr
    assert chatter(loud.stderr), loud.stderr  # the filter does see the libraries' lines


def test_stale_temporary_of_a_killed_run_is_removed(A, tmp_path):
    from fp8ptq.files.atomic import remove_stale_temporaries

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".out.fp8ptq-tmp-{dead}-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    live = tmp_path / f".out.fp8ptq-tmp-{os.getpid()}-abc"
    live.mkdir()
    assert remove_stale_temporaries(tmp_path / "out") == [stale]
    assert not stale.exists() and live.exists()


# --- fuzzing: parsers never raise anything but UsageError ------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.text(max_size=20))
def test_format_names_never_traceback(name):
    from fp8ptq.formats import get_format

    try:
        get_format(name)
    except UsageError:
        pass


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(["format", "num_samples", "skip", "overrides",
                                        "smoothquant", "pow2_range", "percentile",
                                        "act_calib", "block_size", "scale_pow2", "bogus"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-5, 5),
                                 st.floats(allow_nan=True), st.text(max_size=8),
                                 st.lists(st.text(max_size=4), max_size=3),
                                 st.dictionaries(st.text(max_size=3), st.text(max_size=3),
                                                 max_size=2)),
                       max_size=4))
def test_recipe_loader_never_tracebacks(data):
    from fp8ptq.config.recipe import Recipe

    try:
        Recipe.from_dict(data)
    except UsageError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40))
@example("?")  # YAML {None: None}: found by hypothesis in CI (keywords must be strings)
@example("1: 2")
@example("recipe: {3: e4m3}")
def test_recipe_files_never_traceback(text):
    import tempfile

    from fp8ptq.config.recipe import Recipe

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        Recipe.load(f.name)
    except UsageError:
        pass
    finally:
        os.unlink(f.name)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30))
def test_gate_override_and_placement_parsers_never_traceback(text):
    from fp8ptq.cli.options import parse_overrides
    from fp8ptq.evals.report import parse_gate
    from fp8ptq.io.placement import parse_device_map, parse_max_memory

    for parse in (lambda: parse_gate(text, ["wikitext.word_perplexity", "squad.f1"]),
                  lambda: parse_overrides([text]), lambda: parse_max_memory(text),
                  lambda: parse_device_map(text) if text.strip().startswith("{") or
                  text.strip() in ("auto",) else None):
        try:
            parse()
        except UsageError:
            pass


# --- interruptions -----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("phase,sig", [("load", signal.SIGINT), ("calibrate", signal.SIGINT),
                                       ("write", signal.SIGINT), ("write", signal.SIGTERM)])
def test_interrupt_in_each_phase_cleans_up(A, tmp_path, phase, sig):
    out = tmp_path / "out"
    cmd = [sys.executable, str(HERE / "interrupt_runner.py"), phase, str(int(sig)), "quantize",
           str(A / "llama"), "-o", str(out), "--calib-data", str(A / "calib.txt"), *CALIB,
           *STATIC]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 128 + int(sig), res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: interrupted ({signal.Signals(sig).name}); nothing was written"]
    assert list(tmp_path.iterdir()) == []  # no output, no temporary folder


def test_two_runs_on_one_output_one_wins_the_other_fails_cleanly(A, tmp_path, monkeypatch):
    """Run B finishes while run A is still writing: A's rename finds B's folder, A fails with
    one line and removes only its own temporary folder; B's checkpoint is untouched."""
    import safetensors.torch

    out = tmp_path / "out"
    save = safetensors.torch.save_file

    def save_then_other_run_finishes(*args, **kwargs):
        save(*args, **kwargs)
        out.mkdir()
        (out / "fp8ptq.json").write_text("{}")  # the other run's complete checkpoint

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_other_run_finishes)
    res = invoke(["quantize", str(A / "llama"), "-o", str(out),
                  "--calib-data", str(A / "calib.txt"), *CALIB])
    assert res.exit_code == 2
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "created by another run" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in out.iterdir()] == ["fp8ptq.json"]


@pytest.mark.parametrize("spec,message", [
    ({"builtin": "digits-cnn", "kwargs": {"no_such_argument": 1}}, "do not build the built-in"),
    ({"builtin": "digits-cnn", "kwargs": "wide"}, "do not build the built-in"),
    ({"class": "x.Y"}, "names neither a built-in architecture nor a skeleton"),
    (["digits-cnn"], "is not a JSON object"),
])
def test_module_description_of_a_native_cnn_checkpoint_is_checked(tmp_path, spec, message):
    """config.json's ``fp8ptq_module`` (a built-in architecture stored as data) is user data:
    arguments that do not fit are one line, exit 2."""
    from fp8ptq.checkpoint.skeleton import build_module

    with pytest.raises(DataError, match=message):
        build_module(tmp_path, spec, torch.float32)
