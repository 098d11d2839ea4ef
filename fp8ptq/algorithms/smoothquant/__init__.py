"""SmoothQuant (Xiao et al., SmoothQuant: Accurate and Efficient Post-Training Quantization for
Large Language Models, 2023): norm-fed GEMM groups and GEMM pairs."""
