"""The foundation on a real GPU: examples, control flow, shuffles, shared memory, clusters, TMA descriptor ABI,
printf, masked accesses, and coexistence with torch.compile/Triton in either import order."""
import os
import subprocess
import sys

import pytest
import torch

import nvfly
from nvfly.examples.softmax import softmax
from nvfly.examples.tiled_transpose import transpose
from nvfly.examples.vector_add import add

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda") if dtype.is_floating_point else \
        torch.full(shape, -12345, dtype=dtype, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 7, 1000, 4096, (1 << 20) + 3, 1 << 22])
def test_vector_add_matches_torch(dtype, n):
    x = torch.randn(n, device="cuda").to(dtype)
    y = torch.randn(n, device="cuda").to(dtype)
    out = add(x, y)
    torch.cuda.synchronize()
    assert torch.equal(out, x + y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 8), (3, 1000), (512, 4096), (64, 32768)])
def test_softmax_matches_torch(dtype, shape):
    if shape[1] * torch.tensor([], dtype=dtype).element_size() % 16:
        shape = (shape[0], shape[1] + 8)
    x = torch.randn(shape, device="cuda").to(dtype) * 4
    out = softmax(x)
    ref = torch.softmax(x.double(), -1)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", [(1, 1), (33, 65), (1000, 777), (4096, 4096)])
def test_transpose_exact_including_strided_input(shape):
    x = torch.randn(shape, device="cuda")
    assert torch.equal(transpose(x), x.t())
    xt = torch.randn(shape[::-1], device="cuda").t()  # column-major input
    assert torch.equal(transpose(xt), xt.t())


@nvfly.kernel
def swap_kernel(out: nvfly.Tensor, flag: nvfly.i32):
    a = nvfly.i32(11)
    b = nvfly.i32(22)
    if flag > 0:
        a, b = b, a
    out[0] = a
    out[1] = b


@nvfly.kernel
def loops_kernel(x: nvfly.Tensor, out: nvfly.Tensor, n: nvfly.i32):
    acc = [0.0, 0.0, 0.0, 0.0]
    for k in range(n):
        for j in nvfly.static_range(4):
            acc[j] = acc[j] + x[k * 4 + j]
    for j in nvfly.static_range(4):
        out[j] = acc[j]
    i = nvfly.i32(1)
    steps = nvfly.i32(0)
    while i < n:
        i = i * 2
        steps = steps + 1
    out[4] = steps.to(nvfly.f32)


def test_control_flow_results_on_the_gpu():
    out = poisoned((2,), torch.int32)
    swap_kernel[1, 1](out, 1)
    assert out.tolist() == [22, 11]
    swap_kernel[1, 1](out, 0)
    assert out.tolist() == [11, 22]
    x = torch.randn(4 * 100, device="cuda")
    res = poisoned((5,), torch.float32)
    loops_kernel[1, 1](x, res, 100)
    assert torch.allclose(res[:4], x.view(100, 4).sum(0), rtol=1e-5, atol=1e-5)
    assert res[4].item() == 7  # 1 -> 128 in 7 doublings


@nvfly.kernel
def shuffle_kernel(x: nvfly.Tensor, out: nvfly.Tensor):
    lane = nvfly.lane_idx()
    v = x[lane]
    out[0, lane] = nvfly.shfl_xor(v, 1)
    out[1, lane] = nvfly.shfl_down(v, 3)
    out[2, lane] = nvfly.shfl_up(v, 2)
    out[3, lane] = nvfly.shfl_idx(v, 5)
    out[4, lane] = nvfly.warp_reduce(v, "max")


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.float64])
def test_shuffles(dtype):
    x = (torch.randn(32, device="cuda") * 100).to(dtype)
    out = poisoned((5, 32), dtype)
    shuffle_kernel[1, 32](x, out)
    lanes = torch.arange(32, device="cuda")
    assert torch.equal(out[0], x[lanes ^ 1])
    down = torch.where(lanes + 3 < 32, lanes + 3, lanes)
    assert torch.equal(out[1], x[down])
    up = torch.where(lanes >= 2, lanes - 2, lanes)
    assert torch.equal(out[2], x[up])
    assert torch.equal(out[3], x[5].expand(32))
    assert torch.equal(out[4], x.max().expand(32))


@nvfly.kernel
def segment_shuffle_kernel(x: nvfly.Tensor, out: nvfly.Tensor, W: nvfly.Constexpr):
    lane = nvfly.lane_idx()
    v = x[lane]
    out[0, lane] = nvfly.shfl_xor(v, 1, W)
    out[1, lane] = nvfly.shfl_down(v, 3, W)
    out[2, lane] = nvfly.shfl_up(v, 2, W)
    out[3, lane] = nvfly.shfl_idx(v, 5, W)
    out[4, lane] = nvfly.warp_reduce(v, "add", W)


@pytest.mark.parametrize("width", [4, 8, 16])
def test_segmented_shuffles_follow_cuda_semantics(width):
    x = torch.arange(32, device="cuda", dtype=torch.float32) * 3 + 1
    out = poisoned((5, 32), torch.float32)
    segment_shuffle_kernel[1, 32](x, out, W=width)
    lanes = torch.arange(32, device="cuda")
    pos = lanes % width
    assert torch.equal(out[0], x[lanes ^ 1])
    assert torch.equal(out[1], x[torch.where(pos + 3 < width, lanes + 3, lanes)])
    assert torch.equal(out[2], x[torch.where(pos >= 2, lanes - 2, lanes)])
    assert torch.equal(out[3], x[(lanes // width) * width + 5 % width])
    assert torch.equal(out[4], x.view(-1, width).sum(1).repeat_interleave(width))


@nvfly.kernel
def big_smem_kernel(x: nvfly.Tensor, out: nvfly.Tensor, N: nvfly.Constexpr):
    buf = nvfly.dynamic_shared_tensor(nvfly.f32, (N,))
    tid = nvfly.thread_idx.x
    for i in range(tid, N, 256):
        buf[i] = x[i]
    nvfly.syncthreads()
    for i in range(tid, N, 256):
        out[i] = buf[N - 1 - i]


def test_dynamic_shared_memory_above_48kb():
    n = 48 * 1024  # 192 KB of f32
    x = torch.randn(n, device="cuda")
    out = poisoned((n,), torch.float32)
    big_smem_kernel[1, 256](x, out, N=n)
    assert torch.equal(out, x.flip(0))
    k = big_smem_kernel.compile(x, out, N=n, block=256)
    assert k.dynamic_smem_bytes == n * 4


@nvfly.kernel
def cluster_kernel(out: nvfly.Tensor):
    b = nvfly.block_idx.x
    if nvfly.thread_idx.x == 0:
        out[b, 0] = nvfly.block_rank_in_cluster()
        out[b, 1] = nvfly.cluster_idx.x
        out[b, 2] = nvfly.cluster_dim.x


def test_cluster_launch():
    out = poisoned((8, 3), torch.int32)
    cluster_kernel[8, 32, (2, 1, 1)](out)
    assert out[:, 0].tolist() == [0, 1] * 4
    assert out[:, 1].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert out[:, 2].tolist() == [2] * 8


@nvfly.kernel
def slow_producer(x: nvfly.Tensor, out: nvfly.Tensor, rounds: nvfly.i32):
    nvfly.launch_dependents()  # the consumer's blocks may launch now, and must still wait for these writes
    i = nvfly.block_idx.x * 256 + nvfly.thread_idx.x
    v = x[i]
    for _ in range(rounds):
        v = v * 1.0001
    out[i] = v


@nvfly.kernel
def dependent_consumer(inp: nvfly.Tensor, out: nvfly.Tensor):
    i = nvfly.block_idx.x * 256 + nvfly.thread_idx.x
    nvfly.wait_prior_grid()
    out[i] = inp[i] + 1.0


def test_dependent_launch_waits_for_the_previous_kernel():
    """A programmatic dependent launch (``wait_prior_grid``) after a slow kernel that lets it launch at once
    (``launch_dependents``): it reads the producer's writes, never the poison before them, eagerly and replayed
    from a CUDA graph."""
    n = 132 * 4 * 256
    x = torch.randn(n, device="cuda")
    middle, out = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    assert dependent_consumer.compile(middle, out, block=256).dependent

    def pair():
        middle.fill_(float("nan"))
        out.fill_(float("nan"))
        slow_producer[n // 256, 256](x, middle, 2000)
        dependent_consumer[n // 256, 256](middle, out)

    expected = x.clone()
    for _ in range(2000):
        expected = expected * 1.0001
    for _ in range(5):
        pair()
        torch.testing.assert_close(out, expected + 1.0)
    graph = torch.cuda.CUDAGraph()
    pair()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        pair()
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.testing.assert_close(out, expected + 1.0)


@nvfly.kernel
def tma_bytes_kernel(desc: nvfly.TmaDescriptor, out: nvfly.Tensor):
    from nvfly.frontend.tensor import Tensor
    words = Tensor(desc.ptr, nvfly.i64, (16,), (1,), "generic", 64)
    i = nvfly.thread_idx.x
    out[i] = words[i]


def test_tma_descriptor_reaches_the_kernel_by_value():
    t = torch.randn(256, 128, device="cuda").to(torch.bfloat16)
    desc = nvfly.TmaDescriptor(t, (64, 64), swizzle=128)
    out = poisoned((16,), torch.int64)
    tma_bytes_kernel[1, 16](desc, out)
    expected = torch.frombuffer(bytearray(desc.raw), dtype=torch.int64)
    assert torch.equal(out.cpu(), expected)
    k = tma_bytes_kernel.compile(desc, out, block=16)
    assert ".param .align 64 .b8 tma_bytes_kernel_param_0[128]" in k.ptx


@nvfly.kernel
def masked_kernel(x: nvfly.Tensor, out: nvfly.Tensor, n: nvfly.i32):
    i = nvfly.thread_idx.x * 4
    v = x.load(i, width=4, mask=i + 4 <= n, other=-1.0)
    out.store(v, i)


def test_masked_vector_load():
    x = torch.randn(64, device="cuda")
    out = poisoned((64,), torch.float32)
    masked_kernel[1, 16](x, out, 30)
    ref = x.clone()
    ref[28:] = -1.0
    assert torch.equal(out, ref)


_PRINTF = """
import sys; sys.path.insert(0, {root!r})
import torch, nvfly

@nvfly.kernel
def hello(x: nvfly.Tensor):
    i = nvfly.thread_idx.x
    if i < 2:
        nvfly.printf("thread %d value %f\\n", i, x[i])

x = torch.tensor([1.5, 2.5], device="cuda")
hello[1, 32](x)
torch.cuda.synchronize()
"""


def test_device_printf(tmp_path):
    script = tmp_path / "printf_kernel.py"
    script.write_text(_PRINTF.format(root=ROOT))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "thread 0 value 1.500000" in out.stdout and "thread 1 value 2.500000" in out.stdout


_COEXIST = """
import sys; sys.path.insert(0, {root!r})
order = {order!r}
if order == "nvfly-first":
    import nvfly
    from nvfly.examples.vector_add import add
import torch, triton, triton.language as tl
if order == "torch-first":
    import nvfly
    from nvfly.examples.vector_add import add

@triton.jit
def triton_add(x, y, o, n, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(o + i, tl.load(x + i, mask=i < n) + tl.load(y + i, mask=i < n), mask=i < n)

x = torch.randn(10000, device="cuda"); y = torch.randn(10000, device="cuda")
o = torch.empty_like(x)
triton_add[(10,)](x, y, o, 10000, B=1024)
assert torch.equal(o, x + y)
f = torch.compile(lambda a, b: torch.relu(a) * b + 1)
assert torch.allclose(f(x, y), torch.relu(x) * y + 1, atol=1e-5)  # fma vs mul+add near 0
assert torch.equal(add(x, y), x + y)
triton_add[(10,)](y, x, o, 10000, B=1024)
assert torch.equal(o, x + y)
assert torch.allclose(f(y, x), torch.relu(y) * x + 1, atol=1e-5)
print("coexist ok", order)
"""


@pytest.mark.parametrize("order", ["nvfly-first", "torch-first"])
def test_coexistence_with_torch_compile_and_triton(tmp_path, order):
    script = tmp_path / "coexist.py"
    script.write_text(_COEXIST.format(root=ROOT, order=order))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"coexist ok {order}" in out.stdout
