"""One case's calls for ncu: warm-up, then 3 more calls (ncu profiles the 4th launch of the named kernel)."""
import sys
import torch
case = sys.argv[1]
torch.manual_seed(0)
if case == "prefill":  # D 128, B 1, 16K x 16 heads, non-causal (636 vs target 660)
    from nvfly.ops import attention
    q, k, v = (torch.randn(1, 16384, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call = lambda: attention.prefill(q, k, v)
elif case == "prefill_d64_causal":  # D 64, B 8, 2K x 32 heads causal (0.91x cuDNN)
    from nvfly.ops import attention
    q, k, v = (torch.randn(8, 2048, 32, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call = lambda: attention.prefill(q, k, v, causal=True)
elif case == "decode_fp8":  # B 1, 128K, 32/8, fp8 KV (2.9 TB/s)
    from nvfly.ops import attention
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 131072, 8, 128, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn) for _ in range(2))
    s = torch.rand(2, 8, device="cuda") + 0.5
    call = lambda: attention.decode(q, k, v, k_scale=s[0], v_scale=s[1], validate=False)
elif case == "decode":  # B 1, 128K, 32/8, bf16 (3.76 TB/s)
    from nvfly.ops import attention
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 131072, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    call = lambda: attention.decode(q, k, v, validate=False)
elif case == "grouped_fp8":  # DeepSeek-V3 gate/up, 4096 tokens top-8 of 256, 128 rows an expert (796 TFLOP/s)
    from nvfly.ops import scaled
    from nvfly.ops.scaled.quantize import quantize
    e, n, kk, rows = 256, 4096, 7168, 32768
    a, sa = quantize(torch.randn(rows, kk, device="cuda"), "1x128")
    from benchmarks.grouped import fp8_experts
    b, sb = fp8_experts(e, n, kk)
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (rows // e)
    call = lambda: scaled.scaled_grouped_mm(a, b, sa, sb, offs)
elif case.startswith("mm_fp8"):  # MiniMax B 1, 32K, 48/8, fp8 KV: contiguous 1.75 TB/s, paged 1.03-1.12
    from nvfly.ops import attention
    from benchmarks.attention import paged
    q = torch.randn(1, 1, 48, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 32768, 8, 128, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn) for _ in range(2))
    s = torch.rand(2, 8, device="cuda") + 0.5
    table = None
    if case.endswith("paged16"):
        k, v, table = paged(k, v, 16)
    call = lambda: attention.decode(q, k, v, block_table=table, k_scale=s[0], v_scale=s[1], validate=False)
    import triton.testing
    print(case, "ms", triton.testing.do_bench(call, rep=200, return_mode="median"))
else:
    raise SystemExit(f"unknown case {case}")
for _ in range(4):
    call()
torch.cuda.synchronize()
print(case, "ok")
