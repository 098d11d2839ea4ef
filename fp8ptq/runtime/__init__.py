"""The process the library runs in: optional native CPU kernels and the usage (time / memory)
report."""
