"""Native CPU kernels for model layers (plain C ABI, loaded with ctypes), each with a plain-PyTorch twin."""
