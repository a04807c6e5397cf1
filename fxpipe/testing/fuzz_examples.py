"""The fuzzer's examples (see fxpipe.tools.fuzz): a random model (fxpipe.testing.fuzz_models)
with the options it is compiled with (stages, chunks, remat, split points), its batch, and the
checks it must pass; from a seed or as a hypothesis strategy."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

import torch

from fxpipe.testing.fuzz_choices import Randomness, choices
from fxpipe.testing.fuzz_models import (
    ACTIVATIONS,
    REMATS,
    FuzzNet,
    Spec,
    SpecOptions,
    example_batch,
    random_spec,
)
from fxpipe.testing.transparency import check_dropout_remat, check_transparent

if TYPE_CHECKING:  # hypothesis is a test extra: only its strategies need it
    from hypothesis.strategies import DrawFn, SearchStrategy
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

__all__ = ["CutOptions", "Example", "kernel_count", "models_and_configs", "random_config",
           "random_example"]


def kernel_count(spec: Spec) -> int:
    """Ops that surely launch a kernel (the partitioner's atoms): a bound on the stages."""
    return sum(1 for op in spec.ops if op.kind not in ("gate", "dropout", "relu_"))


class CutOptions(TypedDict, total=False):
    """The fxpipe.compile options of an Example: where its stages begin, when it says."""

    split_points: list[str]


@dataclass
class Example:
    spec: Spec
    stages: int
    chunks: int
    remat: str
    seed: int | None = None
    split_points: tuple[str, ...] | None = None  # else the cost model balances the stages
    model: FuzzNet = field(init=False, repr=False)
    inputs: tuple[torch.Tensor, ...] = field(init=False, repr=False)
    kwargs: dict[str, torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.model = FuzzNet(self.spec)
        self.model.fuzz_seed = self.seed
        self.inputs, self.kwargs = example_batch(self.spec)

    @property
    def options(self) -> CutOptions:
        return {} if self.split_points is None else {"split_points": list(self.split_points)}

    def check(self) -> None:
        check_transparent(self.model, self.inputs, self.kwargs, self.stages, self.chunks,
                          self.remat, **self.options)
        if any(op.kind == "dropout" and op.p > 0 for op in self.spec.ops):
            check_dropout_remat(self.model, self.inputs, self.kwargs, self.stages, self.chunks,
                                self.remat, **self.options)


_CUT_KINDS = ("linear", "tied", "layernorm", *ACTIVATIONS)  # modules that are their own atom
_KERNEL_KINDS = (*_CUT_KINDS, "reuse", "add", "mul", "cat")


def random_config(draw_or_rng: Randomness, spec: Spec,
                  max_stages: int = 4) -> tuple[int, int, str, tuple[str, ...] | None]:
    """stages (1 .. min(max_stages, kernel_count)), chunks (a divisor of the batch), remat, and
    split points: None (the cost model cuts) or, sometimes, stages - 1 random layers where
    stages 1.. begin, so that cuts also fall where the cost model would not put them.

    The first option is what hypothesis draws most and shrinks to: 2 stages and 2 chunks,
    the smallest real pipeline, rather than 1 stage or 1 chunk.
    """
    c = choices(draw_or_rng)
    bound = max(1, min(max_stages, kernel_count(spec)))
    stages = c.choice([s for s in (2, 1, 3, 4) if s <= bound])
    divisors = [d for d in range(1, spec.batch + 1) if spec.batch % d == 0]
    chunks = c.choice(sorted(divisors, key=lambda d: (d != 2, d)))
    remat = c.choice(REMATS)
    split_points: tuple[str, ...] | None = None
    if stages > 1 and c.chance(0.3):
        first = next((i for i, op in enumerate(spec.ops) if op.kind in _KERNEL_KINDS), None)
        reused = {op.tie for op in spec.ops if op.kind == "reuse"}  # two places: ambiguous
        candidates = [i for i, op in enumerate(spec.ops) if op.kind in _CUT_KINDS
                      and first is not None and i > first and i not in reused]
        if len(candidates) >= stages - 1:
            chosen: list[int] = []
            for _ in range(stages - 1):
                chosen.append(c.choice([i for i in candidates if i not in chosen]))
            split_points = tuple(f"layers.l{i}" for i in sorted(chosen))
    return stages, chunks, remat, split_points


def random_example(seed: int, **options: Unpack[SpecOptions]) -> Example:
    """The example `python -m fxpipe.tools.fuzz` runs for `seed`."""
    rng = random.Random(seed)
    spec = random_spec(rng, **options)
    stages, chunks, remat, split_points = random_config(rng, spec)
    return Example(spec, stages, chunks, remat, seed, split_points)


def models_and_configs(**options: Unpack[SpecOptions]) -> SearchStrategy[Example]:
    """A hypothesis strategy of Examples (a random model, its batch, stages, chunks, remat)."""
    from hypothesis import strategies as st

    @st.composite
    def examples(draw: DrawFn) -> Example:
        spec = random_spec(draw, **options)
        stages, chunks, remat, split_points = random_config(draw, spec)
        return Example(spec, stages, chunks, remat, split_points=split_points)

    return examples()
