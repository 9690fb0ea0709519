"""The compiler: MLIR lowering to PTX, ptxas, the compiled-kernel artifact and its disk cache."""
