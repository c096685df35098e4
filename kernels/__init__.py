"""rtmedia.kernels."""
