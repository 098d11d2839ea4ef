"""The steps every quantizing path shares: the calibration pass (``calibrate``) and one
module's scales, codes and report (``quantize_module``). The in-memory pipeline, the block
streaming and model-free paths (``fp8ptq.execution``) and the sensitivity analysis
(``fp8ptq.sensitivity``) all call them, so they sit below both."""
