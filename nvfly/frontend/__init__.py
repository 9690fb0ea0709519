"""The front end: tracing Python kernels into MLIR (values, control flow, tensors, argument specs, dtypes)."""
