import time, torch
from torch.utils.cpp_extension import load
t=time.time()
m = load("nvfly_route_kernel_test", sources=["nvfly/torch/native/route_kernel.cpp"], verbose=False, extra_cflags=["-O2"])
print("built", time.time()-t)
