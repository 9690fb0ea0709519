"""PyTorch integration: custom ops, eager routing of aten calls to nvfly kernels, and TorchInductor hooks."""
