"""The random DAG models of the fuzzer (see fxpipe.tools.fuzz): specs, the network they build, and
their generator, driven by a seeded RNG or by hypothesis (fxpipe.testing.fuzz_choices). The
options a model is compiled with are fxpipe.testing.fuzz_examples'."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, TypedDict

import torch
from torch import nn

from fxpipe.testing.fuzz_choices import Choices, Randomness, choices

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

__all__ = ["BATCHES", "REMATS", "ACTIVATIONS", "EDGE_FEATURES", "KINDS", "FuzzNet", "FuzzOutput",
           "Op", "Spec", "SpecOptions", "example_batch", "random_model", "random_spec"]

FuzzOutput: TypeAlias = torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
"""What a FuzzNet returns: one tensor, a tuple or a dict of them (Spec.output_kind)."""


BATCHES = (4, 6, 8)
REMATS = ("never", "always", "except_last")
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
MODULE_OPS = ("linear", "tied", "layernorm", "dropout", *ACTIVATIONS)
MAX_CAT_WIDTH = 48


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
    bias: bool = True  # linear, tied


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
    frozen: tuple[int, ...] = ()  # layers whose parameters have requires_grad=False
    inputs_require_grad: bool = False  # the example's float inputs require grad
    gate_batched: bool = True  # gate is (batch, gate_width), else (1, gate_width): broadcast
    aliased_inputs: bool = False  # the example passes x0 again as x1 (the same tensor)

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
        if self.frozen:
            found.add("frozen")
        if self.inputs_require_grad:
            found.add("inputs_require_grad")
        if self.gate_width is not None and self.gate_given and not self.gate_batched:
            found.add("unbatched_gate")
            if self.gate_width == self.batch:
                found.add("batch_sized_gate")
        if self.aliased_inputs:
            found.add("aliased_inputs")
        if any(not op.bias for op in self.ops):
            found.add("no_bias")
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
        self.fuzz_seed: int | None = None  # the seed of the Example, named in failures
        widths = spec.widths()
        layers: dict[str, nn.Module] = {}
        linears: dict[int, nn.Linear] = {}  # the layers a tied layer can take its weight from
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.init_seed)
            for i, op in enumerate(spec.ops):
                w_in = widths[op.inputs[0]]
                if op.kind == "linear":
                    layers[f"l{i}"] = linears[i] = nn.Linear(w_in, op.width, bias=op.bias)
                elif op.kind == "tied":  # its own module and bias, the weight of layer `tie`
                    other = linears[op.tie]
                    layer = nn.Linear(other.in_features, other.out_features, bias=op.bias)
                    layer.weight = other.weight  # one Parameter, two modules
                    layers[f"l{i}"] = linears[i] = layer
                elif op.kind == "layernorm":
                    layers[f"l{i}"] = nn.LayerNorm(w_in)
                elif op.kind == "dropout":
                    layers[f"l{i}"] = nn.Dropout(op.p)
                elif op.kind in ACTIVATIONS:
                    layers[f"l{i}"] = ACTIVATIONS[op.kind]()
        self.layers = nn.ModuleDict(layers)
        for i in spec.frozen:
            for p in self.layers[f"l{i}"].parameters():
                p.requires_grad_(False)
        self.train(not spec.eval_mode)

    def forward(self, x0: torch.Tensor, x1: torch.Tensor | None = None,
                x2: torch.Tensor | None = None, *, gate: torch.Tensor | None = None) -> FuzzOutput:
        values = [x0]
        for x in (x1, x2)[: self.n_inputs - 1]:
            if x is None:
                raise TypeError(f"this FuzzNet takes {self.n_inputs} positional inputs")
            values.append(x)
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
    if spec.aliased_inputs:
        inputs = (inputs[0], inputs[0], *inputs[2:])
    kwargs: dict[str, torch.Tensor] = {}
    if spec.gate_width is not None and spec.gate_given:
        rows = spec.batch if spec.gate_batched else 1
        kwargs["gate"] = torch.randn(rows, spec.gate_width, generator=g)
    if spec.inputs_require_grad:
        for t in {id(t): t for t in [*inputs, *kwargs.values()]}.values():
            t.requires_grad_(True)
    return inputs, kwargs


# -- the generator --------------------------------------------------------------------------------


class _Builder:
    def __init__(self, c: Choices, widths: list[int], avoid: frozenset[str]) -> None:
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

    def bias(self) -> bool:
        return "no_bias" in self.avoid or not self.c.chance(0.15)

    def activation(self) -> str:
        return self.c.choice(tuple(ACTIVATIONS))

    def step(self, kind: str, gate_width: int | None) -> None:
        c = self.c
        if kind == "linear":
            src = self.pick()
            width = c.integer(2, 16)
            self.add(Op("linear", (src,), width=width, bias=self.bias()), width)
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
            parts = [self.pick()]
            for _ in range(c.integer(1, 2)):
                nxt = self.pick(exclude=parts)
                if sum(self.widths[i] for i in parts) + self.widths[nxt] <= MAX_CAT_WIDTH:
                    parts.append(nxt)
            self.add(Op("cat", tuple(parts)), sum(self.widths[i] for i in parts))
        elif kind in ("tied", "reuse"):  # a late layer with the weight of an early Linear
            first_half = self.ops[: max(len(self.ops) // 2, 1)]
            linears = [i for i, op in enumerate(first_half) if op.kind == "linear"]
            if not linears:
                return self.step("linear", gate_width)
            j = c.choice(linears)
            other = self.ops[j]
            w_in = self.widths[other.inputs[0]]
            src = self.value_of_width(w_in, exclude=(other.inputs[0],))
            self.add(Op(kind, (src,), tie=j, bias=self.bias() if kind == "tied" else True),
                     other.width)
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
EDGE_FEATURES = ("self_merge", "input_as_output", "repeated_output", "unused_input", "frozen",
                 "inputs_require_grad", "no_bias", "unbatched_gate", "batch_sized_gate",
                 "aliased_inputs")


class SpecOptions(TypedDict, total=False):
    """The keyword options of random_spec, which random_model and the others pass on."""

    max_layers: int
    max_inputs: int
    avoid: Collection[str]
    init_seed: int | None


def random_spec(draw_or_rng: Randomness, *, max_layers: int = 10, max_inputs: int = 3,
                avoid: Collection[str] = (), init_seed: int | None = None) -> Spec:
    """A random model description; `draw_or_rng` is a seed, a random.Random or a hypothesis draw.

    max_layers bounds the generator's steps (a residual step adds 3-6 ops, so a model may have
    up to about 2.5 x max_layers ops). `avoid` switches features off (kinds of KINDS, or
    EDGE_FEATURES), e.g. while a bug they trigger is open.
    """
    c = choices(draw_or_rng)
    avoid = frozenset(avoid)
    unknown = avoid - {k for k, _ in KINDS} - set(EDGE_FEATURES)
    if unknown:
        raise ValueError(f"unknown features to avoid: {sorted(unknown)}")
    n_inputs = c.integer(1, max_inputs)
    batch = c.choice(BATCHES)
    widths = [c.integer(2, 16) for _ in range(n_inputs)]
    aliased = n_inputs > 1 and "aliased_inputs" not in avoid and c.chance(0.08)
    if aliased:
        widths[1] = widths[0]
    gate_width = None
    gate_given = False
    gate_batched = True
    if "gate" not in avoid and c.chance(0.3):
        gate_width = c.choice((1, c.integer(2, 16)))
        gate_given = not c.chance(0.2)
        gate_batched = "unbatched_gate" in avoid or not c.chance(0.2)
        if not gate_batched and gate_width != 1:
            # a broadcast (1, w) input whose width happens to equal the batch size
            if "batch_sized_gate" not in avoid and c.chance(0.4):
                gate_width = batch
            elif gate_width == batch and "batch_sized_gate" in avoid:
                gate_width = batch + 1
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
    frozen: tuple[int, ...] = ()
    if "frozen" not in avoid and c.chance(0.15):
        layers = [i for i, op in enumerate(b.ops) if op.kind in ("linear", "layernorm", "tied")]
        if layers:
            frozen = tuple(sorted({c.choice(layers) for _ in range(c.integer(1, 2))}))
    inputs_require_grad = "inputs_require_grad" not in avoid and c.chance(0.15)
    if init_seed is None:
        init_seed = c.integer(0, 2**31 - 1)
    return Spec(batch, tuple(widths), tuple(b.ops), tuple(outputs), kind, gate_width, gate_given,
                eval_mode, init_seed, frozen, inputs_require_grad, gate_batched, aliased)


def random_model(draw_or_rng: Randomness, **options: Unpack[SpecOptions]
                 ) -> tuple[FuzzNet, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """(model, example_inputs, example_kwargs) for a random spec; deterministic for a seed."""
    spec = random_spec(draw_or_rng, **options)
    inputs, kwargs = example_batch(spec)
    return FuzzNet(spec), inputs, kwargs
