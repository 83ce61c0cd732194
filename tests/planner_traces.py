"""Random traces (a hypothesis strategy) and an exhaustive DSA solver, shared by the planner tests."""

import itertools

from hypothesis import strategies as st

from hf_memo.planner.lifetimes import Trace


@st.composite
def traces(draw, max_tensors=40, sizes=(1, 2, 3, 5, 8, 13)):
    """A random well-formed trace: mallocs and frees interleaved, frees in any order, some never freed."""
    count = draw(st.integers(1, max_tensors))
    events, live, next_id = [], [], 0
    while next_id < count or live:
        if next_id < count and (not live or draw(st.booleans())):
            size = draw(st.sampled_from(sizes))
            events.append(("malloc", next_id, size))
            live.append((next_id, size))
            next_id += 1
        else:
            if next_id == count and draw(st.integers(0, 9)) == 0:
                break  # the rest live to the end
            tensor_id, size = live.pop(draw(st.integers(0, len(live) - 1)))
            events.append(("free", tensor_id, size))
    return Trace.from_events(events)


def brute_force_optimum(trace: Trace) -> int:
    """The optimal peak by exhaustion: some order of first-fit placements reaches the optimum.

    (Sorting an optimal placement by offset and placing tensors in that order at their lowest
    feasible offset never puts one higher than before, so the best first-fit order is optimal.)
    """
    lives = trace.lifetimes
    best = None
    for order in itertools.permutations(range(len(lives))):
        placed = []
        for i in order:
            a = lives[i]
            for offset in sorted({0} | {o + lives[j].size for j, o in placed}):
                clash = any(
                    a.start < lives[j].end
                    and lives[j].start < a.end
                    and offset < o + lives[j].size
                    and o < offset + a.size
                    for j, o in placed
                )
                if not clash:
                    placed.append((i, offset))
                    break
        peak = max(o + lives[j].size for j, o in placed)
        best = peak if best is None else min(best, peak)
    return best
