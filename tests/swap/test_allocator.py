"""ExtentAllocator: best fit, coalescing, bounded growth, and its errors.

The property tests drive random sequences of allocate/free/reserve against a reference record
of what is live, and after every step check the allocator's whole state (see `check`).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinity.swap import ExtentAllocator, OutOfSpace, round_up

from ._common import sigint_at_line

KiB = 1 << 10
MiB = 1 << 20
A = 4096  # alignment in every test unless said otherwise

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Sizes from 1 B to 64 MiB, with small ones drawn often so that extents collide and coalesce.
sizes = st.one_of(st.integers(1, 64 * KiB), st.integers(1, 64 * MiB))
grow_steps = st.sampled_from([A, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB])


def check(alloc: ExtentAllocator, live: dict[int, int]) -> None:
    """Every invariant of the allocator, against ``live`` (offset -> rounded size)."""
    used = alloc.used_extents()
    free = alloc.free_extents()
    assert used == sorted(live.items())
    # Used and free extents partition [0, capacity): sorted together they tile it exactly,
    # which also rules out any overlap.
    pos = 0
    for offset, nbytes in sorted(used + free):
        assert offset == pos, f"gap or overlap at {pos}: next extent starts at {offset}"
        assert nbytes > 0
        pos = offset + nbytes
    assert pos == alloc.capacity
    for offset, nbytes in used + free:
        assert offset % A == 0 and nbytes % A == 0
    # Coalescing: no two free extents touch.
    for (o1, n1), (o2, _) in zip(free, free[1:]):
        assert o1 + n1 < o2, f"free extents {o1}+{n1} and {o2} are adjacent"
    assert alloc.used_bytes == sum(n for _, n in used)
    assert alloc.free_bytes == sum(n for _, n in free)
    assert alloc.largest_free == max((n for _, n in free), default=0)
    assert alloc.capacity % A == 0


def allocate_checked(alloc: ExtentAllocator, live: dict[int, int], nbytes: int) -> int | None:
    """allocate(nbytes), checking the offset against best fit and any growth against its bound."""
    size = round_up(nbytes, A)
    cap, g = alloc.capacity, alloc.grow_step
    free = alloc.free_extents()
    used_before, n_used = alloc.used_bytes, len(live)
    fitting = [(n, o) for o, n in free if n >= size]
    tail = next((o for o, n in free if o + n == cap), cap)
    try:
        offset = alloc.allocate(nbytes)
    except OutOfSpace:
        # Only when nothing fits and growth is off or would pass max_capacity; nothing changed.
        assert not fitting
        assert g == 0 or (alloc.max_capacity is not None and tail + size > alloc.max_capacity)
        assert alloc.capacity == cap and alloc.free_extents() == free
        return None
    if fitting:
        # Best fit: the smallest free extent that holds it, lowest offset among equals; no growth.
        assert offset == min(fitting)[1]
        assert alloc.capacity == cap
    else:
        # Growth happens only when nothing fits; it extends the tail free extent, and the new
        # capacity is the request's end or one grow_step past the old capacity, whichever is more.
        expected = max(cap + g, tail + size)
        if alloc.max_capacity is not None:
            expected = min(expected, alloc.max_capacity)
        assert offset == tail
        assert alloc.capacity == expected
        # Hence a bound on the whole capacity: before the growth every free extent was smaller
        # than the request, and coalescing leaves at most one more free extent than used ones.
        assert alloc.capacity <= used_before + (n_used + 1) * (size - A) + max(g, size)
    live[offset] = size
    return offset


@FAST
@given(grow_step=grow_steps, limited=st.booleans(), data=st.data())
def test_random_operations_keep_invariants(grow_step, limited, data):
    max_capacity = data.draw(st.integers(1, 512).map(lambda k: k * MiB)) if limited else None
    alloc = ExtentAllocator(A, grow_step=grow_step, max_capacity=max_capacity)
    live: dict[int, int] = {}
    check(alloc, live)
    for _ in range(data.draw(st.integers(1, 60), label="steps")):
        op = data.draw(st.sampled_from(["allocate", "allocate", "free", "reserve"]), label="op")
        if op == "allocate":
            allocate_checked(alloc, live, data.draw(sizes, label="nbytes"))
        elif op == "free" and live:
            offset = data.draw(st.sampled_from(sorted(live)), label="free offset")
            size = live.pop(offset)
            # Any nbytes that rounds to the extent's length names it.
            alloc.free(offset, data.draw(st.integers(size - A + 1, size), label="free nbytes"))
        elif op == "reserve":
            reserve_checked(alloc, live, data)
        check(alloc, live)


def reserve_checked(alloc: ExtentAllocator, live: dict[int, int], data) -> None:
    """reserve a random aligned piece of a free extent, or a range past the end."""
    free = alloc.free_extents()
    if free and data.draw(st.booleans(), label="inside"):
        start, n = data.draw(st.sampled_from(free), label="free extent")
        offset = start + data.draw(st.integers(0, n // A - 1), label="pages in") * A
        size = data.draw(st.integers(1, start + n - offset), label="reserve nbytes")
        if offset + round_up(size, A) > start + n and start + n != alloc.capacity:
            size = start + n - offset  # would run into a used extent: covered by the unit tests
    else:
        offset = alloc.capacity + data.draw(st.integers(0, 16), label="pages past end") * A
        size = data.draw(sizes, label="reserve nbytes")
    cap = alloc.capacity
    end = offset + round_up(size, A)
    if alloc.max_capacity is not None and end > alloc.max_capacity:
        with pytest.raises(OutOfSpace):
            alloc.reserve(offset, size)
        assert alloc.capacity == cap
        return
    alloc.reserve(offset, size)
    assert alloc.capacity == max(cap, end)  # reserve grows exactly to the extent's end
    live[offset] = round_up(size, A)


@FAST
@given(grow_step=grow_steps, nbytes=st.lists(sizes, min_size=1, max_size=30), data=st.data())
def test_rewriting_the_same_sizes_does_not_grow(grow_step, nbytes, data):
    # Round after round of "free everything, allocate the same sizes" (in any order) fits in
    # the capacity the first round made: freeing all coalesces into one extent.
    alloc = ExtentAllocator(A, grow_step=grow_step)
    live: dict[int, int] = {}
    offsets = [allocate_checked(alloc, live, n) for n in nbytes]
    capacity = alloc.capacity
    for _ in range(5):
        for i in data.draw(st.permutations(range(len(nbytes))), label="free order"):
            alloc.free(offsets[i], nbytes[i])
            del live[offsets[i]]
        assert alloc.free_extents() == [(0, capacity)]
        for i in data.draw(st.permutations(range(len(nbytes))), label="allocate order"):
            offsets[i] = allocate_checked(alloc, live, nbytes[i])
        check(alloc, live)
        assert alloc.capacity == capacity


@FAST
@given(grow_step=grow_steps, nbytes=st.lists(sizes, min_size=1, max_size=30), data=st.data())
def test_freeing_and_reallocating_one_at_a_time_does_not_grow(grow_step, nbytes, data):
    # The freed extent (perhaps coalesced, so larger) always holds the same size again.
    alloc = ExtentAllocator(A, grow_step=grow_step)
    live: dict[int, int] = {}
    offsets = [allocate_checked(alloc, live, n) for n in nbytes]
    capacity = alloc.capacity
    for i in data.draw(st.lists(st.integers(0, len(nbytes) - 1), max_size=100), label="rewrites"):
        alloc.free(offsets[i], nbytes[i])
        del live[offsets[i]]
        offsets[i] = allocate_checked(alloc, live, nbytes[i])
        check(alloc, live)
    assert alloc.capacity == capacity


@FAST
@given(nbytes=st.lists(sizes, min_size=1, max_size=30), data=st.data())
def test_reserving_a_used_layout_reproduces_it(nbytes, data):
    # What reopening from a manifest does: reserve every recorded extent, in any order.
    alloc = ExtentAllocator(A, grow_step=1 * MiB)
    live: dict[int, int] = {}
    for n in nbytes:
        allocate_checked(alloc, live, n)
    for offset in data.draw(st.lists(st.sampled_from(sorted(live)), unique=True), label="freed"):
        alloc.free(offset, live.pop(offset))
    reopened = ExtentAllocator(A, grow_step=1 * MiB)
    for offset in data.draw(st.permutations(sorted(live)), label="reserve order"):
        reopened.reserve(offset, live[offset])
    check(reopened, live)
    assert reopened.used_extents() == alloc.used_extents()
    assert reopened.capacity == max((o + n for o, n in live.items()), default=0)


# -- best fit and coalescing -------------------------------------------------------------------


def holes(pages: list[int], gap: int = 1) -> tuple[ExtentAllocator, list[int]]:
    """An allocator whose free extents are ``pages`` pages long, separated by ``gap`` used pages."""
    alloc = ExtentAllocator(A, grow_step=0, capacity=sum(pages) * A + len(pages) * gap * A)
    starts = []
    for n in pages:
        starts.append(alloc.allocate(n * A))
        alloc.allocate(gap * A)
    for start, n in zip(starts, pages):
        alloc.free(start, n * A)
    return alloc, starts


def test_best_fit_takes_the_smallest_extent_that_fits():
    alloc, starts = holes([5, 2, 3, 2])
    assert alloc.allocate(3 * A) == starts[2]
    assert alloc.allocate(4 * A) == starts[0]


def test_best_fit_takes_the_lowest_offset_among_equal_sizes():
    alloc, starts = holes([3, 2, 5, 2])
    assert alloc.allocate(2 * A) == starts[1]
    assert alloc.allocate(1) == starts[3]


def test_allocation_starts_at_the_extent_start_and_leaves_the_rest_free():
    alloc, starts = holes([4])
    assert alloc.allocate(A) == starts[0]
    assert alloc.free_extents() == [(starts[0] + A, 3 * A)]


def test_free_coalesces_with_both_neighbours():
    alloc = ExtentAllocator(A, grow_step=0, capacity=4 * A)
    a, b, c, d = (alloc.allocate(A) for _ in range(4))
    alloc.free(a, A)
    alloc.free(c, A)
    assert alloc.free_extents() == [(a, A), (c, A)]
    alloc.free(b, A)
    assert alloc.free_extents() == [(a, 3 * A)]
    alloc.free(d, A)
    assert alloc.free_extents() == [(0, 4 * A)]
    assert alloc.used_bytes == 0 and alloc.largest_free == 4 * A


def test_lengths_round_up_to_the_alignment():
    alloc = ExtentAllocator(A, grow_step=A)
    assert alloc.round_up(1) == A and alloc.round_up(A) == A and alloc.round_up(A + 1) == 2 * A
    offset = alloc.allocate(A + 1)
    assert alloc.used_extents() == [(offset, 2 * A)]
    alloc.free(offset, 2 * A)  # the rounded length names the same extent


# -- growth ------------------------------------------------------------------------------------


def test_growth_extends_the_free_tail():
    alloc = ExtentAllocator(A, grow_step=A, capacity=2 * A)
    alloc.allocate(A)  # [0, A) used, [A, 2A) free at the end
    assert alloc.allocate(3 * A) == A
    assert alloc.capacity == 4 * A  # the request's end, not 2A + 3A


def test_growth_is_at_least_one_grow_step():
    alloc = ExtentAllocator(A, grow_step=1 * MiB)
    assert alloc.allocate(1) == 0
    assert alloc.capacity == 1 * MiB
    assert alloc.free_extents() == [(A, 1 * MiB - A)]


def test_growth_stops_at_max_capacity():
    alloc = ExtentAllocator(A, grow_step=1 * MiB, max_capacity=1 * MiB + 2 * A)
    alloc.allocate(1 * MiB)
    assert alloc.allocate(A) == 1 * MiB
    assert alloc.capacity == 1 * MiB + 2 * A  # the step is cut to the maximum
    with pytest.raises(OutOfSpace, match="max_capacity=1056768"):
        alloc.allocate(2 * A)


def test_grow_to_adds_free_space_and_never_shrinks():
    alloc = ExtentAllocator(A, grow_step=0)
    alloc.grow_to(2 * A)
    alloc.allocate(A)
    alloc.grow_to(4 * A)
    assert alloc.free_extents() == [(A, 3 * A)]
    with pytest.raises(ValueError, match="below the current capacity"):
        alloc.grow_to(A)
    with pytest.raises(ValueError, match="not a multiple of alignment"):
        alloc.grow_to(5 * A + 1)


def test_reserve_past_the_end_grows_and_leaves_the_gap_free():
    alloc = ExtentAllocator(A, grow_step=0, capacity=A)
    alloc.reserve(3 * A, 2 * A)
    assert alloc.capacity == 5 * A
    assert alloc.free_extents() == [(0, 3 * A)]
    assert alloc.used_extents() == [(3 * A, 2 * A)]


def test_reserve_may_run_from_the_free_tail_past_the_end():
    alloc = ExtentAllocator(A, grow_step=0, capacity=2 * A)
    alloc.allocate(A)
    alloc.reserve(A, 3 * A)
    assert alloc.capacity == 4 * A and alloc.free_extents() == []


# -- errors ------------------------------------------------------------------------------------


def test_out_of_space_without_growth_names_the_figures():
    alloc, _ = holes([2, 3])  # capacity 7 pages, 5 free, largest 3
    with pytest.raises(OutOfSpace) as info:
        alloc.allocate(4 * A)
    message = str(info.value)
    figures = (f"{4 * A} bytes", f"capacity {7 * A}", f"{5 * A} bytes free", f"largest free extent {3 * A}")
    for figure in (*figures, "grow_step=0"):
        assert figure in message
    e = info.value
    assert (e.requested, e.capacity, e.free_bytes, e.largest_free) == (4 * A, 7 * A, 5 * A, 3 * A)
    assert isinstance(e, RuntimeError)


def test_double_free_is_an_error_naming_the_extent():
    alloc = ExtentAllocator(A, grow_step=0, capacity=4 * A)
    offset = alloc.allocate(A)
    alloc.free(offset, A)
    with pytest.raises(ValueError, match=r"free\(offset=0, nbytes=4096\).*double free"):
        alloc.free(offset, A)
    assert alloc.free_extents() == [(0, 4 * A)]


def test_free_of_a_misaligned_offset_is_an_error():
    alloc = ExtentAllocator(A, grow_step=0, capacity=4 * A)
    alloc.allocate(2 * A)
    with pytest.raises(ValueError, match=r"offset=100.*not a multiple of alignment=4096"):
        alloc.free(100, A)


def test_free_out_of_range_is_an_error():
    alloc = ExtentAllocator(A, grow_step=0, capacity=4 * A)
    with pytest.raises(ValueError, match=r"offset=16384.*past capacity=16384"):
        alloc.free(4 * A, A)


def test_free_of_part_of_an_extent_is_an_error():
    alloc = ExtentAllocator(A, grow_step=0, capacity=4 * A)
    offset = alloc.allocate(3 * A)
    with pytest.raises(ValueError, match=f"is {3 * A} bytes, not {A}"):
        alloc.free(offset, A)
    with pytest.raises(ValueError, match=r"inside the extent in use \(0, 12288\)"):
        alloc.free(offset + A, A)
    assert alloc.used_extents() == [(0, 3 * A)]


def test_reserve_over_a_used_extent_is_an_error():
    alloc = ExtentAllocator(A, grow_step=0, capacity=4 * A)
    alloc.allocate(A)
    alloc.allocate(A)
    alloc.free(0, A)  # [0, A) free, [A, 2A) used, [2A, 4A) free
    overlap = r"reserve\(offset=0, nbytes=8192\): overlaps the extent in use \(4096, 4096\)"
    with pytest.raises(ValueError, match=overlap):
        alloc.reserve(0, 2 * A)
    with pytest.raises(ValueError, match=r"overlaps the extent in use \(4096, 4096\)"):
        alloc.reserve(A, A)
    assert alloc.used_extents() == [(A, A)]


@pytest.mark.parametrize("nbytes", [0, -1, 1.5, True])
def test_allocate_needs_a_positive_int(nbytes):
    alloc = ExtentAllocator(A, grow_step=A)
    with pytest.raises(ValueError, match="nbytes"):
        alloc.allocate(nbytes)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alignment=3000), "power of two"),
        (dict(alignment=0), "alignment"),
        (dict(grow_step=1000), "grow_step=1000 is not a multiple"),
        (dict(capacity=100), "capacity=100 is not a multiple"),
        (dict(capacity=2 * A, max_capacity=A), "below"),
        (dict(max_capacity=A + 1), "max_capacity=4097"),
    ],
)
def test_constructor_checks_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExtentAllocator(**kwargs)


def test_a_ctrl_c_at_any_line_of_allocate_or_free_leaves_the_indexes_whole():
    """SIGINT raised at each line the allocator runs (as a Ctrl-C lands between two bytecodes),
    the KeyboardInterrupt caught as a training loop does: the indexes stay in step. Between
    two of their updates it left them apart, and a later allocate handed out an extent that
    overlapped one in use, or raised KeyError/IndexError (an audit helper's sweep)."""
    import random

    import infinity.swap._allocator as module

    def workload(alloc, rng, live, n):
        for _ in range(n):
            if live and rng.random() < 0.5:
                off = rng.choice(sorted(live))
                alloc.free(off, live.pop(off))
            else:
                size = rng.choice([4096, 8192, 12288, 65536])
                live[alloc.allocate(size)] = size

    k, landed = 1, []
    while True:
        rng, alloc, live = random.Random(5), ExtentAllocator(alignment=4096, grow_step=1 << 20), {}
        workload(alloc, rng, live, 40)
        try:
            with sigint_at_line(k, lambda code: code.co_filename == module.__file__) as seen:
                workload(alloc, rng, live, 6)
        except KeyboardInterrupt:
            landed.append(k)
        if seen[0] < k:
            break
        live = dict(alloc.used_extents())  # the one operation interrupted: the allocator's word
        check(alloc, live)
        for _ in range(200):  # and on: no extent handed out twice, no error
            if live and rng.random() < 0.5:
                off = rng.choice(sorted(live))
                alloc.free(off, live.pop(off))
            else:
                assert allocate_checked(alloc, live, rng.choice([4096, 8192, 12288, 65536])) is not None
        k += 1
    assert k > 100 and len(landed) == k - 1  # every line was interrupted, each Ctrl-C delivered
