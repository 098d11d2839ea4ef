"""What the calibration pass observes: GEMM input statistics (``observers``), Hessians
(``hessian``), and their reduction across torchrun ranks (``distributed``)."""
