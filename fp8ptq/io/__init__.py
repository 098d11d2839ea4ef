"""Reading and writing: model and weight sources, GGUF, calibration data, safe unpickling, atomic
files."""
