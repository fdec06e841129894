"""The planner's search is exact for its memory model: DP and merge against brute force."""

import itertools
import random

import pytest

from remat.planner.search import (
    Block,
    Option,
    UnitOptions,
    best_plan,
    chain_frontier,
    cheaper_within,
    evaluate_chain,
    merge_units,
    modelled_peak,
    ordered_peak,
)


def random_chain(rng: random.Random, n: int, host: float = 0.0) -> list[Block]:
    """A chain whose block i reads block i-1's output (storage 100+i-1), saves it and some
    internals, sometimes saves its own output (as a ReLU does), and sometimes reads a
    shared input (storage 0, a skip) that an outside op saves. ``host``: seconds per byte
    over the host link (0: none, no offload)."""
    blocks = []
    for i in range(n):
        inp = {100 + i - 1: rng.randint(1, 50)} if i else {99: rng.randint(1, 50)}
        if rng.random() < 0.3:
            inp[0] = 40
        saved = dict(inp)
        saved.update({1000 + 10 * i + j: rng.randint(1, 80) for j in range(rng.randint(0, 3))})
        out = {100 + i: rng.randint(1, 50)}
        if rng.random() < 0.5:
            saved.update(out)
        sel = {k: v for k, v in saved.items() if k >= 1000 and rng.random() < 0.5}
        t = rng.uniform(0.1, 5)
        blocks.append(Block(saved, sel, inp, out, t, int(t * 100), t * rng.uniform(0, 0.5),
                            int(t * 10), host_seconds_per_byte=host))
    return blocks


def all_plans(n: int, offload: bool = False):
    """Every partition of range(n) into segments, each with every mode it allows
    (``offload`` too where the device has a host link)."""
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                bounds.append((start, i))
                start = i
        bounds.append((start, n))
        choices = [["recompute"] + (["offload"] if offload else [])
                   + (["keep", "selective"] if e - s == 1 else []) for s, e in bounds]
        for modes in itertools.product(*choices):
            yield [(s, e, m) for (s, e), m in zip(bounds, modes, strict=True)]


@pytest.mark.parametrize("seed", range(12))
def test_chain_dp_matches_brute_force(seed):
    """Seeds 6-11 plan for a device with a host link: offload segments too."""
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    host = rng.uniform(0.001, 0.05) if seed >= 6 else 0.0
    blocks = random_chain(rng, n, host)
    free = {0: 40}
    brute = [evaluate_chain(blocks, plan, free) for plan in all_plans(n, host > 0)]
    caps = sorted({o.transient for o in brute})
    for cap in [*caps, None]:
        front = chain_frontier(blocks, cap, free)
        allowed = [o for o in brute if cap is None or o.transient <= cap]
        # every DP option is a real plan with the costs the model gives it
        for opt in front:
            again = evaluate_chain(blocks, opt.segments, free)
            assert (again.kept, again.transient, again.flops) == (
                opt.kept, opt.transient, opt.flops)
            assert again.time == pytest.approx(opt.time)
            assert cap is None or opt.transient <= cap
        # nothing brute force finds is better than the frontier at its memory
        for o in allowed:
            best = min((f.time for f in front if f.kept <= o.kept), default=float("inf"))
            assert best <= o.time + 1e-9, (o, front)
    # and for budgets: the least time whose modelled peak fits equals brute force
    for budget in sorted({o.kept + o.transient for o in brute}):
        expected = min(o.time for o in brute if o.kept + o.transient <= budget)
        found = best_plan({"c": {c: chain_frontier(blocks, c, free) for c in [*caps, None]}},
                          base=0, target=budget)
        assert found is not None
        assert found[0] == pytest.approx(expected)
        assert found[1] <= budget


def test_frontier_is_pareto_and_sorted():
    blocks = random_chain(random.Random(7), 6)
    front = chain_frontier(blocks)
    kept = [o.kept for o in front]
    times = [o.time for o in front]
    assert kept == sorted(kept) and times == sorted(times, reverse=True)
    assert len(set(kept)) == len(kept)
    # keeping everything is the zero-time end, and it is the most memory
    assert front[-1].time == 0 and all(m == "keep" for *_, m in front[-1].segments)


@pytest.mark.parametrize("seed", range(6))
def test_merge_and_best_plan_match_brute_force_across_units(seed):
    rng = random.Random(100 + seed)
    units = {}
    for u in range(3):
        units[f"u{u}"] = [Option(rng.randint(0, 100), rng.randint(0, 60), rng.uniform(0, 5),
                                 0, [(0, 1, f"m{i}")]) for i in range(rng.randint(1, 4))]
    base, release = rng.randint(0, 50), rng.randint(0, 30)
    combos = list(itertools.product(*units.values()))
    for target in range(base, base + 300, 17):
        fits = [c for c in combos if modelled_peak(
            base, sum(o.kept for o in c), max(o.transient for o in c), release) <= target]
        caps = sorted({o.transient for opts in units.values() for o in opts})
        # a unit with no option under a cap cannot be chosen under it (an empty list)
        frontiers = {p: {c: [o for o in opts if o.transient <= c] for c in caps}
                     | {None: opts} for p, opts in units.items()}
        found = best_plan(frontiers, base, target, release=release)
        if not fits:
            assert found is None
            continue
        expected = min(sum(o.time for o in c) for c in fits)
        assert found is not None and found[0] == pytest.approx(expected)
        assert found[1] <= target
    merged = merge_units([UnitOptions(p, o) for p, o in units.items()], limit=10**9)
    assert min(m[1] for m in merged) == pytest.approx(
        min(sum(o.time for o in c) for c in combos))


def test_evaluate_chain_refuses_bad_segments():
    blocks = random_chain(random.Random(1), 3)
    with pytest.raises(ValueError, match="do not partition"):
        evaluate_chain(blocks, [(0, 1, "keep"), (2, 3, "keep")])
    with pytest.raises(ValueError, match="do not cover"):
        evaluate_chain(blocks, [(0, 1, "keep")])
    with pytest.raises(ValueError, match="per block"):
        evaluate_chain(blocks, [(0, 2, "keep"), (2, 3, "keep")])
    with pytest.raises(ValueError, match="unknown mode"):
        evaluate_chain(blocks, [(0, 3, "swap")])
    with pytest.raises(ValueError, match="needs a device with a host link"):
        evaluate_chain(blocks, [(0, 3, "offload")])


def test_offload_keeps_nothing_on_the_device_and_pays_the_copies():
    """An offload segment keeps none of its inputs on the device, brings them back for its
    recompute (transient) and pays two copies of them over the host link."""
    blocks = random_chain(random.Random(3), 3, host=0.01)
    rec = evaluate_chain(blocks, [(0, 1, "keep"), (1, 3, "recompute")])
    off = evaluate_chain(blocks, [(0, 1, "keep"), (1, 3, "offload")])
    inputs = sum(v for k, v in blocks[1].inputs.items() if k not in blocks[0].saved)
    internal = {k: v for b in blocks[1:] for k, v in b.saved.items()}
    assert off.kept == rec.kept - inputs
    assert off.transient == sum((internal | blocks[1].inputs).values())
    assert off.time == pytest.approx(rec.time + 2 * sum(blocks[1].inputs.values()) * 0.01)
    assert off.flops == rec.flops


def test_segments_that_write_their_own_input_in_place_are_never_replayed():
    """Block 1 writes its input (block 0's output) in place, as a chain member
    ``nn.ReLU(inplace=True)`` does: no recompute or selective segment may start at it;
    one that starts before it may hold it. Fixed strategies' segments are joined."""
    from dataclasses import replace

    from remat.planner.search import replayable, replayable_segments

    blocks = random_chain(random.Random(3), 4)
    blocks[1] = replace(blocks[1], mutated={100: blocks[1].inputs[100]})
    assert not replayable(blocks, 1, 2, "recompute") and not replayable(blocks, 1, 3,
                                                                        "recompute")
    assert not replayable(blocks, 1, 2, "selective") and replayable(blocks, 1, 2, "keep")
    assert replayable(blocks, 0, 2, "recompute")
    full = [(i, i + 1, "recompute") for i in range(4)]
    assert replayable_segments(blocks, full) == [(0, 2, "recompute"), (2, 3, "recompute"),
                                                 (3, 4, "recompute")]
    first = [replace(blocks[0], mutated=dict(blocks[0].inputs)), *blocks[1:]]
    assert replayable_segments(first, [(0, 4, "recompute")]) == [(0, 1, "keep"),
                                                                (1, 2, "keep"),
                                                                (2, 4, "recompute")]
    legal = [p for p in all_plans(4) if all(replayable(blocks, *s) for s in p)]
    brute = [evaluate_chain(blocks, p) for p in legal]
    for cap in [*sorted({o.transient for o in brute}), None]:
        front = chain_frontier(blocks, cap)
        assert front and all(replayable(blocks, *s) for o in front for s in o.segments)
        for o in brute:
            if cap is None or o.transient <= cap:
                assert min(f.time for f in front if f.kept <= o.kept) <= o.time + 1e-9


def test_a_writer_with_parameters_keeps_a_copy_of_what_it_writes():
    """A block with parameters that writes its input (``x += self.pos``) does not join the
    segment before it at run time: its segment keeps a copy of the input, taken before the
    write, in place of the input (whose storage is then kept only where another key holds
    it: counted twice, a chain of them modelled 68.4 MiB where the trace peaked 49.5)."""
    from dataclasses import replace

    from remat.planner.search import replayable, replayable_segments, segment_keys

    blocks = random_chain(random.Random(3), 4)
    written = {100: blocks[1].inputs[100]}
    blocks[1] = replace(blocks[1], mutated=written, parameters=True)
    unwritten = [blocks[0], replace(blocks[1], mutated={}), *blocks[2:]]
    for mode in ("recompute", "selective"):
        assert replayable(blocks, 1, 2, mode)
        kept, *_ = segment_keys(blocks, 1, 2, mode)
        plain = segment_keys(unwritten, 1, 2, mode)[0]
        assert 100 in plain and kept == {("copy", 100) if k == 100 else k: v
                                         for k, v in plain.items()}
    assert not replayable(blocks, 1, 2, "offload")  # offload keeps no copies
    full = [(i, i + 1, "recompute") for i in range(4)]
    assert replayable_segments(blocks, full) == full  # no join
    # a block inside a segment that writes the segment's input (through a view an earlier
    # block made): the copy as well, whatever its parameters
    inner = [blocks[0], replace(blocks[1], mutated={}, parameters=False),
             replace(blocks[2], mutated={100: written[100]}), blocks[3]]
    assert replayable(inner, 1, 3, "recompute")
    assert segment_keys(inner, 1, 3, "recompute")[0][("copy", 100)] == written[100]


@pytest.mark.parametrize("seed", range(8))
def test_least_kept_is_the_fewest_bytes_any_plan_keeps_within_the_cap(seed):
    """The floor's DP against brute force: the least kept bytes over every plan whose
    transient fits the cap, the least time among those, and the frontier's first option."""
    from remat.planner.search import least_kept

    rng = random.Random(100 + seed)
    n = rng.randint(1, 6)
    blocks = random_chain(rng, n)
    free = {0: 40}
    brute = [evaluate_chain(blocks, plan, free) for plan in all_plans(n)]
    for cap in [*sorted({o.transient for o in brute}), None]:
        allowed = [o for o in brute if cap is None or o.transient <= cap]
        got = least_kept(blocks, cap, free)
        fewest = min(o.kept for o in allowed)
        assert got.kept == fewest and (cap is None or got.transient <= cap)
        assert got.time == pytest.approx(min(o.time for o in allowed if o.kept == fewest))
        assert evaluate_chain(blocks, got.segments, free).kept == got.kept
        assert chain_frontier(blocks, cap, free)[0].kept == fewest


def test_ordered_peak_frees_later_units_before_an_earlier_recompute():
    early = Option(kept=10, transient=100, time=1.0, flops=1)  # recomputed, runs first
    late = Option(kept=50, transient=0, time=0.0, flops=0)  # kept, runs last
    # the backward recomputes `early` after `late` freed its 50 bytes
    assert ordered_peak(1000, [early, late]) == max(1000 + 60, 1000 + 10 + 100) == 1110
    assert modelled_peak(1000, 60, 100) == 1160  # every recompute beside all that is kept
    # in the other order the recompute meets both
    assert ordered_peak(1000, [late, early], release=5) == 1000 - 5 + 60 + 100


def test_cheaper_within_takes_the_largest_saving_that_stays_within_the_limit():
    recompute = Option(kept=10, transient=40, time=3.0, flops=3)
    keep = Option(kept=40, transient=0, time=0.0, flops=0)
    half = Option(kept=25, transient=20, time=1.0, flops=1)
    current = {"a": recompute, "b": recompute}
    options = {"a": [recompute, half, keep], "b": [recompute, half, keep]}
    start = ordered_peak(0, [recompute, recompute])  # 10 + 10 + 40
    assert start == 60
    # "b" runs last: keeping it costs 30 bytes beside a's kept 10 at the forward's end,
    # below a's recompute with both kept
    got = cheaper_within(current, options, ["a", "b"], 0, start)
    assert got == {"a": recompute, "b": keep}
    assert ordered_peak(0, [got["a"], got["b"]]) <= start
    # below the forward's end of every cheaper choice (50 bytes) nothing changes
    assert cheaper_within(current, options, ["a", "b"], 0, 49) == current
