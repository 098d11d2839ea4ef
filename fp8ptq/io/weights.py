"""A model built without its weights, then filled from its safetensors checkpoint tensor by tensor.

One loader serves two callers: the in-memory pipeline loads a local safetensors folder onto its
device (each parameter as it is read) through ``load_streaming`` (``fp8ptq.io.loading``) instead
of ``from_pretrained``, and sequential mode (``fp8ptq.execution.streaming``) loads one block's
tensors at a time through ``WeightLoader``. Both read with fp8ptq's one weight reader
(``fp8ptq.io.source``: positioned reads, headers checked up front) and map checkpoint keys to
parameters with the map the model-free path uses (``fp8ptq.io.weight_map.SourceMap``:
transformers' own renamings, and its converters that fuse per-expert MoE tensors into Mixtral /
Qwen2-MoE / Qwen3-MoE's 3-D ``...Experts`` parameters, each in the dtype ``from_pretrained``
gives it). So the three paths read a checkpoint the same way, and a parameter loaded here is bit
for bit the one ``from_pretrained`` builds (tested).

Why not ``from_pretrained`` on the CPU: it memory-maps every safetensors file and the pages it
reads stay resident (and count in the process's RSS) until the whole model is loaded, on top
of the parameters it converts from them, so reading each tensor on its own lowers the loading
peak (docs/results/speed.md, "Other figures behind code comments").
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from torch import nn
from transformers import AutoConfig, GenerationConfig

from ..errors import DataError, UsageError, first_line
from ..model.auto import model_class
from .source import SafetensorsSource, prequantized
from .weight_map import Load, SourceMap


def empty_model(cls, config, dtype: torch.dtype) -> nn.Module:
    """The architecture of ``config`` (``cls``: an Auto class), every parameter on the meta
    device; buffers (rotary tables, position ids) are real, as ``from_pretrained`` computes
    them from the model's code."""
    try:
        with init_empty_weights(include_buffers=False):
            model = cls.from_config(config, dtype=dtype)
    except ValueError as e:  # e.g. an auto class that does not fit the architecture
        raise UsageError(f"cannot build {getattr(config, 'model_type', 'the model')}: "
                         f"{first_line(e)}") from None
    return model.eval()


def build_empty(folder: str | Path, dtype: torch.dtype, task: str | None = None) -> nn.Module:
    """``empty_model`` of the checkpoint in ``folder`` (its config.json; ``task`` picks the
    Auto class as ``fp8ptq.io.loading.load_model`` does)."""
    config = load_config(str(folder), folder)
    return empty_model(model_class(config, task), config, dtype)


class WeightLoader:
    """Loads the checkpoint tensors of ``source`` into ``model`` (built by ``empty_model``:
    meta parameters become real tensors on ``device``), all at once or a part at a time. Tied
    parameters that are not a tie's source are left to ``model.tie_weights()`` (not read
    twice)."""

    def __init__(self, model: nn.Module, source: SafetensorsSource, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.model, self.source, self.device = model, source, device
        self.map = SourceMap(model, source.names(), dtype)
        self.tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        self.loads = [ld for ld in self.map.loads if not set(ld.targets) <= self.tied]
        self._shapes = {k: v.shape for k, v in model.state_dict().items()}

    def under(self, prefix: str, exclude: str | None = None) -> list[Load]:
        """The loads whose parameters are under ``prefix`` (and not under ``exclude``)."""
        return [ld for ld in self.loads if ld.targets[0].startswith(prefix)
                and not (exclude and ld.targets[0].startswith(exclude))]

    def uncovered(self) -> list[str]:
        """Model parameters no checkpoint tensor provides (tied ones aside)."""
        return [n for n, _ in self.model.named_parameters()
                if n not in self.map.by_target and n not in self.tied]

    def load(self, loads: list[Load], device: torch.device | str | None = None) -> None:
        """Read ``loads`` and set their parameters, one load's tensors in memory at a time, on
        ``device`` (default: the loader's)."""
        folder = self.source.folder
        device = self.device if device is None else device
        for ld in loads:
            try:
                values = self.map.realize(ld, self.source.read_one)
            except (RuntimeError, ValueError, KeyError) as e:  # a converter that cannot fuse
                raise DataError(f"{folder}: cannot convert {ld.targets[0]}: "
                                f"{first_line(e)}") from None
            for name, value in values.items():
                want = self._shapes.get(name)
                if want is not None and tuple(value.shape) != tuple(want):
                    raise DataError(f"{folder}: {name} has shape {tuple(value.shape)} in the "
                                    f"checkpoint, the model expects {tuple(want)}")
                set_module_tensor_to_device(self.model, name, device, value=value,
                                            dtype=value.dtype)


def load_streaming(folder: str | Path, config, cls, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> nn.Module | None:
    """The whole model from a local safetensors folder, read tensor by tensor (see the module
    docstring), or None when the checkpoint does not provide every parameter (a head to be
    initialized, an adapter...): then ``from_pretrained`` decides, as it always did. Each
    parameter goes to ``device`` as it is read (a GPU model is not first gathered in host
    memory and then copied whole); buffers stay where the model's code made them."""
    model = empty_model(cls, config, dtype)
    source = SafetensorsSource(folder)
    try:
        loader = WeightLoader(model, source, dtype, device)
        if loader.uncovered():
            return None
        loader.load(loader.loads)
    finally:
        source.close()
    model.tie_weights()
    if any(p.is_meta for p in model.parameters()):
        return None
    if model.can_generate() and (Path(folder) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()


__all__ = ["WeightLoader", "build_empty", "empty_model", "load_streaming"]


REMOTE_CODE_HINTS = ("trust_remote_code", "custom code")


def load_config(source, location, *, as_served: bool = False, **hub_kwargs):
    """``AutoConfig.from_pretrained`` with its failures as one line: an architecture this
    transformers does not know, or a repository that ships its own code (refused unless
    ``trust_remote_code``). ``as_served``: keep another tool's ``quantization_config`` so that
    transformers applies it (a checkpoint evaluated as a runtime serves it)."""
    try:
        config = AutoConfig.from_pretrained(location, **hub_kwargs)
    except (ValueError, KeyError) as e:  # e.g. a model_type this transformers does not know
        if any(hint in str(e) for hint in REMOTE_CODE_HINTS):
            raise UsageError(f"refusing to run the code that model {source!r} ships with "
                             "(its config names its own Python modules); pass "
                             "--trust-remote-code (trust_remote_code=True) only if you trust "
                             "its source") from None
        raise DataError(f"cannot load model {source!r}: {first_line(e)}") from None
    if not as_served and Path(location).is_dir() and prequantized(location) is not None:
        # read as the float model it stands for (``SafetensorsSource``): no quantizer, and no
        # stale quantization_config in what fp8ptq writes
        del config.quantization_config
    return config
