"""Calibrators: turn the statistics of one calibration pass into clip ranges (amax)."""

from fp8ptq.errors import UsageError

from .max import CastCalibrator, MaxCalibrator, MaxWeightCalibrator
from .mse import MseCalibrator, MseWeightCalibrator
from .percentile import PercentileCalibrator

ACTIVATION_CALIBRATORS = {"max": MaxCalibrator, "percentile": PercentileCalibrator,
                          "mse": MseCalibrator, "cast": CastCalibrator}
# Layer-output-aware activation calibrators (they need row samples and the weight):
# implemented in ``layerwise``, listed here so names validate in one place.
LAYERWISE_CALIBRATORS = ("best", "pow2-search")
WEIGHT_CALIBRATORS = {"max": MaxWeightCalibrator, "mse": MseWeightCalibrator,
                      "cast": CastCalibrator,
                      # GPTQ (``gptq.py``): scales from max / MSE, then the error-compensating
                      # column sweep over the calibration inputs' Hessian
                      "gptq": MaxWeightCalibrator, "gptq-mse": MseWeightCalibrator}
GPTQ_CALIBRATORS = ("gptq", "gptq-mse")


def activation_calibrator(name: str, **options):
    if name not in ACTIVATION_CALIBRATORS:
        raise UsageError(f"unknown activation calibrator {name!r}; valid: "
                         f"{', '.join([*ACTIVATION_CALIBRATORS, *LAYERWISE_CALIBRATORS])}")
    cls = ACTIVATION_CALIBRATORS[name]
    return cls(**options) if name == "percentile" else cls()


def weight_calibrator(name: str):
    if name not in WEIGHT_CALIBRATORS:
        raise UsageError(f"unknown weight calibrator {name!r}; valid: "
                         f"{', '.join(WEIGHT_CALIBRATORS)}")
    return WEIGHT_CALIBRATORS[name]()
