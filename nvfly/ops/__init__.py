"""nvfly's kernel library, written in the DSL: each module offers a host function on torch tensors, an
eligibility check that explains why an input is declined, and the kernels behind it."""
