"""Quantized checkpoints: compressed-tensors (fp8, int8 W8A8, packed int4), AutoAWQ GEMM and Qwen's block-wise FP8.
`scheme.py` parses `quantization_config`, `formats.py` turns each on-disk layout into one canonical in-memory
form, `linear.py` holds the quantized projection and its compute paths, `activations.py` the dynamic activation
quantization."""
