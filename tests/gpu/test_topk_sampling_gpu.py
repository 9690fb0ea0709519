"""TopK's streaming radix kernel and merge on the GPU against the documented order, computed independently of
torch's float sorts: a stable sort of the order keys (the value's bits made monotone: -0.0 below +0.0, NaN above
+inf; inverted when smallest). Random rows, heavy ties, NaN/inf, mixed -0.0/+0.0, sorted rows; k = 1/50/1024/2048,
M = 1/3/64, N = 8 to 152K; the plans with fewer slices than the default (``max_parts``) and the row-threshold plan
(``topk_row``) too, with and without its two-level select."""
import dataclasses

import pytest
import torch

from nvfly.ops import topk
from nvfly.ops.topk import api as topk_api, plans as topk_plans
from nvfly.runtime.torch_args import vector_width
from nvfly.runtime.driver import plan_sm_count

pytestmark = pytest.mark.gpu

BITS = {torch.bfloat16: (torch.int16, 16), torch.float16: (torch.int16, 16), torch.float32: (torch.int32, 32)}


def documented_order(x, k, largest):
    """(indices, values) of the k best elements per row: a stable sort of the order keys."""
    view, width = BITS[x.dtype]
    full = (1 << width) - 1
    bits = x.view(view).long() & full
    keys = bits ^ torch.where(bits >> (width - 1) == 1, full, 1 << (width - 1))
    keys = torch.where(x.isnan(), full, keys)
    if not largest:
        keys = full - keys
    indices = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :k]
    return indices, x.gather(1, indices)


def rows(kind, m, n, dtype):
    if kind == "randn":
        x = torch.randn(m, n, device="cuda")
    elif kind == "ties":  # five values: most of the top k are ties
        x = torch.randint(-2, 3, (m, n), device="cuda").float()
    elif kind == "special":  # NaN, +-inf and mixed zeros among normal values
        x = torch.randn(m, n, device="cuda")
        s = torch.rand(m, n, device="cuda")
        x[s < 0.01] = float("nan")
        x[(s >= 0.01) & (s < 0.02)] = float("inf")
        x[(s >= 0.02) & (s < 0.03)] = -float("inf")
        x[(s >= 0.03) & (s < 0.05)] = 0.0
        x[(s >= 0.05) & (s < 0.07)] = -0.0
    elif kind == "zeros":  # only -0.0 and +0.0
        x = torch.where(torch.rand(m, n, device="cuda") < 0.5, -0.0, 0.0)
    elif kind == "rising":  # every element beats the running threshold
        x = torch.arange(n, device="cuda").float().repeat(m, 1)
    else:  # falling: the first elements are the answer
        x = -torch.arange(n, device="cuda").float().repeat(m, 1)
    return x.to(dtype)


def assert_documented(x, k, largest, values, indices):
    ref_i, ref_v = documented_order(x, k, largest)
    assert torch.equal(indices, ref_i)
    assert torch.equal(values.view(BITS[x.dtype][0]), ref_v.view(BITS[x.dtype][0]))  # bit for bit


SHAPES = [(1, 151936, 50), (1, 128256, 1024), (1, 151936, 2048), (3, 151936, 1024), (64, 128256, 50),
          (64, 151936, 1024), (3, 40_000, 1), (1, 4097, 2048), (3, 1000, 50), (64, 1100, 8), (1, 8, 8),
          (3, 30_001, 33), (64, 5000, 2048), (256, 151936, 1024), (64, 131072, 2048)]


@pytest.mark.sweep
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("kind", ["randn", "ties", "special"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_topk_matches_the_documented_order(m, n, k, kind, dtype):
    x = rows(kind, m, n, dtype)
    for largest in (True, False):
        values, indices = topk.topk(x, k, largest=largest)
        assert_documented(x, k, largest, values, indices)


@pytest.mark.parametrize("m,n,k", [(1, 151936, 1024), (3, 20_000, 50), (64, 151936, 50)])
@pytest.mark.parametrize("kind", ["zeros", "rising", "falling"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_topk_zeros_and_sorted_rows(m, n, k, kind, dtype):
    x = rows(kind, m, n, dtype)
    for largest in (True, False):
        values, indices = topk.topk(x, k, largest=largest)
        assert_documented(x, k, largest, values, indices)


@pytest.mark.parametrize("m,n,k", [(1, 151936, 50), (1, 151936, 1024), (3, 128256, 2048), (64, 151936, 1024)])
def test_topk_plans_with_fewer_slices(m, n, k):
    """The plans ``benchmarks.topk --compare-plans`` times: half the slices and none, same result."""
    x = rows("randn", m, n, torch.bfloat16)
    vec = vector_width(n, (x,), 2)
    sms = plan_sm_count(x.get_device())
    default = topk.plan(n, k, m, vec, 2, sms)
    for max_parts in sorted({topk_plans.MAX_PARTS, max(1, default.parts // 2), 1}):
        run = topk_api.runner(topk.plan(n, k, m, vec, 2, sms, max_parts), m, n, k, True)
        values = torch.full((m, k), float("nan"), dtype=x.dtype, device="cuda")
        indices = torch.full((m, k), -1, dtype=torch.int64, device="cuda")
        run(x, values, indices)
        assert_documented(x, k, True, values, indices)


def test_topk_matches_torch_on_the_sampling_suite():
    """Values equal to torch.topk's and the same indices (k > 32: torch's sort is stable there)."""
    for m, n, k in [(m, n, k) for m in (1, 64, 256) for n in (128256, 151936) for k in (50, 1024)]:
        x = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        values, indices = topk.topk(x, k)
        ref_v, ref_i = torch.topk(x, k)
        assert torch.equal(values, ref_v) and torch.equal(indices, ref_i), (m, n, k)


def row_threshold_topk(x, k, largest, two_level=False, one_launch=False, reversed_select=None,
                       whole_row_histogram=False, exact=None):
    """``topk.plan(..., row_threshold=True)`` run directly (``two_level``: with the opt-in two-level select;
    ``one_launch``: as one cooperative launch; ``reversed_select``: the select launch's slices in reverse order,
    None: as the plan says; ``whole_row_histogram``: the histogram launch in one slice a row; ``exact``: the one
    launch's exact finish, None: as the plan says)."""
    m, n = x.shape
    vec = vector_width(n, (x,), x.element_size())
    p = topk.plan(n, k, m, vec, x.element_size(), plan_sm_count(x.get_device()), row_threshold=True,
                  two_level=two_level, one_launch=one_launch, exact=exact)
    assert p.row_threshold and p.two_level == two_level and p.one_launch == one_launch
    if reversed_select is not None:
        p = dataclasses.replace(p, reversed_select=reversed_select)
    if whole_row_histogram:
        hist_parts, hist_slice_len = topk_plans.whole_sweep_slices(n, p.threads * p.vec, 1)
        p = dataclasses.replace(p, hist_parts=hist_parts, hist_slice_len=hist_slice_len)
    run = topk_api.runner(p, m, n, k, largest)
    values = torch.full((m, k), float("nan"), dtype=x.dtype, device="cuda")
    indices = torch.full((m, k), -1, dtype=torch.int64, device="cuda")
    run(x, values, indices)
    return values, indices


ROW_SHAPES = [(1, 151936, 50), (1, 128256, 1024), (1, 151936, 2048), (3, 151936, 1024), (64, 151936, 1024),
              (64, 128256, 50), (1, 40_000, 1), (3, 30_001, 33), (1, 262144, 1024)]


@pytest.mark.sweep
@pytest.mark.parametrize("m,n,k", ROW_SHAPES)
@pytest.mark.parametrize("kind", ["randn", "ties", "special", "zeros", "rising", "falling"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_threshold_plan_matches_the_documented_order(m, n, k, kind, dtype):
    """Twice in a row on each input: the workspace (histograms, counters) is left clean by every launch."""
    x = rows(kind, m, n, dtype)
    for largest in (True, False, True):
        values, indices = row_threshold_topk(x, k, largest)
        assert_documented(x, k, largest, values, indices)


@pytest.mark.parametrize("m,n,k", [(3, 151936, 1024), (64, 128256, 50), (3, 30_001, 33), (200, 65536, 256)])
@pytest.mark.parametrize("kind", ["randn", "ties", "threshold-ties", "falling"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_many_row_layout_matches_the_documented_order(m, n, k, kind, dtype):
    """The two-launch plan as it runs on many long rows, forced on smaller inputs: the select launch taking the
    slices in reverse order (``topk_plans.REVERSED_SELECT_MIN_BYTES``) and the histogram launch in one slice a row
    (``TopkPlan.hist_parts``): the documented order bit for bit (largest, smallest, largest), the workspace zero
    afterwards."""
    x = threshold_ties(m, n, dtype, k) if kind == "threshold-ties" else rows(kind, m, n, dtype)
    for largest in (True, False, True):
        values, indices = row_threshold_topk(x, k, largest, reversed_select=True, whole_row_histogram=True)
        assert_documented(x, k, largest, values, indices)
    assert_workspace_clean(x.device, m)


ONE_LAUNCH_SHAPES = [(1, 151936, 50), (1, 128256, 1024), (1, 151936, 2048), (1, 40_000, 1), (1, 262144, 1024),
                     (1, 30_001, 33), (2, 65536, 64), (64, 151936, 50), (64, 128256, 1024)]


@pytest.mark.sweep
@pytest.mark.parametrize("m,n,k", ONE_LAUNCH_SHAPES)
@pytest.mark.parametrize("kind", ["randn", "ties", "special", "zeros", "rising", "falling", "threshold-ties"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_launch_plan_matches_the_documented_order(m, n, k, kind, dtype):
    """The histogram and select as one cooperative launch (blocks wait for their row's others between them):
    the documented order bit for bit three times in a row (largest, smallest, largest), the workspace zero
    afterwards."""
    x = threshold_ties(m, n, dtype, k) if kind == "threshold-ties" else rows(kind, m, n, dtype)
    for largest in (True, False, True):
        values, indices = row_threshold_topk(x, k, largest, one_launch=True)
        assert_documented(x, k, largest, values, indices)
    assert_workspace_clean(x.device, m)


@pytest.mark.parametrize("m,n,k", [(1, 151936, 50), (1, 128256, 1024), (2, 65536, 64)])
@pytest.mark.parametrize("kind", ["randn", "ties", "threshold-ties"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_launch_list_path_of_16_bit_keys(m, n, k, kind, dtype):
    """16-bit keys in one launch without the exact finish (``exact=False``: the list path, which the exact plans
    keep for rows whose keys above the k-th's bucket reach far): the documented order, the workspace zero."""
    x = threshold_ties(m, n, dtype, k) if kind == "threshold-ties" else rows(kind, m, n, dtype)
    for largest in (True, False):
        values, indices = row_threshold_topk(x, k, largest, one_launch=True, exact=False)
        assert_documented(x, k, largest, values, indices)
    assert_workspace_clean(x.device, m)


def test_exact_finish_on_far_keys_and_outliers():
    """bf16 rows where the exact finish runs (random rows: ``TopkPlan.exact_stride``) and where it hands over to
    the list (one outlier far above the rest, or the smallest of a rising row: keys beyond EXACT_SPAN buckets of
    the k-th's): the documented order, the same on the next launch, the workspace zero."""
    x = rows("randn", 1, 128256, torch.bfloat16)
    assert topk.plan(128256, 50, 1, 8, 2, plan_sm_count(x.get_device())).exact_stride == 64
    far = x.clone()
    far[0, 1000] = 60000.0
    for row in (x, far, rows("rising", 1, 128256, torch.bfloat16), x):
        for k in (1, 50, 1024):
            for largest in (True, False):
                values, indices = row_threshold_topk(row, k, largest, one_launch=True)
                assert_documented(row, k, largest, values, indices)
    assert_workspace_clean(x.device, 1)


def test_one_launch_plan_beside_other_work():
    """One-launch TopKs on two streams at once, while a large GEMM keeps the SMs busy on a third: every result
    exact (a block that waits for its row's others only waits for SMs that other work frees), workspaces clean."""
    x = torch.randn(1, 151936, device="cuda").to(torch.bfloat16)
    ref = torch.topk(x, 1024)
    a = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    streams = [torch.cuda.Stream() for _ in range(3)]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    results = []
    with torch.cuda.stream(streams[2]):
        for _ in range(3):
            a @ a
    for i in range(16):
        with torch.cuda.stream(streams[i % 2]):
            results.append(row_threshold_topk(x, 1024, True, one_launch=True))
    torch.cuda.synchronize()
    for values, indices in results:
        assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)
    for stream in streams[:2]:
        with torch.cuda.stream(stream):
            assert_workspace_clean(x.device, 1)


def test_default_plan_of_a_sampling_row_is_one_launch():
    """topk.topk of one 151936-wide row runs the one-launch plan (and matches torch.topk)."""
    x = torch.randn(1, 151936, device="cuda").to(torch.bfloat16)
    assert topk.plan(151936, 50, 1, 8, 2, plan_sm_count(x.get_device())).one_launch
    values, indices = topk.topk(x, 50)
    ref = torch.topk(x, 50)
    assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)


def test_row_threshold_plan_matches_torch_on_the_sampling_suite():
    """Values equal to torch.topk's and the same indices; then an all-equal row (the last block streams it)
    and a random one again (the workspace is clean after the stream)."""
    for m, n, k in [(m, n, k) for m in (1, 64) for n in (128256, 151936) for k in (50, 1024)]:
        x = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        values, indices = row_threshold_topk(x, k, True)
        ref_v, ref_i = torch.topk(x, k)
        assert torch.equal(values, ref_v) and torch.equal(indices, ref_i), (m, n, k)
        same = torch.ones(m, n, device="cuda", dtype=torch.bfloat16)
        values, indices = row_threshold_topk(same, k, True)
        assert torch.equal(indices, torch.arange(k, device="cuda").repeat(m, 1)) and bool((values == 1).all())
        values, indices = row_threshold_topk(x, k, True)
        assert torch.equal(values, ref_v) and torch.equal(indices, ref_i), (m, n, k)


# ---------------------------------------------------------------------------------------------- two levels
def assert_workspace_clean(device, m):
    """The row-threshold workspace of the current stream is zero again (lists aside) once the launches are done."""
    torch.cuda.synchronize()
    hist, counters, _, hist2, _ = topk_api.workspace(device, m)
    assert int(hist.abs().sum()) == 0 and int(counters.abs().sum()) == 0 and int(hist2.abs().sum()) == 0


def threshold_ties(m, n, dtype, k):
    """Random rows with a few hundred to thousands of copies of one value near the k-th largest: the two-level
    last block's select over sure + inside (or the stream when the bucket overflows the list)."""
    x = torch.randn(m, n, device="cuda")
    value = torch.sort(x, dim=-1, descending=True).values[:, min(k, n - 1):min(k, n - 1) + 1]
    ties = torch.rand(m, n, device="cuda") < min(0.2, 3 * max(k, 64) / n)
    return torch.where(ties, value, x).to(dtype)


@pytest.mark.sweep
@pytest.mark.parametrize("m,n,k", ROW_SHAPES + [(1, 16384, 2048), (64, 151936, 2048), (3, 262144, 50)])
@pytest.mark.parametrize("kind", ["randn", "ties", "special", "zeros", "rising", "falling", "threshold-ties"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_two_level_plan_matches_the_documented_order(m, n, k, kind, dtype):
    """``plan(..., two_level=True)``, three times in a row on each input (largest, smallest, largest): the
    documented order bit for bit, and the workspace (histograms of both levels, counters) zero afterwards."""
    x = threshold_ties(m, n, dtype, k) if kind == "threshold-ties" else rows(kind, m, n, dtype)
    for largest in (True, False, True):
        values, indices = row_threshold_topk(x, k, largest, two_level=True)
        assert_documented(x, k, largest, values, indices)
    assert_workspace_clean(x.device, m)


@pytest.mark.parametrize("m,n,k", [(1, 151936, 1024), (1, 151936, 50), (1, 128256, 2048), (64, 151936, 1024),
                                   (3, 40_000, 256)])
@pytest.mark.parametrize("kind", ["randn", "special", "threshold-ties", "outlier"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_threshold_counting_finish(m, n, k, kind, dtype):
    """The row-threshold last block's counting finish (values rebuilt from the keys, NaN gathered by index; an
    outlier widens the fine buckets) and its fallback to select + sort (threshold-ties: a crowded fine bucket):
    the documented order bit for bit (largest, smallest, largest) and the workspace zero afterwards."""
    if kind == "threshold-ties":
        x = threshold_ties(m, n, dtype, k)
    elif kind == "outlier":  # one huge value a row: the keys above the threshold span many binades
        x = torch.randn(m, n, device="cuda")
        x[:, n // 3] = 3e4 if dtype == torch.float16 else 1e30
        x = x.to(dtype)
    else:
        x = rows(kind, m, n, dtype)
    for largest in (True, False, True):
        values, indices = row_threshold_topk(x, k, largest)
        assert_documented(x, k, largest, values, indices)
    assert_workspace_clean(x.device, m)


def test_two_level_plan_matches_torch_on_the_sampling_suite():
    """Values equal to torch.topk's and the same indices, bf16 and fp32; then an all-equal row (the last block
    streams it), ties at the threshold, the one-level plan on the same workspace, and the random rows again."""
    for m, n, k in [(m, n, k) for m in (1, 64) for n in (128256, 151936) for k in (50, 1024, 2048)]:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(m, n, device="cuda").to(dtype)
            ref_v, ref_i = torch.topk(x, k)
            values, indices = row_threshold_topk(x, k, True, two_level=True)
            assert torch.equal(values, ref_v) and torch.equal(indices, ref_i), (m, n, k, dtype)
            same = torch.ones(m, n, device="cuda", dtype=dtype)
            values, indices = row_threshold_topk(same, k, True, two_level=True)
            assert torch.equal(indices, torch.arange(k, device="cuda").repeat(m, 1)) and bool((values == 1).all())
            tied = threshold_ties(m, n, dtype, k)
            values, indices = row_threshold_topk(tied, k, True, two_level=True)
            assert_documented(tied, k, True, values, indices)
            values, indices = row_threshold_topk(x, k, True)
            assert torch.equal(values, ref_v) and torch.equal(indices, ref_i), (m, n, k, dtype)
            values, indices = row_threshold_topk(x, k, True, two_level=True)
            assert torch.equal(values, ref_v) and torch.equal(indices, ref_i), (m, n, k, dtype)
            assert_workspace_clean(x.device, m)


def test_two_level_plan_on_two_streams():
    """One workspace per stream: interleaved two-level and one-level (every fourth) launches on two streams stay
    exact, and both streams' workspaces end clean."""
    x = torch.randn(64, 151936, device="cuda").to(torch.bfloat16)
    ref = torch.topk(x, 1024)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    results = []
    for i in range(8):
        with torch.cuda.stream(streams[i % 2]):
            results.append(row_threshold_topk(x, 1024, True, two_level=i % 4 != 3))
    torch.cuda.synchronize()
    for values, indices in results:
        assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)
    for stream in streams:
        with torch.cuda.stream(stream):
            assert_workspace_clean(x.device, 64)


@pytest.mark.parametrize("m,two_level,one_launch", [(3, False, False), (3, True, False), (1, False, True)],
                         ids=["row-threshold", "two-level", "one-launch"])
def test_row_threshold_plan_in_cuda_graph(m, two_level, one_launch):
    """Captured in a CUDA graph, the row-threshold launches own their workspace (nvfly.ops.common.scratch: zero-filled
    by a captured fill): replays after an eager call with more rows, which grows the capture stream's cached
    workspace, still match torch.topk. The one-launch plan's cooperative launch is captured too."""
    n, k = 151936, 1024
    x = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    vec = vector_width(n, (x,), x.element_size())
    p = topk.plan(n, k, m, vec, x.element_size(), plan_sm_count(x.get_device()), row_threshold=True,
                  two_level=two_level, one_launch=one_launch)
    run = topk_api.runner(p, m, n, k, True)
    values = torch.empty((m, k), dtype=x.dtype, device="cuda")
    indices = torch.empty((m, k), dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiled, loaded and launched once before the capture
        run(x, values, indices)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        run(x, values, indices)
    with torch.cuda.stream(stream):  # more rows than the cached workspace holds (topk_api.MIN_ROWS)
        many = torch.randn(2 * topk_api.MIN_ROWS, n, device="cuda").to(torch.bfloat16)
        got, _ = row_threshold_topk(many, k, True, two_level)
        assert torch.equal(got, torch.topk(many, k).values)
    torch.cuda.synchronize()
    for _ in range(2):
        x.copy_(torch.randn_like(x, dtype=torch.float32))
        values.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_v, ref_i = torch.topk(x, k)
        assert torch.equal(values, ref_v) and torch.equal(indices, ref_i)
