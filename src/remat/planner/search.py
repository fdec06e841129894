"""Search: which blocks to keep, recompute (in which segments) or recompute selectively.

Memory model of a plan (bytes), Chen et al. 2016 (arXiv 1604.06174, sec. 4) generalised to
heterogeneous blocks and mixed modes as in rotor (Beaumont et al. 2019, arXiv 1911.13214):
a unit's *kept* bytes are what stays alive from its forward to its backward, and its
*transient* bytes what a recompute materialises again; the plan's peak is modelled as the
higher of the forward's end, ``base + sum(kept)``, and the backward's worst recompute,
``base - release + sum(kept) + max(transient)`` (``base``: everything outside the
candidates; ``release``: what is freed in between, :func:`modelled_peak`). The trace, not
this sum, decides in the end (see :mod:`remat.planner`).

Per segment ``s`` of a chain, in mode

- ``keep`` (one block): kept = the tensors its ops save, transient 0, time 0;
- ``recompute`` (blocks ``[start, end)``): kept = its inputs from outside the segment,
  transient = what its blocks save, time = their forward time;
- ``selective`` (one block, matmul preset): kept = its inputs and the outputs of its
  matmul/convolution/SDPA ops it saves, transient = the rest of what it saves, time = the
  forward time of its other ops;
- ``offload`` (blocks ``[start, end)``, a GPU with a host link only): a ``recompute``
  segment whose inputs are moved to host memory after the forward and back before the
  recompute (the ``offload`` strategy's boundary hooks): kept = nothing on the device,
  transient = what its blocks save and its inputs, time = their forward time and the two
  copies of its inputs over the host link (not overlapped with compute: an upper bound).

Kept tensors are counted by storage, once per pair of neighbouring segments (a kept block's
saved output that is also the next segment's input counts once) and not at all when an op
outside every candidate saves them anyway.

:func:`chain_frontier` is an exact dynamic program over (position, last segment) for the
Pareto set of (kept, time) of one chain under a transient cap; :func:`best_plan` combines
the units' Pareto sets (an exact merge, rounded to a byte granularity) for each cap.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

MODES = ("keep", "recompute", "selective", "offload")
#: Modes that recompute a segment of any length from its inputs.
SEGMENT_MODES = ("recompute", "offload")


@dataclass(frozen=True)
class Block:
    """The costs of one block the search needs (bytes, s, FLOPs); see
    :class:`remat.planner.profile.BlockCost`. ``host_seconds_per_byte``: time to move one
    byte over the device's host link (``1 / host_bandwidth``), 0 where the device has
    none (no ``offload`` segment then)."""

    saved: dict
    selective_saved: dict
    inputs: dict
    outputs: dict
    time: float
    flops: int
    selective_time: float
    selective_flops: int
    mutated: dict = field(default_factory=dict)
    host_seconds_per_byte: float = 0.0
    parameters: bool = False


@dataclass
class Option:
    """One way to run a unit: ``segments`` ``[(start, end, mode), ...]`` partitioning its
    blocks; kept and transient bytes, recompute time (s) and FLOPs."""

    kept: int
    transient: int
    time: float
    flops: int
    segments: list[tuple[int, int, str]] = field(default_factory=list)


def _bytes(keys: dict) -> int:
    return sum(keys.values())


def _segment_inputs(blocks: Sequence[Block], start: int, end: int) -> dict:
    """Storage key -> bytes of what blocks ``[start, end)`` read from outside them."""
    produced: dict = {}
    inputs: dict = {}
    for b in blocks[start:end]:
        inputs.update({k: v for k, v in b.inputs.items() if k not in produced})
        produced.update(b.outputs)
    return inputs


def segment_keys(blocks: Sequence[Block], start: int, end: int, mode: str
                 ) -> tuple[dict, int, float, int]:
    """``(kept storages, transient bytes, time, FLOPs)`` of one segment in ``mode``.

    Raises:
        ValueError: unknown mode, ``keep``/``selective`` over more than one block, or
            ``offload`` on blocks without a host link (``host_seconds_per_byte`` 0).
    """
    if mode not in MODES:
        raise ValueError(f"planner: unknown mode {mode!r}; valid: {', '.join(MODES)}")
    if mode not in SEGMENT_MODES and end - start != 1:
        raise ValueError(f"planner: mode {mode!r} is per block, got blocks [{start}, {end})")
    if mode == "keep":
        return dict(blocks[start].saved), 0, 0.0, 0
    inputs = _segment_inputs(blocks, start, end)
    if mode != "offload":  # the checkpoint keeps the copy in place of the written input,
        # whose storage lives on only where something else holds it (another key)
        copied = _copied(blocks[start:end], inputs)
        inputs = {(("copy", k) if k in copied else k): v for k, v in inputs.items()}
    if mode == "selective":
        b = blocks[start]
        kept = inputs | b.selective_saved
        rest = {k: v for k, v in b.saved.items() if k not in b.selective_saved}
        return kept, _bytes(rest), b.selective_time, b.selective_flops
    internal: dict = {}
    for b in blocks[start:end]:
        internal.update(b.saved)
    time = sum(b.time for b in blocks[start:end])
    flops = sum(b.flops for b in blocks[start:end])
    if mode == "offload":  # the inputs leave the device and come back for the recompute
        if blocks[start].host_seconds_per_byte <= 0:
            raise ValueError("planner: mode 'offload' needs a device with a host link "
                             "(its host_bandwidth); this one has none")
        moved = 2 * _bytes(inputs) * blocks[start].host_seconds_per_byte
        return {}, _bytes(internal | inputs), time + moved, flops
    return inputs, _bytes(internal), time, flops


def _copied(segment: Sequence[Block], inputs: dict) -> dict:
    """Storage key -> bytes of the segment's ``inputs`` (:func:`_segment_inputs`) that its
    blocks write in place: remat's recompute keeps a copy of each, taken just before the
    write, in place of the input (the replay starts from it)."""
    return {k: inputs[k] for b in segment for k in b.mutated if k in inputs}


def replayable(blocks: Sequence[Block], start: int, end: int, mode: str) -> bool:
    """Whether blocks ``[start, end)`` may run in ``mode`` as they are: a segment whose first
    block writes one of the segment's inputs in place and has no parameters (an in-place
    activation) joins the segment before it at run time instead (remat's recompute keeps a
    copy of what any other block writes: :func:`_copied`); ``offload`` keeps no copies."""
    if mode == "keep":
        return True
    inputs = _segment_inputs(blocks, start, end)
    if mode == "offload":
        return not _copied(blocks[start:end], inputs)
    first = blocks[start]
    return first.parameters or not any(k in inputs for k in first.mutated)


def replayable_segments(blocks: Sequence[Block], segments: Sequence[tuple[int, int, str]]
                        ) -> list[tuple[int, int, str]]:
    """``segments`` with each segment that may not replay (:func:`replayable`) joined to
    the recompute (or offload) segment before it, or, with none before it, its first
    block kept and the rest tried again: what a fixed strategy's segments become on a
    chain with in-place blocks."""
    out: list[tuple[int, int, str]] = []
    todo = list(segments)
    while todo:
        start, end, mode = todo.pop(0)
        if replayable(blocks, start, end, mode):
            out.append((start, end, mode))
        elif out and out[-1][2] in SEGMENT_MODES and replayable(blocks, out[-1][0], end,
                                                                out[-1][2]):
            out[-1] = (out[-1][0], end, out[-1][2])
        else:
            out.append((start, start + 1, "keep"))
            if end > start + 1:
                todo.insert(0, (start + 1, end, mode))
    return out


def evaluate_chain(blocks: Sequence[Block], segments: Sequence[tuple[int, int, str]],
                   free: dict | None = None) -> Option:
    """Kept, transient, time and FLOPs of one plan of a chain under the memory model above.

    Raises:
        ValueError: segments that do not partition the chain in order, or a bad mode.
    """
    free = free or {}
    pos, kept, transient, time, flops, prev = 0, 0, 0, 0.0, 0, {}
    for start, end, mode in segments:
        if start != pos or end <= start:
            raise ValueError(f"planner: segments {list(segments)} do not partition "
                             f"{len(blocks)} blocks in order")
        keys, trans, t, f = segment_keys(blocks, start, end, mode)
        kept += sum(v for k, v in keys.items() if k not in prev and k not in free)
        transient, time, flops, prev, pos = max(transient, trans), time + t, flops + f, keys, end
    if pos != len(blocks):
        raise ValueError(f"planner: segments {list(segments)} do not cover {len(blocks)} "
                         "blocks")
    return Option(kept, transient, time, flops, list(segments))


#: A partial plan in :func:`chain_frontier`: ``(kept, time, flops, transient, segment,
#: previous label or None)``; the segments are read back along the previous labels, so a
#: label costs no copy of its plan.
_Label = tuple

_BY_KEPT_TIME = operator.itemgetter(0, 1, 2)


def _pareto_labels(labels: list[_Label]) -> list[_Label]:
    """Labels not dominated in (kept, time), sorted by kept (ties: time, FLOPs)."""
    out: list[_Label] = []
    labels.sort(key=_BY_KEPT_TIME)
    for lab in labels:
        if not out or lab[1] < out[-1][1] - 1e-15:
            out.append(lab)
    return out


def _option_of(label: _Label) -> Option:
    segments = []
    node = label
    while node is not None:
        segments.append(node[4])
        node = node[5]
    return Option(label[0], label[3], label[1], label[2], segments[::-1])


def chain_frontier(blocks: Sequence[Block], cap: int | None = None, free: dict | None = None,
                   max_segment: int | None = None, modes: Sequence[str] = MODES
                   ) -> list[Option]:
    """Every Pareto-optimal plan of one chain in (kept bytes, recompute time) whose
    transient bytes stay <= ``cap`` (``None``: no cap), by dynamic programming over states
    (end of the last segment, last segment); exact for the memory model above (tested
    against brute force).

    Args:
        blocks: the chain's blocks in order.
        cap: largest transient bytes allowed (one segment's recompute).
        free: storages that cost nothing to keep (saved anyway outside the candidates).
        max_segment: longest recompute segment (blocks); ``None``: the whole chain.
        modes: the modes allowed.

    Returns:
        Options sorted by kept bytes (increasing), recompute time decreasing.
    """
    n = len(blocks)
    if n == 0:
        return [Option(0, 0, 0.0, 0, [])]
    segs = _segments(blocks, cap, free or {}, max_segment, modes)
    # labels[(seg)] = Pareto labels of prefixes ending with segment seg
    labels: dict[tuple[int, int, str], list[_Label]] = {}
    by_start: dict[int, list[tuple[int, int, str]]] = {}
    by_end: dict[int, list[tuple[int, int, str]]] = {}
    for seg in segs:
        by_start.setdefault(seg[0], []).append(seg)
    for seg in by_start.get(0, []):
        keys, trans, t, f = segs[seg]
        labels[seg] = [(_bytes(keys), t, f, trans, seg, None)]
        by_end.setdefault(seg[1], []).append(seg)
    for pos in range(1, n):
        ending = by_end.get(pos, [])
        for nxt in by_start.get(pos, []):
            keys, trans, t, f = segs[nxt]
            cands: list[_Label] = []
            for prev in ending:
                prev_keys = segs[prev][0]
                add = sum(v for k, v in keys.items() if k not in prev_keys)
                cands.extend((lab[0] + add, lab[1] + t, lab[2] + f,
                              lab[3] if lab[3] >= trans else trans, nxt, lab)
                             for lab in labels[prev])
            if cands:
                labels[nxt] = _pareto_labels(cands)
                by_end.setdefault(nxt[1], []).append(nxt)
    final = [lab for seg in by_end.get(n, []) for lab in labels[seg]]
    return [_option_of(lab) for lab in _pareto_labels(final)]


def _segments(blocks: Sequence[Block], cap: int | None, free: dict, max_segment: int | None,
              modes: Sequence[str]) -> dict[tuple[int, int, str], tuple[dict, int, float, int]]:
    """Every replayable segment ``(start, end, mode)`` whose transient bytes are <=
    ``cap``, with its kept storages (less ``free``), transient bytes, time and FLOPs."""
    n = len(blocks)
    longest = n if max_segment is None else max(1, min(n, max_segment))
    segs: dict[tuple[int, int, str], tuple[dict, int, float, int]] = {}
    for start in range(n):
        for mode in modes:
            if mode == "offload" and blocks[start].host_seconds_per_byte <= 0:
                continue  # no host link
            ends = (range(start + 1, min(n, start + longest) + 1) if mode in SEGMENT_MODES
                    else (start + 1,))
            for end in ends:
                if not replayable(blocks, start, end, mode):
                    continue
                keys, trans, t, f = segment_keys(blocks, start, end, mode)
                if cap is None or trans <= cap:
                    segs[(start, end, mode)] = ({k: v for k, v in keys.items()
                                                 if k not in free}, trans, t, f)
    return segs


def least_kept(blocks: Sequence[Block], cap: int | None, free: dict | None = None,
               max_segment: int | None = None, modes: Sequence[str] = MODES) -> Option:
    """The plan of one chain that keeps the fewest bytes with transient bytes <= ``cap``
    (ties: least time), by the same dynamic program as :func:`chain_frontier` with one
    label per state: the first option of ``chain_frontier(blocks, cap, ...)`` at a fraction
    of its cost (gpt_medium's 24 blocks: 26 caps in 2.4 s with the frontier). Keeping every
    block has transient 0, so an option always exists."""
    n = len(blocks)
    if n == 0:
        return Option(0, 0, 0.0, 0, [])
    segs = _segments(blocks, cap, free or {}, max_segment, modes)
    best: dict[tuple[int, int, str], Option] = {}
    for seg in sorted(segs):  # by start: every predecessor of a segment comes first
        keys, trans, t, f = segs[seg]
        if seg[0] == 0:
            best[seg] = Option(_bytes(keys), trans, t, f, [seg])
            continue
        cands = []
        for prev, opt in best.items():
            if prev[1] == seg[0]:
                add = sum(v for k, v in keys.items() if k not in segs[prev][0])
                cands.append(Option(opt.kept + add, max(opt.transient, trans), opt.time + t,
                                    opt.flops + f, [*opt.segments, seg]))
        if cands:
            best[seg] = min(cands, key=lambda o: (o.kept, o.time))
    return min((o for s, o in best.items() if s[1] == n), key=lambda o: (o.kept, o.time))


@dataclass
class UnitOptions:
    """The options of one unit (by its path) for one transient cap."""

    path: str
    options: list[Option]


def merge_units(units: Sequence[UnitOptions], limit: int, granularity: int = 1
                ) -> list[tuple[int, float, int, dict[str, Option]]]:
    """Exact Pareto merge of the units' options: ``(sum kept, sum time, sum FLOPs, choice)``
    with ``sum kept <= limit``, kept rounded up to ``granularity`` bytes for pruning."""
    front: list[tuple[int, float, int, dict[str, Option]]] = [(0, 0.0, 0, {})]
    g = max(1, int(granularity))
    for unit in units:
        merged = []
        for kept, time, flops, choice in front:
            for opt in unit.options:
                k = kept + opt.kept
                if k <= limit:
                    merged.append((k, time + opt.time, flops + opt.flops,
                                   {**choice, unit.path: opt}))
        merged.sort(key=lambda x: (-(-x[0] // g), x[1]))
        front = []
        for item in merged:
            if not front or item[1] < front[-1][1] - 1e-15:
                front.append(item)
        if not front:
            return []
    return front


def modelled_peak(base: int, kept: int, transient: int, release: int = 0) -> int:
    """The modelled peak: the end of the forward (``base + kept``) or a recompute in the
    backward (``base - release + kept + transient``), whichever is higher; ``release`` is
    what is freed between them (the previous step's gradients, which Lightning's
    ``zero_grad`` after the forward frees)."""
    return max(base + kept, base - release + kept + transient)


def ordered_peak(base: int, options: Sequence[Option], release: int = 0) -> int:
    """The modelled peak with the units in forward order (``options[0]`` runs first): the
    end of the forward, ``base + sum(kept)``, or unit ``i``'s recompute in the backward,
    ``base - release + sum(kept[:i + 1]) + transient[i]``: the backward reaches unit ``i``
    after every later unit has freed what it kept (Chen et al. 2016, arXiv 1604.06174,
    sec. 4.1: a segment's recompute meets the checkpoints before it only).
    :func:`modelled_peak` charges every unit's recompute with everything kept, so it
    prices a late unit's ``keep`` above an early unit's ``recompute`` although the
    backward never holds both."""
    peak = base + sum(o.kept for o in options)
    prefix = 0
    for option in options:
        prefix += option.kept
        peak = max(peak, base - release + prefix + option.transient)
    return peak


def cheaper_within(current: dict[str, Option], candidates: dict[str, list[Option]],
                   order: Sequence[str], base: int, limit: int, release: int = 0
                   ) -> dict[str, Option]:
    """Lower the recompute of ``current`` (unit path -> option) one unit at a time, each
    time the change that saves the most ``time`` (the objective) of those keeping
    :func:`ordered_peak` (units in ``order``) within ``limit`` bytes, until none does; a
    greedy descent, not an optimum. Returns the new choice (``current`` if none)."""
    choice = dict(current)
    while True:
        best: tuple[float, str, Option] | None = None
        for path, options in candidates.items():
            for option in options:
                gain = choice[path].time - option.time
                if gain <= 1e-15 or (best is not None and gain <= best[0]):
                    continue
                trial = {**choice, path: option}
                if ordered_peak(base, [trial[q] for q in order], release) <= limit:
                    best = (gain, path, option)
        if best is None:
            return choice
        choice[best[1]] = best[2]


def best_plan(frontiers: dict[str, dict[int | None, list[Option]]], base: int, target: int,
              granularity: int = 1, release: int = 0
              ) -> tuple[float, int, dict[str, Option]] | None:
    """The choice of one option per unit with the least recompute time whose
    :func:`modelled_peak` is <= ``target``.

    Args:
        frontiers: unit path -> cap -> Pareto options under that cap (``None``: no cap);
            every unit has the same caps.
        base: modelled bytes outside the units at the end of the forward.
        target: the modelled peak allowed (bytes).
        release: bytes freed between the forward's end and the backward.

    Returns:
        ``(time, modelled peak, {path: option})`` or ``None`` if no choice fits.
    """
    caps = sorted({c for f in frontiers.values() for c in f if c is not None})
    best: tuple[float, int, dict[str, Option]] | None = None
    for cap in [*caps, None]:
        units = [UnitOptions(path, by_cap[cap]) for path, by_cap in frontiers.items()]
        limit = target - base
        if cap is not None:
            limit = min(limit, target - base + release - cap)
        if limit < 0:
            continue
        front = merge_units(units, limit, granularity)
        for kept, time, _flops, choice in front:
            transient = max((o.transient for o in choice.values()), default=0)
            if cap is not None and transient > cap:
                continue
            peak = modelled_peak(base, kept, transient, release)
            if peak > target:
                continue
            if best is None or time < best[0] - 1e-15 or (
                    abs(time - best[0]) <= 1e-15 and peak < best[1]):
                best = (time, peak, choice)
    return best


def cap_values(transients: Iterable[int], count: int = 16) -> list[int]:
    """Up to ``count`` caps spread over the distinct transient sizes (always the smallest
    and largest)."""
    values = sorted(set(int(v) for v in transients))
    if len(values) <= count:
        return values
    step = (len(values) - 1) / (count - 1)
    return sorted({values[round(i * step)] for i in range(count)})


def describe(option: Option) -> str:
    """``keep 0, recompute 1-3, selective 4`` for logs."""
    parts = []
    for start, end, mode in option.segments:
        parts.append(f"{mode} {start}" if end - start == 1 else f"{mode} {start}-{end - 1}")
    return ", ".join(parts)


def to_block(cost: Any, objective: str = "time", host_bandwidth: float = 0.0) -> Block:
    """A :class:`Block` from a :class:`~remat.planner.profile.BlockCost`; with
    ``objective="flops"`` its ``time`` fields hold FLOPs (the search minimises those) and
    there is no ``offload`` (it adds no FLOPs, only host copies, which FLOPs cannot weigh);
    ``host_bandwidth`` (bytes/s, 0: none) prices ``offload`` under ``objective="time"``."""
    mutated = dict(cost.mutated)
    if objective == "flops":
        return Block(cost.saved, cost.selective_saved, cost.inputs, cost.outputs,
                     float(cost.flops), cost.flops, float(cost.selective_flops),
                     cost.selective_flops, mutated, parameters=cost.parameters)
    per_byte = 1.0 / host_bandwidth if host_bandwidth > 0 else 0.0
    return Block(cost.saved, cost.selective_saved, cost.inputs, cost.outputs, cost.time,
                 cost.flops, cost.selective_time, cost.selective_flops, mutated, per_byte,
                 cost.parameters)
