"""Calibrators: turn the statistics of one calibration pass into clip ranges (amax).

Every calibrator is an entry of ``registry`` (its kind, its options); the built-in ones are
registered here. ``activation_calibrator`` / ``weight_calibrator`` build statistics calibrators
by name.
"""

from . import layerwise, registry
from .hmse import HessianMseWeightCalibrator
from .max import CastCalibrator, MaxCalibrator, MaxWeightCalibrator
from .mse import MseCalibrator, MseWeightCalibrator
from .percentile import PercentileCalibrator
from .registry import LAYER_AWARE, STATISTICS, CalibratorEntry, register

_PERCENTILE = {"percentile": "percentile of |x| to clip at, in (0, 100]"}
_POW2 = {"pow2_range": "exponents LOW,HIGH searched around the base scale"}
_GPTQ = {"gptq_damp": "dampening, a fraction of the Hessian's mean diagonal",
         "gptq_act_order": "columns in order of decreasing input energy",
         "gptq_block": "lazy-update block (columns)",
         "gptq_sequential": "Hessians from the model quantized so far, group by group",
         "gptq_asym": "aim at the float model's output (sequential only)",
         "gptq_sink": "weight of each sequence's first token (sequential only)",
         "gptq_sink_target": "the first token's target: each layer's or the float model's",
         "gptq_hessian_dtype": "dtype the Hessian sums are accumulated in",
         "gptq_sweep_dtype": "dtype of the column sweep (weight copy, factor, errors)",
         "gptq_all_experts": "MoE: each expert's Hessians from every token, not its routed ones"}

register(CalibratorEntry("max", "activation", factory=MaxCalibrator))
register(CalibratorEntry("percentile", "activation", factory=PercentileCalibrator,
                         options=_PERCENTILE))
register(CalibratorEntry("mse", "activation", factory=MseCalibrator))
register(CalibratorEntry("cast", "activation", factory=CastCalibrator, help="scale 1"))
register(CalibratorEntry("best", "activation", LAYER_AWARE, choose=layerwise.choose_best,
                         options=_PERCENTILE, fallback="max"))
register(CalibratorEntry("pow2-search", "activation", LAYER_AWARE,
                         choose=layerwise.choose_pow2_search, options=_POW2, fallback="max"))
register(CalibratorEntry("max", "weight", factory=MaxWeightCalibrator))
register(CalibratorEntry("mse", "weight", factory=MseWeightCalibrator))
register(CalibratorEntry("cast", "weight", factory=CastCalibrator, help="scale 1"))
# GPTQ (``gptq.py``): scales from max / MSE, then the error-compensating column sweep over the
# calibration inputs' Hessian -- so these read calibration data
for _name, _scales in (("gptq", MaxWeightCalibrator), ("gptq-mse", MseWeightCalibrator),
                       ("gptq-hmse", HessianMseWeightCalibrator)):
    register(CalibratorEntry(_name, "weight", factory=_scales, options=_GPTQ, rounding="gptq",
                             reads_data=True,
                             help="GPTQ on hmse's scales" if _name == "gptq-hmse" else ""))
# scales by the Hessian-weighted rounding error (``hmse.py``), then round to nearest: reads the
# calibration inputs for the Hessian's diagonal only
register(CalibratorEntry("hmse", "weight", factory=HessianMseWeightCalibrator, reads_data=True,
                         help="scales by input-energy-weighted error, round to nearest"))

# Views of the registry kept for callers that list names.
ACTIVATION_CALIBRATORS = registry.names("activation", STATISTICS)
LAYERWISE_CALIBRATORS = registry.names("activation", LAYER_AWARE)
WEIGHT_CALIBRATORS = registry.names("weight")
GPTQ_CALIBRATORS = tuple(n for n in WEIGHT_CALIBRATORS
                         if registry.weight_entry(n).rounding == "gptq")


def activation_calibrator(name: str, **options):
    """A statistics activation calibrator; ``options`` outside its schema are ignored."""
    return registry.activation_entry(name).build(**options)


def weight_calibrator(name: str, **options):
    return registry.weight_entry(name).build(**options)


__all__ = ["activation_calibrator", "weight_calibrator", "registry", "CalibratorEntry",
           "register", "STATISTICS", "LAYER_AWARE"]
