"""Loading a model + tokenizer from a hub id, a local folder, a ``.gguf`` file or an fp8ptq
output."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

try:
    import fcntl
except ImportError:  # not a POSIX system: conversions are not serialized
    fcntl = None

import torch
import transformers
from safetensors import SafetensorError
from torch import nn
from transformers import AutoTokenizer

from ..checkpoint import load_quantized
from ..errors import DataError, UsageError, first_line
from ..files.json_files import read_json
from ..files.safe_pickle import load_torch_file
from ..model.auto import (  # noqa: F401 - re-exported
    TASK_CLASSES,
    LoadedModel,
    model_class,
)
from ..vision import TinyMobileNet
from .gguf_convert import convert_gguf
from .placement import Placement
from .source import is_safetensors_folder, prequantized
from .weights import load_config, load_streaming

# the tokenizer files transformers reads as JSON (a broken one otherwise surfaces as a bare
# "Expecting value: line 1 column 1" without a file name)
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "added_tokens.json", "vocab.json")


def load_model(
    spec: str,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    device_map: Any = None,
    task: str | None = None,
    trust_pickle: bool = False,
    trust_remote_code: bool = False,
    as_served: bool = False,
) -> LoadedModel:
    """Load ``spec`` (local folder, ``.gguf`` file, ``.pt`` module or hub id) in eval mode, with
    a tokenizer that has a pad token (none for a ``.pt`` module). ``task`` ("causal-lm", "qa",
    "seq-cls", "base") overrides the model class that ``config.architectures`` implies.
    ``trust_pickle`` allows full unpickling of ``.pt`` files and native-checkpoint skeletons;
    ``trust_remote_code`` lets transformers run a model repository's own code. Both are off:
    loading a file never runs code from it unless asked. ``as_served``: another tool's FP8
    checkpoint is loaded by transformers with its quantization applied (how ``eval --compare``
    scores it) instead of dequantized into the float model it stands for (how it is read as a
    source to quantize)."""
    if task is not None and task not in TASK_CLASSES:
        raise UsageError(f"unknown task {task!r}; choose one of {', '.join(TASK_CLASSES)}")
    path = Path(spec).expanduser()
    load_kwargs = dict(dtype=dtype, device=device, device_map=device_map, task=task,
                       trust_remote_code=trust_remote_code)

    if path.is_file() and path.suffix.lower() == ".gguf":
        return _load_gguf(spec, path.resolve(), **load_kwargs)
    if path.is_file() and is_torch_module_file(spec):
        return _load_torch_module(spec, path.resolve(), dtype=dtype, device=device,
                                  trust_pickle=trust_pickle)
    if path.is_dir():
        check_model_folder(spec)
        if (path / "fp8ptq.json").is_file():
            return load_quantized(str(path), device=device, trust_pickle=trust_pickle)
        return _load_pretrained(spec, str(path.resolve()), "local", as_served=as_served,
                                **load_kwargs)
    if path.exists():
        raise UsageError(f"cannot load model {spec!r}: expected a folder with config.json, a .gguf "
                         "file or a .pt module")
    if looks_like_path(spec):
        raise UsageError(f"cannot load model {spec!r}: no such file or folder")
    return _load_from_hub(spec, **load_kwargs)


def source_note(spec: str) -> str | None:
    """The ``note:`` a command prints for MODEL ``spec`` that another tool quantized to FP8
    (compressed-tensors): its weights are dequantized on load, then quantized by the recipe."""
    path = Path(spec).expanduser()
    if not is_safetensors_folder(path) or (path / "fp8ptq.json").is_file():
        return None
    found = prequantized(path)
    return None if found is None else (
        f"{spec} holds {found.describe()}: its weights are dequantized on load (codes x "
        "scales) and quantized again by this recipe")


def check_model_spec(spec: str) -> None:
    """The checks on MODEL that need no loading (so they come before reading calibration data
    or anything slow): a path must exist and be a model folder, a .gguf or a .pt file."""
    path = Path(spec).expanduser()
    if path.is_dir():
        check_model_folder(spec)
    elif not path.exists() and looks_like_path(spec):
        raise UsageError(f"cannot load model {spec!r}: no such file or folder")


def check_model_folder(spec: str) -> None:
    """A model folder's config.json (or fp8ptq.json) and tokenizer files must parse: checked
    here, where they are opened, so a broken one is one line naming the file and the place
    (``config.json:1:2: Expecting property name``), not a traceback from deep inside
    transformers."""
    path = Path(spec).expanduser()
    for name in ("fp8ptq.json", "config.json"):
        if (path / name).is_file():
            try:
                read_json(path / name)
            except DataError as e:
                raise DataError(f"cannot load model {spec!r}: {e}") from None
            break
    else:
        raise UsageError(f"cannot load model {spec!r}: folder has no config.json")
    for name in TOKENIZER_JSON:
        if (path / name).is_file():
            try:
                read_json(path / name, expect=None)
            except DataError as e:
                raise DataError(f"cannot load a tokenizer for {spec!r}: {e}") from None


def looks_like_path(spec: str) -> bool:
    # A hub id "org/name" has one "/", so a single separator does not make a path on its own.
    return (
        spec.startswith((os.sep, ".", "~"))
        or spec.count(os.sep) > 1
        or (os.sep != "/" and os.sep in spec)
        or spec.endswith((".gguf", *TORCH_SUFFIXES))
    )


def _load_pretrained(source, location, kind, *, dtype, device, device_map, task,
                     as_served: bool = False, **hub_kwargs):
    """``from_pretrained`` of model + tokenizer from ``location`` (folder or hub id).
    ``device_map``: a strategy / dict, or a ``fp8ptq.io.placement.Placement`` (map, memory
    limits, offload folder) handed to accelerate."""
    config = load_config(source, location, as_served=as_served, **hub_kwargs)
    cls = model_class(config, task)
    if device_map is not None and not isinstance(device_map, Placement):
        device_map = Placement(device_map=device_map)
    extra = device_map.from_pretrained_kwargs() if device_map is not None else {}
    model = None
    if streamable(location, kind, config, extra, hub_kwargs):
        try:
            model = load_streaming(location, config, cls, dtype, device)
        except DataError as e:
            raise DataError(f"cannot load model {source!r}: {e}") from None
    if (model is None and not as_served and is_safetensors_folder(Path(location))
            and prequantized(location)):
        raise DataError(f"cannot load model {source!r}: its FP8 weights are dequantized by "
                        "fp8ptq's own reader, which needs a local folder providing every "
                        "parameter and no --device-map")
    if model is None:
        try:
            model = cls.from_pretrained(location, dtype=dtype, **extra, **hub_kwargs)
        except SafetensorError as e:  # a truncated or corrupt weights file
            raise DataError(f"cannot load model {source!r}: a safetensors file is corrupt or "
                            f"truncated ({first_line(e)})") from None
    if not extra:
        model.to(device)
    model.eval()
    return LoadedModel(model, load_tokenizer(source, location, **hub_kwargs), source, kind,
                       location)


def streamable(location, kind, config, placement_kwargs, hub_kwargs) -> bool:
    """Whether ``fp8ptq.io.weights.load_streaming`` loads this model (a local safetensors folder,
    no accelerate placement, no pre-quantized weights, no remote code): the same parameters as
    ``from_pretrained``, without keeping the files' pages resident while loading."""
    return (kind in ("local", "gguf") and not placement_kwargs
            and not hub_kwargs.get("trust_remote_code")
            and getattr(config, "quantization_config", None) is None
            and is_safetensors_folder(Path(location)))


def load_tokenizer(source, location, **hub_kwargs):
    """``AutoTokenizer.from_pretrained`` (with a pad token) or one line saying why not."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **hub_kwargs)
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"cannot load a tokenizer for {source!r}: {first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - the tokenizers (Rust) library raises plain Exception
        if type(e).__module__.split(".")[0] != "tokenizers" and type(e) is not Exception:
            raise
        raise DataError(f"cannot load a tokenizer for {source!r}: {first_line(e)}") from None
    return _with_pad_token(tokenizer)


def _with_pad_token(tokenizer):
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer



# --- torch-saved modules (CNNs) ----------------------------------------------------------

TORCH_SUFFIXES = (".pt", ".pth")


def is_torch_module_file(spec: str | None) -> bool:
    return spec is not None and Path(spec).suffix.lower() in TORCH_SUFFIXES


def _load_torch_module(source, path: Path, *, dtype, device, trust_pickle=False) -> LoadedModel:
    """A ``torch.save``-d ``nn.Module``, or a state dict of the built-in ``digits-cnn``.

    Trust: read without running code from the file (``fp8ptq.files.safe_pickle``): tensors, state
    dicts and modules made of torch.nn layers / built-in architectures load as they are; any
    other pickle needs ``trust_pickle`` (``--trust-pickle``)."""
    obj = load_torch_file(path, trust_pickle=trust_pickle, what="model")
    if isinstance(obj, dict) and obj and all(torch.is_tensor(v) for v in obj.values()):
        obj = TinyMobileNet.from_state_dict(obj)
    if not isinstance(obj, nn.Module):
        raise UsageError(f"cannot load model {source!r}: expected a torch.save-d nn.Module or a "
                         f"digits-cnn state dict, got {type(obj).__name__}")
    obj.to(device=device, dtype=dtype).eval()
    return LoadedModel(obj, None, source, "torch", str(path))


# --- hub ---------------------------------------------------------------------------------


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether a TCP connection to the hub endpoint opens within ``timeout`` seconds.

    Checked up front because the hub client otherwise retries an unreachable host for ~25 s
    before failing. Behind a proxy we cannot tell, so we say yes and let the client try."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_offline() -> bool:
    """True when the hub must not be contacted: offline mode set, or it cannot be reached."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or not hub_reachable()


def _load_from_hub(spec, **load_kwargs) -> LoadedModel:
    offline = hub_offline()
    try:
        # Offline, the local HF cache may still hold the model.
        return _load_pretrained(spec, spec, "hub", local_files_only=offline, **load_kwargs)
    except UsageError:
        raise
    except (OSError, ValueError) as e:
        if offline:
            raise UsageError(
                f"cannot load model {spec!r}: not a local path and the Hugging Face hub is "
                f"unreachable ({first_line(e)})"
            ) from e
        raise UsageError(f"cannot load model {spec!r} from the Hugging Face hub: "
                         f"{first_line(e)}") from e


# --- GGUF --------------------------------------------------------------------------------


def gguf_cache_root() -> Path:
    root = os.environ.get("FP8PTQ_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "fp8ptq"
    return base / "gguf"


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where the dequantized copy of ``gguf_path`` lives; changes when the file does (size,
    mtime) or when transformers does (its conversion may change between versions)."""
    stat = gguf_path.stat()
    key = f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return gguf_cache_root() / f"{gguf_path.stem}-{digest}"


def _load_gguf(source, gguf_path: Path, *, task, **load_kwargs) -> LoadedModel:
    # Loading back from the cache even the first time keeps first and later loads identical.
    return _load_pretrained(source, str(gguf_folder(gguf_path, task)), "gguf", task=task,
                            **load_kwargs)


def gguf_folder(gguf_path: Path, task: str | None = None) -> Path:
    """The safetensors folder fp8ptq keeps for ``gguf_path`` (dequantized once, then cached):
    what every path that loads a GGUF model reads (in memory, sequential, ``--max-memory``
    routing). The conversion holds one block at a time, so a GGUF larger than memory
    converts."""
    cached = gguf_cache_dir(gguf_path)
    if not (cached / "config.json").is_file():
        with _converting(cached.parent):
            if not (cached / "config.json").is_file():  # not made while this one waited
                convert_gguf(gguf_path, cached, task)  # block by block (io.gguf_convert)
    return cached


@contextmanager
def _converting(root: Path) -> Iterator[None]:
    """Held while this process converts a GGUF into the cache folder ``root``: an exclusive
    ``flock`` on the folder itself (no lock file left in the cache; the kernel drops it when
    the process dies). Why: runs started together on a model not yet converted (the demo's
    e4m3 and int8 quantize side by side) each converted it, the same work twice, and all but
    one of the copies was thrown away; now the later ones wait and load the first one's."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def resolve_safetensors(spec: str, *, task: str | None = None) -> tuple[Path, str] | str:
    """``(folder, kind)`` of the safetensors checkpoint behind MODEL ``spec`` (kind: ``local``,
    ``hub`` or ``gguf``), or a string saying why there is none (a ``.pt`` module, a folder with
    only ``.bin`` weights, an fp8ptq checkpoint, a hub id with no snapshot)."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf_folder(path.resolve(), task), "gguf"
    if path.is_dir():
        if (path / "fp8ptq.json").is_file():
            return f"{spec} is an fp8ptq checkpoint (already quantized)"
        if is_safetensors_folder(path):
            return path.resolve(), "local"
        return f"{spec} has no config.json with safetensors weights"
    if path.exists() or spec.startswith((os.sep, ".", "~")) or spec.count("/") != 1:
        return f"{spec} is not a safetensors checkpoint folder, a hub id or a .gguf file"
    return _hub_snapshot(spec)


def _hub_snapshot(repo_id: str) -> tuple[Path, str] | str:
    """The local snapshot of hub model ``repo_id`` (config, tokenizer and safetensors files
    only; fetched when the hub is reachable and the cache lacks them)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        folder = Path(snapshot_download(
            repo_id, local_files_only=hub_offline(),
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]))
    except (OSError, ValueError, HFValidationError) as e:
        return f"no local snapshot of {repo_id} ({first_line(e)})"
    if not is_safetensors_folder(folder):
        return f"the snapshot of {repo_id} has no safetensors weights"
    return folder, "hub"
