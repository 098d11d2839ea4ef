"""Weight and model transforms, one algorithm a module or folder: GPTQ, SmoothQuant, rotation, BN
re-tuning."""
