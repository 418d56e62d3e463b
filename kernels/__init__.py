"""refinery.kernels."""
