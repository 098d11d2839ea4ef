"""Checkpoints: a registry of layouts (compressed-tensors for e4m3 / int8 Linear models, the
native fp8ptq layout otherwise), a writer that streams tensors into shards, the reader,
``fp8ptq.json`` always (see README.md in this folder)."""

from .convert import fn_to_fnuz
from .layouts import (
                      Layout,
                      LayoutChoice,
                      ModuleDesc,
                      choose_layout,
                      describe_model,
                      describe_plan,
                      get_layout,
                      model_type_of,
                      register,
)
from .reader import check_checkpoint, load_quantized, read_metadata
from .shards import ShardWriter
from .writer import LAYOUT_CT, LAYOUT_NATIVE, CheckpointWriter, save_quantized

__all__ = ["save_quantized", "load_quantized", "check_checkpoint", "read_metadata",
           "choose_layout", "describe_model", "describe_plan", "model_type_of", "get_layout",
           "register", "Layout", "LayoutChoice", "ModuleDesc", "CheckpointWriter", "ShardWriter",
           "fn_to_fnuz", "LAYOUT_CT", "LAYOUT_NATIVE"]
