"""Placement of a model across devices: accelerate device maps, memory limits and offload.

``--device-map auto|balanced|balanced_low_0|sequential|JSON|FILE.json`` and ``--max-memory``
go to ``from_pretrained`` unchanged, so accelerate decides where each block lives (GPUs, CPU,
disk) exactly as it does for inference; ``--offload-folder`` is where disk-offloaded weights go
(a temporary folder removed at exit by default).

Calibration runs through accelerate's hooks as they are (offloaded blocks are brought in for
their forward and dropped after). Quantizing a weight needs its values, and the quantized
module keeps its codes: ``materialize_offloaded`` loads every offloaded tensor onto the device
its block computes on and turns that block's offloading off, before scales are chosen. So
offload bounds the memory of loading and calibration; the quantized model is held on its
execution devices (block-by-block streaming for models larger than memory is a separate mode).
"""

from __future__ import annotations

import atexit
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..errors import UsageError

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_SIZE = re.compile(r"^\s*\d+(\.\d+)?\s*([KMGT]i?B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Placement:
    device_map: str | dict | None = None
    max_memory: dict | None = None
    offload_folder: str | None = None

    @property
    def dispatched(self) -> bool:
        return self.device_map is not None

    def from_pretrained_kwargs(self) -> dict:
        if self.device_map is None:
            if self.max_memory is not None:
                raise UsageError("--max-memory needs --device-map (e.g. --device-map auto)")
            return {}
        out = {"device_map": self.device_map}
        if self.max_memory is not None:
            out["max_memory"] = self.max_memory
        out["offload_folder"] = self.offload_folder or _temporary_offload_folder()
        return out


def parse_placement(device_map: str | None, max_memory: str | None,
                    offload_folder: str | None = None) -> Placement:
    placement = Placement(parse_device_map(device_map), parse_max_memory(max_memory),
                          offload_folder)
    if placement.max_memory is not None and placement.device_map is None:  # now, not at load
        raise UsageError("--max-memory needs --device-map (e.g. --device-map auto)")
    return placement


def parse_device_map(text: str | None):
    """A strategy name, a JSON object ``{"module": device}`` or a .json file holding one."""
    if text is None:
        return None
    text = text.strip()
    if text in STRATEGIES:
        return text
    if text.startswith("{"):
        source = "--device-map"
        raw = text
    else:
        path = Path(text).expanduser()
        if not path.is_file():
            raise UsageError(f"--device-map must be one of {', '.join(STRATEGIES)}, a JSON "
                             f"object or a .json file, got {text!r}")
        source, raw = str(path), path.read_text()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UsageError(f"{source}: not valid JSON ({e.msg} at line {e.lineno} column "
                         f"{e.colno})") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise UsageError(f"{source}: a device map is a JSON object of module name -> device")
    for module, device in value.items():
        if not (isinstance(device, int) and not isinstance(device, bool)) and not (
                isinstance(device, str) and re.fullmatch(r"cpu|disk|meta|cuda(:\d+)?|\d+",
                                                         device)):
            raise UsageError(f"{source}: device of {module!r} must be a GPU index, 'cpu', "
                             f"'disk' or 'cuda:N', got {device!r}")
    return {k: int(v) if isinstance(v, str) and v.isdigit() else v for k, v in value.items()}


def parse_max_memory(text: str | None) -> dict | None:
    """``4GB`` (the CPU's budget), ``0=20GiB,cpu=64GiB`` or a JSON object, as accelerate takes
    it (GPU indices as ints)."""
    if text is None:
        return None
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"--max-memory: not valid JSON ({e.msg})") from None
        if not isinstance(raw, dict):
            raise UsageError("--max-memory: expected a JSON object of device -> size")
        items = [(str(k), str(v)) for k, v in raw.items()]
    elif "=" in text:
        items = [tuple(p.strip() for p in part.split("=", 1)) for part in text.split(",")]
        if any(len(item) != 2 for item in items):
            raise UsageError(f"--max-memory expects DEVICE=SIZE[,...], got {text!r}")
    else:
        items = [("cpu", text)]
    out: dict = {}
    for device, size in items:
        if not _SIZE.match(size) or not re.fullmatch(r"cpu|disk|\d+|cuda:\d+", device):
            raise UsageError(f"--max-memory expects SIZE or DEVICE=SIZE[,...] with sizes like "
                             f"4GB or 512MiB and devices cpu, disk or a GPU index, got {text!r}")
        key = int(device.removeprefix("cuda:")) if device.removeprefix("cuda:").isdigit() \
            else device
        out[key] = size.replace(" ", "").upper().replace("IB", "iB")
    return out


def _temporary_offload_folder() -> str:
    folder = tempfile.mkdtemp(prefix="fp8ptq-offload-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _hooks(module: nn.Module):
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])  # SequentialHook holds several


def has_offload(model: nn.Module) -> bool:
    return any(getattr(h, "offload", False) for m in model.modules() for h in _hooks(m))


def materialize_offloaded(model: nn.Module) -> int:
    """Load every offloaded (CPU- or disk-mapped) tensor onto its block's execution device and
    stop offloading it, so that weights can be read and replaced. Returns the number of tensors
    loaded. Blocks that were not offloaded are untouched."""
    from accelerate.utils import named_module_tensors, set_module_tensor_to_device

    loaded = 0
    for module in model.modules():
        for hook in _hooks(module):
            if not getattr(hook, "offload", False):
                continue
            for name, _ in named_module_tensors(module, include_buffers=hook.offload_buffers,
                                                recurse=hook.place_submodules,
                                                remove_non_persistent=True):
                prefixed = name
                value = hook.weights_map[prefixed]
                set_module_tensor_to_device(module, name, hook.execution_device,
                                            value=value)
                loaded += 1
            hook.offload = False
    return loaded
