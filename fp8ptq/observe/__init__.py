"""What the calibration pass observes: GEMM input statistics, Hessians, attention and residual
taps."""
