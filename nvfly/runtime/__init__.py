"""The runtime: the CUDA driver, kernel launches, torch arguments and TMA descriptors built on the host."""
