"""The largest model of a family that fits N devices: a factory parameter (such as the number
of layers) searched, each size built on the meta device and asked whether any plan fits
(fxpipe.planner), the largest then planned in full.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from fxpipe.planner import Candidate, Plan, PlanError, Planning, planning
from fxpipe.units import byte_size, human_bytes

__all__ = ["Build", "largest_that_fits"]


Build = Callable[[int], tuple[Any, ...]]
"""size -> (model, example_inputs) or (model, example_inputs, example_kwargs)."""


def largest_that_fits(build: Build, *, devices: int, memory_per_device: float | str,
                      low: int = 1, high: int = 1 << 16, guess: int | None = None,
                      on_meta: bool = True, say: Callable[[str], None] | None = None,
                      **plan_kwargs: Any) -> tuple[int, Plan]:
    """The largest size (a factory parameter that grows the model, such as its number of
    layers) whose model fits `devices` devices of `memory_per_device`, and its plan.

    What fits is taken as monotone in the size. Without a `guess`, sizes are tried doubling
    from `low`; with one (say, the answer for fewer devices scaled by the devices), from the
    guess up or down in steps that double from a 128th of it. Then bisection between the
    largest that fit and the smallest that did not. With `on_meta` each model is built on the
    meta device and checked by shapes, so no size needs its weights in memory. Each size is
    asked only whether some candidate fits (Planning.plan(any_fit=True)); the largest is then
    planned in full on the graph its question captured.

    Raises:
        PlanError: not even `low` fits.
    """
    limit = byte_size(memory_per_device, "memory_per_device")
    tried: dict[int, bool] = {}
    kept: dict[int, Planning] = {}  # the largest size that fit, captured

    def fits(size: int) -> bool:
        if size not in tried:
            with torch.device("meta") if on_meta else contextlib.nullcontext():
                made = build(size)
            model, inputs = made[0], made[1]
            kwargs = made[2] if len(made) > 2 else None
            graph = planning(model, inputs, kwargs, devices=devices,
                             memory_per_device=limit,
                             check="shapes" if on_meta else None, **plan_kwargs)
            try:
                result: Plan | None = graph.plan(any_fit=True)
            except PlanError:
                result = None
            tried[size] = result is not None
            if result is not None and all(size > s for s in kept):
                kept.clear()
                kept[size] = graph
            if say is not None:
                say(f"size {size}: " + (f"fits ({_key(result.choice)})"
                                        if result is not None else "does not fit"))
        return tried[size]

    low_too_large = PlanError(f"size {low} does not fit {devices} devices of "
                              f"{human_bytes(limit)}", hint="use more devices, or "
                              "a smaller starting size (low=...)")
    good, bad = _bracket(fits, low, high, guess, low_too_large)
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good, kept[good].plan()


def _bracket(fits: Callable[[int], bool], low: int, high: int, guess: int | None,
             low_too_large: PlanError) -> tuple[int, int | None]:
    """(a size that fits, the next larger size tried that does not, or None up to `high`).

    Raises:
        low_too_large: `low` does not fit.
    """
    def at_least_low() -> int:
        if not fits(low):
            raise low_too_large
        return low

    if guess is None or not low < guess <= high:
        good, bad = at_least_low(), None
        while bad is None and good < high:
            nxt = min(2 * good, high)
            good, bad = (nxt, None) if fits(nxt) else (good, nxt)
        return good, bad
    step = max(1, guess // 128)
    if fits(guess):
        good = guess
        while good < high:
            nxt = min(good + step, high)
            if not fits(nxt):
                return good, nxt
            good, step = nxt, 2 * step
        return good, None
    bad = guess
    while True:
        nxt = bad - step
        if nxt <= low:
            return at_least_low(), bad
        if fits(nxt):
            return nxt, bad
        bad, step = nxt, 2 * step


def _key(c: Candidate) -> str:
    return (f"{c.ranks} ranks x {c.replicas} replicas, {c.chunks} micro-batches, {c.schedule}, "
            f"remat {c.remat}" + (f", shard {c.shard}" if c.shard != "none" else ""))
