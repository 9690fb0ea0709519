"""Graph time per call of a tiny 63-block kernel: cooperative or not, 64 KB of dynamic smem or none, and as a
programmatic dependent launch (pdl 1: wait at the start; 2: also trigger the next at the start).
One configuration per process (argv: coop smem_bytes pdl)."""
import sys
import torch
import nvfly
sys.path.insert(0, ".")
from benchmarks.common import graph_ms


@nvfly.kernel
def tiny(x: nvfly.Tensor, COOP: nvfly.Constexpr, SMEM: nvfly.Constexpr, PDL: nvfly.Constexpr):
    if COOP:
        nvfly.cooperative()
    if PDL == 2:
        nvfly.launch_dependents()
    tid = nvfly.thread_idx.x
    if PDL:
        nvfly.wait_prior_grid()
    if SMEM:
        s = nvfly.dynamic_shared_tensor(nvfly.i32, (SMEM // 4,))
        s[tid] = tid
        nvfly.syncthreads()
        if tid == 0:
            x[nvfly.block_idx.x] = x[nvfly.block_idx.x] + s[255 - tid]
    elif tid == 0:
        x[nvfly.block_idx.x] = x[nvfly.block_idx.x] + 1.0


coop, smem, pdl = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
x = torch.zeros(64, device="cuda")
launch = tiny.prepared((63, 1, 1), 256)
call = lambda: launch.launch(x, bool(coop), smem, pdl)
call(); torch.cuda.synchronize()
x.zero_()
for _ in range(10):
    call()
torch.cuda.synchronize()
expect = 10.0 * (255 if smem else 1)
ok = bool((x[:63] == expect).all())
t = sorted(graph_ms(call, calls=64) for _ in range(5))
print(f"coop={coop} smem={smem} pdl={pdl} {'ok' if ok else 'WRONG'}: graph us/call " + " ".join(f"{v*1e3:.2f}" for v in t), flush=True)
