"""nvfly.ops.common.scratch: per-stream scratch that grows to the largest request, and a graph capture's own tensors."""
from types import SimpleNamespace

import torch

from nvfly.ops.common import scratch


def make(made: list) -> scratch.StreamScratch:
    def allocate(device, sizes):
        made.append(sizes)
        return tuple(torch.zeros(size) for size in sizes)
    return scratch.StreamScratch(allocate, (8, 2))


def test_one_set_per_stream_grown_to_the_largest_request():
    made: list = []
    cache = make(made)
    cpu = torch.device("cpu")
    first = cache.get(cpu, 1, (4, 1))
    assert made == [(8, 2)] and cache.get(cpu, 1, (8, 2)) is first  # the floor covers it: no new allocation
    grown = cache.get(cpu, 1, (20, 1))
    assert made[-1] == (20, 2) and grown is not first and cache.get(cpu, 1, (3, 2)) is grown
    other = cache.get(cpu, 2, (1, 1))  # another stream: its own set
    assert made[-1] == (8, 2) and other is not grown


def test_graph_capture_gets_tensors_of_its_own(monkeypatch):
    """Under capture: exact sizes, nothing cached (a later growth must never free what a graph writes to), and
    the stream's cached set is left as it was."""
    made: list = []
    cache = make(made)
    gpu = SimpleNamespace(type="cuda", index=0)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    eager = cache.get(gpu, 7, (4, 1))
    capturing[0] = True
    captured = cache.get(gpu, 7, (4, 1))
    assert captured is not eager and made[-1] == (4, 1) and cache.get(gpu, 7, (4, 1)) is not captured
    big = cache.get(gpu, 7, (100, 1))
    assert made[-1] == (100, 1) and big is not captured
    capturing[0] = False
    assert cache.get(gpu, 7, (4, 1)) is eager


def test_zeroed_views_share_one_fill_and_start_aligned():
    a, b, c = scratch.zeroed_i32(torch.device("cpu"), (5, 3, 8))
    assert [t.numel() for t in (a, b, c)] == [5, 3, 8] and all(t.data_ptr() % 16 == 0 for t in (a, b, c))
    assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
    assert not any(t.any() for t in (a, b, c))
    sums, counters = scratch.workspace(torch.device("cpu"), 0, 3, 10)
    assert sums.dtype == torch.float32 and sums.numel() >= 30 and counters.numel() >= 3
    assert not sums.any() and not counters.any()


def test_views_are_kept_until_the_tensors_grow(monkeypatch):
    """``view``: made once per request size and handed out again while the tensors stand; a growth makes new
    views of the new tensors; under capture a fresh view of fresh tensors every time."""
    made: list = []
    views: list = []
    cache = make(made)
    cpu = torch.device("cpu")

    def first(tensors, sizes):
        views.append(sizes)
        return tuple(t[:size] for t, size in zip(tensors, sizes))
    small = cache.get(cpu, 1, (4, 1), first)
    assert [t.numel() for t in small] == [4, 1] and cache.get(cpu, 1, (4, 1), first) is small and views == [(4, 1)]
    other = cache.get(cpu, 1, (6, 2), first)
    assert [t.numel() for t in other] == [6, 2] and len(views) == 2
    assert other[0].data_ptr() == small[0].data_ptr()  # views of the same tensors
    grown = cache.get(cpu, 1, (30, 1), first)
    again = cache.get(cpu, 1, (4, 1), first)
    assert made[-1] == (30, 2) and again is not small and again[0].data_ptr() == grown[0].data_ptr()
    gpu = SimpleNamespace(type="cuda", index=0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    one, two = cache.get(gpu, 1, (4, 1), first), cache.get(gpu, 1, (4, 1), first)
    assert one is not two and made[-2:] == [(4, 1), (4, 1)]


def test_views_kept_per_stream_are_bounded(monkeypatch):
    monkeypatch.setattr(scratch, "MAX_VIEWS", 2)
    cache = make([])
    cpu = torch.device("cpu")
    calls: list = []

    def view(tensors, sizes):
        calls.append(sizes)
        return tensors[0][:sizes[0]]
    kept = cache.get(cpu, 1, (1, 1), view)
    cache.get(cpu, 1, (2, 1), view)
    cache.get(cpu, 1, (3, 1), view)  # a third size: the kept views are dropped first
    assert cache.get(cpu, 1, (1, 1), view) is not kept and calls == [(1, 1), (2, 1), (3, 1), (1, 1)]


def test_tensors_in_a_private_pool_are_not_kept(monkeypatch):
    """Tensors that land in a private memory pool outside capture (cudagraph trees' warm-up run routes the thread's
    allocations to the graph's pool, then requires every live block there to be an output) serve that call only:
    nothing cached, dead once the caller drops them, and the stream's set is made again once the pool is left."""
    import gc
    import weakref
    made: list = []
    cache = make(made)
    cpu = torch.device("cpu")
    pooled = [True]
    monkeypatch.setattr(scratch, "in_private_pool", lambda tensors: pooled[0])
    first = cache.get(cpu, 3, (4, 1))
    dead = [weakref.ref(t) for t in first]
    viewed = cache.get(cpu, 3, (4, 1), lambda tensors, sizes: tensors[0][:sizes[0]])
    dead.append(weakref.ref(viewed._base))
    assert made == [(8, 2), (8, 2)] and cache.get(cpu, 3, (4, 1)) is not first
    del first, viewed
    gc.collect()
    assert not [ref for ref in dead if ref() is not None]
    pooled[0] = False
    kept = cache.get(cpu, 3, (4, 1))
    assert cache.get(cpu, 3, (4, 1)) is kept


def test_in_private_pool_is_false_off_cuda():
    assert not scratch.in_private_pool(torch.zeros(4)) and not scratch.in_private_pool((torch.zeros(2), None))


def test_int32_tables_are_stream_scratch_views():
    """int32_tables: contiguous views of one buffer per (device, stream), each 16-byte aligned, the same views on
    the next call; another stream or a larger request gets its own."""
    shapes = ((2, 3, 5), (2, 2, 7), (2, 2))
    cpu = torch.device("cpu")
    tables = scratch.int32_tables(cpu, 12345, shapes)
    assert [tuple(t.shape) for t in tables] == list(shapes) and all(t.dtype == torch.int32 for t in tables)
    assert all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tables)
    starts = [t.data_ptr() for t in tables]
    assert starts[1] - starts[0] >= 30 * 4 and starts[2] - starts[1] >= 28 * 4  # disjoint
    again = scratch.int32_tables(cpu, 12345, shapes)
    assert all(a is b for a, b in zip(tables, again))
    assert scratch.int32_tables(cpu, 54321, shapes)[0].data_ptr() != starts[0]
    (big,) = scratch.int32_tables(cpu, 12345, ((200, 100),))  # past the first allocation: the buffer grows
    assert big.shape == (200, 100) and scratch.int32_tables(cpu, 12345, shapes)[0] is not tables[0]
