"""The fuzzer's decisions (fxpipe.testing.fuzz_models, fuzz_examples), from a seed, a
random.Random or a hypothesis draw: one interface, so that one generator serves the seeded
command and hypothesis's shrinking."""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias, TypeVar

if TYPE_CHECKING:  # hypothesis is a test extra: only its draws need it
    from hypothesis.strategies import DrawFn, SearchStrategy

__all__ = ["Choices", "Randomness", "choices"]

T = TypeVar("T")

Randomness: TypeAlias = "int | random.Random | DrawFn"
"""Where the generator's decisions come from: a seed, a random.Random or a hypothesis draw."""


class Choices:
    """The generator's decisions. Every decision's first/smallest option is the simplest, so
    hypothesis shrinks towards small plain models."""

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def choice(self, options: Sequence[T]) -> T:
        return options[self.integer(0, len(options) - 1)]

    def chance(self, p: float) -> bool:
        """True with probability p; shrinks to False."""
        return self.integer(0, 999) >= round(1000 * (1 - p))

    def weighted(self, options: Sequence[tuple[T, int]]) -> T:
        total = sum(w for _, w in options)
        k = self.integer(0, total - 1)
        for value, w in options:
            if k < w:
                return value
            k -= w
        raise AssertionError("unreachable")


class _RngChoices(Choices):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


class _DrawChoices(Choices):
    def __init__(self, draw: DrawFn) -> None:
        from hypothesis import strategies as st

        self.draw = draw
        self.integers: Callable[[int, int], SearchStrategy[int]] = st.integers

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(self.integers(lo, hi))


def choices(draw_or_rng: Randomness | Choices) -> Choices:
    if isinstance(draw_or_rng, Choices):
        return draw_or_rng
    if isinstance(draw_or_rng, random.Random):
        return _RngChoices(draw_or_rng)
    if isinstance(draw_or_rng, int) and not isinstance(draw_or_rng, bool):
        return _RngChoices(random.Random(draw_or_rng))
    if callable(draw_or_rng):
        return _DrawChoices(draw_or_rng)
    raise TypeError(f"random_model takes a seed, a random.Random or a hypothesis draw "
                    f"(got {type(draw_or_rng).__name__})")
