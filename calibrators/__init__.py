"""Calibrators: turn the statistics of one calibration pass into clip ranges (amax).

Every calibrator is an entry of ``registry`` (its kind, its options); the built-in ones are
registered here. ``activation_calibrator`` / ``weight_calibrator`` build statistics calibrators
by name.
"""

from . import layerwise, registry
from .max import CastCalibrator, MaxCalibrator, MaxWeightCalibrator
from .mse import MseCalibrator, MseWeightCalibrator
from .percentile import PercentileCalibrator
from .registry import LAYER_AWARE, STATISTICS, CalibratorEntry, register

_PERCENTILE = {"percentile": "percentile of |x| to clip at, in (0, 100]"}
_POW2 = {"pow2_range": "exponents LOW,HIGH searched around the base scale"}

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

# Views of the registry kept for callers that list names.
ACTIVATION_CALIBRATORS = registry.names("activation", STATISTICS)
LAYERWISE_CALIBRATORS = registry.names("activation", LAYER_AWARE)
WEIGHT_CALIBRATORS = registry.names("weight")


def activation_calibrator(name: str, **options):
    """A statistics activation calibrator; ``options`` outside its schema are ignored."""
    return registry.activation_entry(name).build(**options)


def weight_calibrator(name: str, **options):
    return registry.weight_entry(name).build(**options)


__all__ = ["activation_calibrator", "weight_calibrator", "registry", "CalibratorEntry",
           "register", "STATISTICS", "LAYER_AWARE"]
