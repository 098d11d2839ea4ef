"""Checkpoints: compressed-tensors layout for e4m3 / int8 Linear models, the native fp8ptq
layout otherwise, ``fp8ptq.json`` always (see README.md in this folder)."""

from .convert import fn_to_fnuz
from .reader import check_checkpoint, load_quantized, read_metadata
from .writer import LAYOUT_CT, LAYOUT_NATIVE, choose_layout, save_quantized

__all__ = ["save_quantized", "load_quantized", "check_checkpoint", "read_metadata", "choose_layout", "fn_to_fnuz",
           "LAYOUT_CT", "LAYOUT_NATIVE"]
