"""Activation taps beyond the GEMM inputs: the attention batched matmuls and the residual adds
(``taps.ActivationTaps``), and where they sit in a model (``tap_sites``)."""
