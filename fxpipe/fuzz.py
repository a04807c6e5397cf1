"""Random DAG models for checking transparency (DESIGN.md): the compiled program must compute
the same outputs, loss and parameter gradients as the plain model, for every model and config.

    model, inputs, kwargs = random_model(seed)          # or random.Random(...), or hypothesis draw
    check_transparent(model, inputs, kwargs, stages=2, chunks=4, remat="always")

    python -m fxpipe.fuzz --examples 1000 --seed 1     # N random examples, summary, exit 1 on failure
    python -m fxpipe.fuzz --replay 1000017             # one example again, verbosely

A model is a `FuzzNet`: a ModuleDict of layers plus a constant plan (a tuple of `Op`s, each
reading earlier values by index) run by a Python loop in `forward`. torch.fx unrolls that loop
because the plan is a constant. Values 0 .. n_inputs-1 are the positional inputs; layer i writes
value n_inputs + i. The features: 1-3 inputs (batch 4, 6 or 8; widths 2-16), Linear (widths
2-16), LayerNorm, ReLU/GELU/Tanh/Sigmoid, Dropout, residual additions, long skip edges, branches
merged by add, mul or torch.cat, Linear layers that share one weight Parameter (tied, placed in
the second half of the model, far from the layer they tie to), an optional keyword input `gate`
(multiplies a value by sigmoid(gate) when given), and 1-3 outputs as a tensor, tuple or dict.

Dropout: models are generated with p in {0, 0.1, 0.5}. A model with any p > 0 is returned in
eval mode (dropout draws other masks for a micro-batch than for the full batch, so train mode
cannot be compared); models with only p = 0 are returned in train mode (some in eval mode, to
cover both). check_transparent compares the model in the mode it is given.

The same generator runs from a seed (a plain loop, `python -m fxpipe.fuzz`) and from hypothesis
(`models_and_configs()`, which shrinks failures towards fewer layers, fewer features and the
first choice of every option).
"""
from __future__ import annotations

import argparse
import copy
import random
import sys
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["Op", "Spec", "FuzzNet", "Example", "random_spec", "random_model", "random_example",
           "models_and_configs", "check_transparent", "main"]

BATCHES = (4, 6, 8)
REMATS = ("never", "always", "except_last")
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
MODULE_OPS = ("linear", "tied", "layernorm", "dropout", *ACTIVATIONS)
MAX_CAT_WIDTH = 48
PROFILE = "a100"  # a deterministic preset: no CPU micro-benchmark per example


# -- the model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One layer: `kind` applied to the values `inputs` (indexes into the value list).

    kind: linear (to `width`), tied (a Linear sharing the weight of layer `tie`), layernorm,
    relu, gelu, tanh, sigmoid, dropout (probability `p`), add, mul, cat (dim 1), gate
    (value * sigmoid(gate) when the keyword input gate is given, else the value), reuse (the
    Linear module of layer `tie` called again), relu_ (F.relu(inplace=True); the generator
    never reads its input value again).
    """

    kind: str
    inputs: tuple[int, ...]
    width: int = 0
    p: float = 0.0
    tie: int = -1


@dataclass(frozen=True)
class Spec:
    """Everything that determines a model and its example batch (see random_spec)."""

    batch: int
    input_widths: tuple[int, ...]
    ops: tuple[Op, ...]
    outputs: tuple[int, ...]  # value indexes
    output_kind: str = "tensor"  # "tensor" (one output), "tuple" or "dict"
    gate_width: int | None = None  # width of the keyword input `gate` (None: no gate ops)
    gate_given: bool = False  # whether the example passes `gate`
    eval_mode: bool = False
    init_seed: int = 0

    @property
    def n_inputs(self) -> int:
        return len(self.input_widths)

    def widths(self) -> list[int]:
        """The width of every value (inputs first, then one per op)."""
        widths = list(self.input_widths)
        for op in self.ops:
            if op.kind == "linear":
                widths.append(op.width)
            elif op.kind in ("tied", "reuse"):
                widths.append(self.ops[op.tie].width)
            elif op.kind == "cat":
                widths.append(sum(widths[i] for i in op.inputs))
            else:
                widths.append(widths[op.inputs[0]])
        return widths

    def features(self) -> set[str]:
        """Which generator features this model exercises (for coverage checks)."""
        found: set[str] = set()
        kinds = {op.kind for op in self.ops}
        found |= {k for k in kinds
                  if k in ("tied", "reuse", "relu_", "cat", "mul", "layernorm", "dropout")}
        if any(op.kind == "dropout" and op.p > 0 for op in self.ops):
            found.add("dropout_active")
        if self.n_inputs > 1:
            found.add("several_inputs")
        if self.gate_width is not None and self.gate_given:
            found.add("keyword_input")
        if len(self.outputs) > 1:
            found.add("several_outputs")
        if len(set(self.outputs)) < len(self.outputs):
            found.add("repeated_output")
        if any(i < self.n_inputs for i in self.outputs):
            found.add("input_as_output")
        if any(len(set(op.inputs)) < len(op.inputs) for op in self.ops):
            found.add("self_merge")
        if set(range(self.n_inputs)) - {i for op in self.ops for i in op.inputs}:
            found.add("unused_input")
        found.add(f"{self.output_kind}_output")
        if self.eval_mode:
            found.add("eval_mode")
        n = self.n_inputs
        for i, op in enumerate(self.ops):
            if op.kind == "add":
                found.add("residual_or_merge_add")
            if any(n + i - j >= 4 for j in op.inputs):  # reads a value 4+ layers back
                found.add("skip_edge")
        return found

    def param_count(self) -> int:
        return sum(p.numel() for p in FuzzNet(self).parameters())


class FuzzNet(nn.Module):
    """A random DAG model: `layers` (one module per module op) run in the order of `plan`."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.plan = spec.ops  # a constant: fx unrolls the loop over it
        self.n_inputs = spec.n_inputs
        widths = spec.widths()
        layers: dict[str, nn.Module] = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.init_seed)
            for i, op in enumerate(spec.ops):
                w_in = widths[op.inputs[0]]
                if op.kind == "linear":
                    layers[f"l{i}"] = nn.Linear(w_in, op.width)
                elif op.kind == "tied":  # its own module and bias, the weight of layer `tie`
                    other = layers[f"l{op.tie}"]
                    layer = nn.Linear(other.in_features, other.out_features)
                    layer.weight = other.weight  # one Parameter, two modules
                    layers[f"l{i}"] = layer
                elif op.kind == "layernorm":
                    layers[f"l{i}"] = nn.LayerNorm(w_in)
                elif op.kind == "dropout":
                    layers[f"l{i}"] = nn.Dropout(op.p)
                elif op.kind in ACTIVATIONS:
                    layers[f"l{i}"] = ACTIVATIONS[op.kind]()
        self.layers = nn.ModuleDict(layers)
        self.train(not spec.eval_mode)

    def forward(self, x0: torch.Tensor, x1: torch.Tensor | None = None,
                x2: torch.Tensor | None = None, *, gate: torch.Tensor | None = None) -> Any:
        values = [x0, x1, x2][: self.n_inputs]
        for i, op in enumerate(self.plan):
            xs = [values[j] for j in op.inputs]
            if op.kind in MODULE_OPS:
                y = self.layers[f"l{i}"](xs[0])
            elif op.kind == "add":
                y = xs[0] + xs[1]
            elif op.kind == "mul":
                y = xs[0] * xs[1]
            elif op.kind == "cat":
                y = torch.cat(xs, dim=1)
            elif op.kind == "gate":
                y = xs[0] * torch.sigmoid(gate) if gate is not None else xs[0]
            elif op.kind == "reuse":  # the module of layer `tie`, called again
                y = self.layers[f"l{op.tie}"](xs[0])
            elif op.kind == "relu_":  # in place: the input value is not read again
                y = torch.nn.functional.relu(xs[0], inplace=True)
            else:
                raise ValueError(f"unknown op {op.kind!r}")
            values.append(y)
        outs = [values[j] for j in self.spec.outputs]
        if self.spec.output_kind == "tensor":
            return outs[0]
        if self.spec.output_kind == "tuple":
            return tuple(outs)
        return {f"out{k}": v for k, v in enumerate(outs)}


def example_batch(spec: Spec) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(spec.init_seed + 1)
    inputs = tuple(torch.randn(spec.batch, w, generator=g) for w in spec.input_widths)
    kwargs = {}
    if spec.gate_width is not None and spec.gate_given:
        kwargs["gate"] = torch.randn(spec.batch, spec.gate_width, generator=g)
    return inputs, kwargs


# -- choices: from a seed or from hypothesis ------------------------------------------------------


class _Choices:
    """The generator's decisions. Every decision's first/smallest option is the simplest, so
    hypothesis shrinks towards small plain models."""

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def choice(self, options: Sequence[Any]) -> Any:
        return options[self.integer(0, len(options) - 1)]

    def chance(self, p: float) -> bool:
        """True with probability p; shrinks to False."""
        return self.integer(0, 999) >= round(1000 * (1 - p))

    def weighted(self, options: Sequence[tuple[Any, int]]) -> Any:
        total = sum(w for _, w in options)
        k = self.integer(0, total - 1)
        for value, w in options:
            if k < w:
                return value
            k -= w
        raise AssertionError("unreachable")


class _RngChoices(_Choices):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


class _DrawChoices(_Choices):
    def __init__(self, draw: Callable[[Any], Any]) -> None:
        from hypothesis import strategies as st

        self.draw = draw
        self.st = st

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(self.st.integers(lo, hi))


def _choices(draw_or_rng: Any) -> _Choices:
    if isinstance(draw_or_rng, _Choices):
        return draw_or_rng
    if isinstance(draw_or_rng, random.Random):
        return _RngChoices(draw_or_rng)
    if isinstance(draw_or_rng, int) and not isinstance(draw_or_rng, bool):
        return _RngChoices(random.Random(draw_or_rng))
    if callable(draw_or_rng):
        return _DrawChoices(draw_or_rng)
    raise TypeError(f"random_model takes a seed, a random.Random or a hypothesis draw "
                    f"(got {type(draw_or_rng).__name__})")


# -- the generator --------------------------------------------------------------------------------


class _Builder:
    def __init__(self, c: _Choices, widths: list[int], avoid: frozenset[str]) -> None:
        self.c = c
        self.widths = list(widths)
        self.ops: list[Op] = []
        self.n_inputs = len(widths)
        self.avoid = avoid
        self.dead: set[int] = set()  # values an in-place op has overwritten: never read again

    def add(self, op: Op, width: int) -> int:
        self.ops.append(op)
        self.widths.append(width)
        return len(self.widths) - 1

    def live(self, exclude: Sequence[int] = ()) -> list[int]:
        return [i for i in range(len(self.widths)) if i not in self.dead and i not in exclude]

    def pick(self, exclude: Sequence[int] = ()) -> int:
        """A value to read: mostly the latest, sometimes a recent one, sometimes any (a long
        skip edge). `exclude` is a preference: an excluded value comes back when nothing else
        is live, or (a branch merging with itself) by chance."""
        live = self.live(exclude)
        if not live or (exclude and "self_merge" not in self.avoid and self.c.chance(0.04)):
            live = self.live()
        how = self.c.weighted([("latest", 55), ("recent", 25), ("any", 20)])
        if how == "latest":
            back = 0
        elif how == "recent":
            back = self.c.integer(0, min(3, len(live) - 1))
        else:
            back = self.c.integer(0, len(live) - 1)
        return live[len(live) - 1 - back]

    def pick_width(self, width: int, exclude: Sequence[int] = ()) -> int | None:
        """A value of exactly `width` (the latest, sometimes any), or None."""
        found = [i for i in self.live(exclude) if self.widths[i] == width]
        if not found:
            return None
        if self.c.chance(0.3):
            return self.c.choice(found)
        return found[-1]

    def project(self, source: int, width: int) -> int:
        return self.add(Op("linear", (source,), width=width), width)

    def value_of_width(self, width: int, exclude: Sequence[int] = ()) -> int:
        found = self.pick_width(width, exclude)
        if found is not None:
            return found
        return self.project(self.pick(exclude), width)

    def activation(self) -> str:
        return self.c.choice(tuple(ACTIVATIONS))

    def step(self, kind: str, gate_width: int | None) -> None:
        c = self.c
        if kind == "linear":
            src = self.pick()
            width = c.integer(2, 16)
            self.add(Op("linear", (src,), width=width), width)
        elif kind == "act":
            src = self.pick()
            self.add(Op(self.activation(), (src,)), self.widths[src])
        elif kind == "layernorm":
            src = self.pick()
            if self.widths[src] < 4:  # LayerNorm over 2-3 features is ill-conditioned
                return self.step("act", gate_width)
            self.add(Op("layernorm", (src,)), self.widths[src])
        elif kind == "dropout":
            src = self.pick()
            self.add(Op("dropout", (src,), p=c.choice((0.0, 0.1, 0.5))), self.widths[src])
        elif kind == "residual":  # x + f(x), f = [layernorm] linear act [linear] [relu_]
            src = self.pick()
            w = self.widths[src]
            h = src
            if w >= 4 and c.chance(0.4):
                h = self.add(Op("layernorm", (h,)), w)
            hidden = c.integer(2, 16) if c.chance(0.5) else w
            h = self.add(Op("linear", (h,), width=hidden), hidden)
            h = self.add(Op(self.activation(), (h,)), hidden)
            if hidden != w:
                h = self.add(Op("linear", (h,), width=w), w)
            out = self.add(Op("add", (src, h)), w)
            if "relu_" not in self.avoid and c.chance(0.3):  # x = relu(x + f(x), inplace=True)
                self.dead.add(out)
                self.add(Op("relu_", (out,)), w)
        elif kind in ("add", "mul"):  # two branches of one width merge
            a = self.pick()
            b = self.value_of_width(self.widths[a], exclude=(a,))
            ins = (a, b) if c.chance(0.5) else (b, a)
            self.add(Op(kind, ins), self.widths[a])
        elif kind == "cat":
            ins = [self.pick()]
            for _ in range(c.integer(1, 2)):
                nxt = self.pick(exclude=ins)
                if sum(self.widths[i] for i in ins) + self.widths[nxt] <= MAX_CAT_WIDTH:
                    ins.append(nxt)
            self.add(Op("cat", tuple(ins)), sum(self.widths[i] for i in ins))
        elif kind in ("tied", "reuse"):  # a late layer with the weight of an early Linear
            first_half = self.ops[: max(len(self.ops) // 2, 1)]
            linears = [i for i, op in enumerate(first_half) if op.kind == "linear"]
            if not linears:
                return self.step("linear", gate_width)
            j = c.choice(linears)
            other = self.ops[j]
            w_in = self.widths[other.inputs[0]]
            src = self.value_of_width(w_in, exclude=(other.inputs[0],))
            self.add(Op(kind, (src,), tie=j), other.width)
        elif kind == "relu_":  # in place on a fresh Linear output no other op reads
            src = self.project(self.pick(), c.integer(2, 16))
            self.dead.add(src)
            self.add(Op("relu_", (src,)), self.widths[src])
        elif kind == "gate":
            assert gate_width is not None
            src = self.pick() if gate_width == 1 else self.value_of_width(gate_width)
            self.add(Op("gate", (src,)), self.widths[src])
        else:
            raise ValueError(kind)


KINDS = (("linear", 24), ("act", 14), ("residual", 10), ("add", 8), ("cat", 8), ("mul", 6),
         ("layernorm", 6), ("dropout", 5), ("tied", 6), ("reuse", 3), ("relu_", 3), ("gate", 6))
#: What `avoid` can switch off: op kinds above, and these.
EDGE_FEATURES = ("self_merge", "input_as_output", "repeated_output", "unused_input")


def random_spec(draw_or_rng: Any, *, max_layers: int = 10, max_inputs: int = 3,
                avoid: Collection[str] = (), init_seed: int | None = None) -> Spec:
    """A random model description; `draw_or_rng` is a seed, a random.Random or a hypothesis draw.

    max_layers bounds the generator's steps (a residual step adds 3-6 ops, so a model may have
    up to about 2.5 x max_layers ops). `avoid` switches features off (kinds of KINDS, or
    EDGE_FEATURES), e.g. while a bug they trigger is open.
    """
    c = _choices(draw_or_rng)
    avoid = frozenset(avoid)
    unknown = avoid - {k for k, _ in KINDS} - set(EDGE_FEATURES)
    if unknown:
        raise ValueError(f"unknown features to avoid: {sorted(unknown)}")
    n_inputs = c.integer(1, max_inputs)
    batch = c.choice(BATCHES)
    widths = [c.integer(2, 16) for _ in range(n_inputs)]
    gate_width = None
    gate_given = False
    if "gate" not in avoid and c.chance(0.3):
        gate_width = c.choice((1, c.integer(2, 16)))
        gate_given = not c.chance(0.2)
    b = _Builder(c, widths, avoid)
    steps = c.integer(1, max_layers)
    kinds = [(k, w) for k, w in KINDS if k not in avoid and (k != "gate" or gate_width is not None)]
    for s in range(steps):
        kind = c.weighted(kinds)
        if kind in ("tied", "reuse") and s < steps // 2:  # far apart: late layers tie to early
            kind = "linear"
        b.step(kind, gate_width)
    # An input nobody reads has no batch dimension to infer; feed each into the model once.
    read = {i for op in b.ops for i in op.inputs}
    for i in range(n_inputs):
        if i not in read and ("unused_input" in avoid or not c.chance(0.05)):
            last = b.live()[-1]
            proj = b.project(i, b.widths[last])
            b.add(Op("add", (last, proj)), b.widths[last])
    live = b.live()
    outputs = [live[-1]]
    for _ in range(c.integer(0, 2)):
        if "input_as_output" not in avoid and c.chance(0.05):
            outputs.append(c.integer(0, n_inputs - 1))
        elif "repeated_output" not in avoid and c.chance(0.05):
            outputs.append(c.choice(outputs))
        else:
            candidates = [i for i in live if i >= n_inputs and i not in outputs] or live
            outputs.append(c.choice(candidates))
    if len(outputs) == 1:
        kind = c.choice(("tensor", "tuple", "dict"))
    else:
        kind = c.choice(("tuple", "dict"))
    dropout = any(op.kind == "dropout" and op.p > 0 for op in b.ops)
    eval_mode = dropout or c.chance(0.15)
    if init_seed is None:
        init_seed = c.integer(0, 2**31 - 1)
    return Spec(batch, tuple(widths), tuple(b.ops), tuple(outputs), kind, gate_width, gate_given,
                eval_mode, init_seed)


def random_model(draw_or_rng: Any, **options: Any) -> tuple[nn.Module, tuple, dict]:
    """(model, example_inputs, example_kwargs) for a random spec; deterministic for a seed."""
    spec = random_spec(draw_or_rng, **options)
    inputs, kwargs = example_batch(spec)
    return FuzzNet(spec), inputs, kwargs


# -- configs --------------------------------------------------------------------------------------


def kernel_count(spec: Spec) -> int:
    """Ops that surely launch a kernel (the partitioner's atoms): a bound on the stages."""
    return sum(1 for op in spec.ops if op.kind not in ("gate", "dropout", "relu_"))


@dataclass
class Example:
    spec: Spec
    stages: int
    chunks: int
    remat: str
    seed: int | None = None
    model: nn.Module = field(init=False, repr=False)
    inputs: tuple = field(init=False, repr=False)
    kwargs: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.model = FuzzNet(self.spec)
        self.model.fuzz_seed = self.seed
        self.inputs, self.kwargs = example_batch(self.spec)

    def check(self) -> None:
        check_transparent(self.model, self.inputs, self.kwargs, self.stages, self.chunks,
                          self.remat)


def random_config(draw_or_rng: Any, spec: Spec, max_stages: int = 4) -> tuple[int, int, str]:
    c = _choices(draw_or_rng)
    stages = c.integer(1, max(1, min(max_stages, kernel_count(spec))))
    chunks = c.choice([d for d in range(1, spec.batch + 1) if spec.batch % d == 0])
    remat = c.choice(REMATS)
    return stages, chunks, remat


def random_example(seed: int, **options: Any) -> Example:
    """The example `python -m fxpipe.fuzz` runs for `seed`."""
    rng = random.Random(seed)
    spec = random_spec(rng, **options)
    stages, chunks, remat = random_config(rng, spec)
    return Example(spec, stages, chunks, remat, seed)


def models_and_configs(**options: Any) -> Any:
    """A hypothesis strategy of Examples (a random model, its batch, stages, chunks, remat)."""
    from hypothesis import strategies as st

    @st.composite
    def examples(draw: Any) -> Example:
        spec = random_spec(draw, **options)
        stages, chunks, remat = random_config(draw, spec)
        return Example(spec, stages, chunks, remat)

    return examples()


# -- the check ------------------------------------------------------------------------------------


def _detach(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def check_transparent(model: nn.Module, inputs: Sequence[Any], kwargs: dict | None, stages: int,
                      chunks: int, remat: str, *, profile: Any = PROFILE) -> None:
    """Compiles a copy of `model` and compares it with another plain copy in float32: outputs,
    the default loss (mean of squares of every output) and every parameter's gradient, with
    torch.testing.assert_close's default tolerances. The model is compared in the mode it is
    in (see the module docstring on dropout). Raises AssertionError naming the seed, the config
    and the tensor that differs; an exception inside fxpipe becomes an AssertionError too.
    """
    import fxpipe
    from fxpipe.losses import default_loss

    kwargs = dict(kwargs or {})
    inputs = tuple(inputs)
    seed = getattr(model, "fuzz_seed", None)
    spec = getattr(model, "spec", None)
    where = (f"seed={seed} stages={stages} chunks={chunks} remat={remat!r} "
             f"mode={'train' if model.training else 'eval'}")
    if spec is not None:
        where += f"\n  spec={spec!r}"

    plain = copy.deepcopy(model)
    piped = copy.deepcopy(model)
    expected = plain(*inputs, **kwargs)
    expected_loss = default_loss(expected)
    differentiable = expected_loss.requires_grad  # False when no output depends on a parameter
    if differentiable:
        expected_loss.backward()
    expected_grads = {n: None if p.grad is None else p.grad.detach().clone()
                      for n, p in plain.named_parameters(remove_duplicate=False)}

    step = "compile"
    try:
        program = fxpipe.compile(piped, inputs, example_kwargs=kwargs, stages=stages,
                                 chunks=chunks, remat=remat, profile=profile)
        step = "run"
        output = program(*inputs, **kwargs)
        step = "loss"
        loss = default_loss(output)
        step = "backward"
        if differentiable:
            loss.backward()
    except Exception as e:  # noqa: BLE001 - any exception on a valid model is a failure
        raise AssertionError(f"fxpipe failed at {step}: {type(e).__name__}: {e}\n  {where}") from e

    def close(actual: Any, wanted: Any, what: str) -> None:
        try:
            torch.testing.assert_close(actual, wanted)
        except AssertionError as e:
            raise AssertionError(f"{what} differs: {e}\n  {where}") from None

    out_leaves, out_spec = pytree.tree_flatten(_detach(output))
    exp_leaves, exp_spec = pytree.tree_flatten(_detach(expected))
    if out_spec != exp_spec:
        raise AssertionError(f"output structure differs: {out_spec} instead of {exp_spec}\n  "
                             f"{where}")
    for k, (a, e) in enumerate(zip(out_leaves, exp_leaves)):
        close(a, e, f"output leaf {k}")
    close(loss.detach(), expected_loss.detach(), "loss")
    if loss.requires_grad != differentiable:
        raise AssertionError(f"the program's loss has requires_grad={loss.requires_grad}, the "
                             f"plain model's {differentiable}\n  {where}")
    grads = {n: p.grad for n, p in piped.named_parameters(remove_duplicate=False)}
    if grads.keys() != expected_grads.keys():
        raise AssertionError(f"parameter names differ: {sorted(grads)} vs "
                             f"{sorted(expected_grads)}\n  {where}")
    for name, wanted in expected_grads.items():
        got = grads[name]
        if (got is None) != (wanted is None):
            raise AssertionError(f"gradient of {name} is {'missing' if got is None else 'present'}"
                                 f" but the plain model's is "
                                 f"{'missing' if wanted is None else 'present'}\n  {where}")
        if got is not None:
            close(got, wanted, f"gradient of {name}")


# -- command line ---------------------------------------------------------------------------------


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fxpipe.fuzz",
        description="Compiles random DAG models and checks that every program is transparent "
                    "(same outputs, loss and gradients as the plain model).")
    parser.add_argument("--examples", type=int, default=1000, help="how many (default 1000)")
    parser.add_argument("--seed", type=int, default=0,
                        help="base seed: example i uses seed SEED * 1000000 + i")
    parser.add_argument("--max-layers", type=int, default=10)
    parser.add_argument("--avoid", default="", metavar="FEATURES",
                        help="comma-separated features to leave out (see KINDS, EDGE_FEATURES)")
    parser.add_argument("--replay", type=int, default=None, metavar="SEED",
                        help="run the one example of this seed and print the full error")
    args = parser.parse_args(argv)
    options = {"max_layers": args.max_layers,
               "avoid": tuple(x.strip() for x in args.avoid.split(",") if x.strip())}
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    if args.replay is not None:
        example = random_example(args.replay, **options)
        print(f"seed {args.replay}: stages={example.stages} chunks={example.chunks} "
              f"remat={example.remat!r}\n{example.spec!r}")
        try:
            example.check()
        except AssertionError:
            traceback.print_exc()
            return 1
        print("transparent")
        return 0

    start = time.perf_counter()
    failures: list[tuple[int, str]] = []
    for i in range(args.examples):
        seed = args.seed * 1_000_000 + i
        example = random_example(seed, **options)
        try:
            example.check()
        except AssertionError as e:
            failures.append((seed, _first_line(str(e))))
            print(f"FAIL seed={seed}: {_first_line(str(e))}", flush=True)
        if (i + 1) % 50 == 0 or i + 1 == args.examples:
            print(f"[{i + 1}/{args.examples}] {len(failures)} failures, "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
    kinds: dict[str, list[int]] = {}
    for seed, message in failures:
        kinds.setdefault(message.split(":")[0] + ": " + message.split(":")[1].strip()
                         if ":" in message else message, []).append(seed)
    print(f"summary: {args.examples} examples (seed {args.seed}), {len(failures)} failures, "
          f"{time.perf_counter() - start:.0f}s")
    for kind, seeds in kinds.items():
        print(f"  {len(seeds)} x {kind}: seeds {seeds[:10]}{' ...' if len(seeds) > 10 else ''}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
