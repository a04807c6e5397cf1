"""A model's call signature as flat tensor leaves: flatten, check, split into micro-batches,
join."""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeGuard

import torch
import torch.utils._pytree as pytree

from fxpipe.errors import RuntimeInputError

__all__ = ["LeafSpec", "Signature", "is_tensor", "copy_inputs", "shape_text", "ModelArgs",
           "ModelKwargs", "forward_parameters", "PARAMETER_KINDS"]

ModelArgs: TypeAlias = tuple[Any, ...]
"""A model's positional inputs: whatever its forward takes."""
ModelKwargs: TypeAlias = dict[str, Any]
"""A model's keyword inputs."""


def is_tensor(x: object) -> TypeGuard[torch.Tensor]:
    return isinstance(x, torch.Tensor)


def copy_inputs(args: ModelArgs, kwargs: ModelKwargs) -> tuple[ModelArgs, ModelKwargs]:
    """A copy of a call's tensors for compile-time runs, so that a model writing into its inputs
    never changes the caller's; a tensor passed twice stays one tensor, and leaves that require
    grad still do."""
    copies: dict[int, torch.Tensor] = {}

    def copy(x: Any) -> Any:
        if not is_tensor(x):
            return x
        if id(x) not in copies:
            copies[id(x)] = x.detach().clone().requires_grad_(x.requires_grad)
        return copies[id(x)]

    copied: tuple[ModelArgs, ModelKwargs] = pytree.tree_map(copy, (tuple(args), dict(kwargs)))
    return copied


def shape_text(shape: Sequence[int]) -> str:
    """A shape as messages write it, B for the batch dimension (-1)."""
    return "(" + ", ".join("B" if n == -1 else str(n) for n in shape) + ")"


@dataclass(frozen=True)
class LeafSpec:
    """One input leaf: a tensor (dtype, shape with the batch dim as -1) or a baked constant."""

    name: str
    is_tensor: bool
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()  # batch dimension written as -1
    batch_dim: int | None = None
    constant: Any = None


class Signature:
    """How (args, kwargs) map to the graph's flat tensor placeholders and back to outputs.

    Non-tensor inputs (flags, ints, None) are baked into the graph at capture time; a call that
    passes other values is rejected instead of silently computing something else.
    """

    def __init__(self, in_spec: pytree.TreeSpec, leaves: Sequence[LeafSpec],
                 out_spec: pytree.TreeSpec, out_batch_dims: Sequence[int | None],
                 out_is_tensor: Sequence[bool],
                 forward: Sequence[tuple[str, str]] | None = None,
                 out_batch_free: Sequence[bool] | None = None) -> None:
        self.in_spec = in_spec
        self.leaves = tuple(leaves)
        # the model forward's parameters, (name, kind) as inspect names the kind: a written
        # program binds a call by them where the model's code is not at hand
        self.forward = tuple(forward) if forward is not None else None
        self.out_spec = out_spec
        self.out_batch_dims = tuple(out_batch_dims)
        self.out_is_tensor = tuple(out_is_tensor)
        # outputs computed from no batched input nor a random draw (a learned temperature, a
        # penalty on the weights): the same on every micro-batch, so one of them is the
        # batch's (fxpipe.passes.batch_free finds them in the graph)
        self.out_batch_free = tuple(out_batch_free) if out_batch_free is not None else \
            (False,) * len(self.out_is_tensor)
        # what a target is split and checked along: the first batched output's batch dimension
        self.target_batch_dim = next((d for d in self.out_batch_dims if d is not None), 0)

    @property
    def tensor_leaves(self) -> tuple[LeafSpec, ...]:
        return tuple(leaf for leaf in self.leaves if leaf.is_tensor)

    @property
    def input_batch_dims(self) -> tuple[int | None, ...]:
        return tuple(leaf.batch_dim for leaf in self.tensor_leaves)

    # -- inputs ---------------------------------------------------------------------------------

    def as_compiled(self, forward: inspect.Signature, args: Sequence[Any],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The call with its inputs passed as the example passed them, positionally or by
        keyword, bound by the model's `forward` signature: `program(ids, mask)` of a program
        compiled with `input_ids=..., attention_mask=...`. None where the call already has the
        compiled split or does not bind to the same inputs (flatten_inputs says what differs)."""
        n_want, want = _call_shape(self.in_spec)
        if len(args) == n_want and sorted(kwargs) == sorted(want):
            return None
        try:
            bound = forward.bind(*args, **kwargs)
        except TypeError:
            return None
        values = dict(bound.arguments)
        for name, param in forward.parameters.items():
            if param.kind is param.VAR_KEYWORD:
                values.update(values.pop(name, {}))
            elif param.kind is param.VAR_POSITIONAL:
                return None  # no name to match the example's inputs by
        positional = list(forward.parameters)[:n_want]
        if sorted(values) != sorted([*positional, *want]):
            return None
        return tuple(values[name] for name in positional), {name: values[name] for name in want}

    def flatten_call(self, args: Sequence[Any],
                     kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
        """flatten_inputs, but inputs given by position that the example gave by keyword, or
        the other way, are taken as the model's forward binds them (its parameters as recorded
        at compile time); looked at only when the call does not match as it is."""
        try:
            return self.flatten_inputs(args, kwargs)
        except RuntimeInputError:
            forward = self.forward_signature()
            rebound = self.as_compiled(forward, args, dict(kwargs or {})) if forward else None
            if rebound is None:
                raise
        return self.flatten_inputs(*rebound)

    def forward_signature(self) -> inspect.Signature | None:
        """The recorded forward parameters as a signature that binds any subset of them (the
        defaults are not recorded: as_compiled checks what a call passes)."""
        if self.forward is None:
            return None
        kinds = {kind.name: kind for kind in _KINDS}
        try:
            return inspect.Signature([
                inspect.Parameter(name, kinds[kind]) if kinds[kind] in _VARIADIC
                else inspect.Parameter(name, kinds[kind], default=None)
                for name, kind in self.forward])
        except (KeyError, ValueError):  # a kind or an order no forward has: nothing to bind by
            return None

    def _difference(self, spec: pytree.TreeSpec) -> str:
        """What differs between a call's inputs and the compiled ones, in argument terms."""
        (n_got, got), (n_want, want) = _call_shape(spec), _call_shape(self.in_spec)
        parts = []
        if missing := [k for k in want if k not in got]:
            parts.append(f"missing keyword inputs {missing}")
        if extra := [k for k in got if k not in want]:
            parts.append(f"unexpected keyword inputs {extra}")
        if n_got != n_want:
            parts.append(f"{n_got} positional inputs instead of {n_want}")
        if not parts:
            parts.append("an input has another nesting (tuple, list or dict) than the example's")
        return (f"{'; '.join(parts)} (compiled with {n_want} positional inputs and keyword "
                f"inputs {want})")

    def _call_leaves(self, args: Sequence[Any], kwargs: dict[str, Any] | None) -> list[Any]:
        """A call's leaves in the compiled order, refused unless structured as compiled."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
        if spec != self.in_spec:  # keywords (or a dict's keys) in another order are the same call
            leaves, spec = pytree.tree_flatten(
                _ordered_like((tuple(args), dict(kwargs or {})), self.in_spec))
        if spec != self.in_spec:
            raise RuntimeInputError(
                f"inputs have another structure than at compile time: {self._difference(spec)}",
                hint="call the program with the same positional and keyword arguments as the "
                     "example inputs, or compile again",
            )
        return leaves

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The compiled tensor inputs' shapes, each batch dimension written as -1."""
        return tuple(leaf.shape for leaf in self.tensor_leaves)

    def call_shapes(self, args: Sequence[Any],
                    kwargs: dict[str, Any] | None) -> tuple[tuple[int, ...], ...] | None:
        """The call's tensor shapes as `shapes` writes them, where the call is the compiled one
        but for those shapes (structure, dtypes, constants, ranks and batch sizes alike): a
        program for them can be built. None otherwise: flatten_inputs says what differs."""
        try:
            tensors = self.flatten_inputs(args, kwargs, shapes=False)
        except RuntimeInputError:
            return None
        return tuple(_shape_of(leaf, t) for leaf, t in zip(self.tensor_leaves, tensors))

    def example_like(self, args: Sequence[Any], kwargs: dict[str, Any] | None,
                     batch: int) -> tuple[ModelArgs, ModelKwargs]:
        """The call's inputs with `batch` examples each (the first ones, cycled where the call
        has fewer), as an example batch to compile for."""
        def resize(leaf: LeafSpec, value: Any) -> Any:
            if not leaf.is_tensor or leaf.batch_dim is None:
                return value
            rows = torch.arange(batch, device=value.device) % value.shape[leaf.batch_dim]
            return value.index_select(leaf.batch_dim, rows)

        leaves = [resize(leaf, v) for leaf, v in zip(self.leaves, self._call_leaves(args, kwargs))]
        call_args, call_kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        return tuple(call_args), dict(call_kwargs)

    def flatten_inputs(self, args: Sequence[Any], kwargs: dict[str, Any] | None, *,
                       shapes: bool = True) -> list[torch.Tensor]:
        """The tensor leaves of a call, checked against the compiled signature (each tensor's
        shape beyond its rank only with `shapes`)."""
        leaves = self._call_leaves(args, kwargs)
        tensors: list[torch.Tensor] = []
        for leaf, value in zip(self.leaves, leaves):
            if leaf.is_tensor:
                self._check_tensor(leaf, value, shapes)
                tensors.append(value)
            elif not _same_constant(leaf.constant, value):
                raise RuntimeInputError(
                    f"input {leaf.name} is {value!r} but the program was compiled with "
                    f"{leaf.constant!r} (non-tensor inputs are baked into the graph)",
                    hint="compile again with this value, or pass it as a tensor",
                )
        self.batch_size(tensors)  # checks that batched inputs agree
        return tensors

    def _check_tensor(self, leaf: LeafSpec, value: object, shape: bool) -> None:
        if not isinstance(value, torch.Tensor):
            raise RuntimeInputError(
                f"input {leaf.name} must be a tensor (got {type(value).__name__})",
                hint="pass the same kinds of inputs as at compile time")
        if value.dtype != leaf.dtype:
            raise RuntimeInputError(
                f"input {leaf.name} has dtype {value.dtype} but the program was compiled for "
                f"{leaf.dtype}", hint=f"convert it with .to({leaf.dtype})")
        got = _shape_of(leaf, value)
        if got != leaf.shape and (shape or len(got) != len(leaf.shape)):
            raise RuntimeInputError(
                f"input {leaf.name} has shape {tuple(value.shape)} but the program was compiled "
                f"for {shape_text(leaf.shape)} (B = batch size, dimension {leaf.batch_dim})",
                hint="only the batch dimension may change between calls; compile again for "
                     "other sizes")

    def batch_size(self, tensors: Sequence[torch.Tensor]) -> int:
        sizes = {leaf.name: t.shape[leaf.batch_dim]
                 for leaf, t in zip(self.tensor_leaves, tensors) if leaf.batch_dim is not None}
        if not sizes:
            raise RuntimeInputError("no input has a batch dimension",
                                    hint="pass at least one batched tensor input")
        if len(set(sizes.values())) > 1:
            raise RuntimeInputError(f"inputs disagree on the batch size ({sizes})",
                                    hint="give every batched input the same batch size")
        return next(iter(sizes.values()))

    @staticmethod
    def microbatches(batch: int, chunks: int) -> int:
        """How many equal micro-batches a batch of `batch` runs in: `chunks` where they divide it,
        else the fewest whose size divides it and is no larger than an even split into
        `chunks` would give (ceil(batch / chunks)): an epoch's last batch of 7 in 4 chunks runs
        as 7 micro-batches of 1, one of 6 as 3 of 2. Equal sizes keep every micro-batch's loss
        weighed alike; no larger size keeps a micro-batch's memory within the plan's."""
        if chunks < 1 or batch < 1:
            raise RuntimeInputError(f"a batch of {batch} cannot run in {chunks} micro-batches",
                                    hint="pass a non-empty batch; chunks is at least 1")
        if batch % chunks == 0:
            return chunks
        most = -(-batch // chunks)
        return batch // max(d for d in range(1, most + 1) if batch % d == 0)

    @staticmethod
    def split_text(batch: int, chunks: int, compiled: int) -> tuple[str, str | None]:
        """How a batch of `batch` runs, for an error in its micro-batches: "a batch of 7 in 7
        micro-batches of 1", and when `compiled` (the program's chunks) does not divide it,
        the hint that a batch it divides avoids the smaller micro-batches."""
        text = f"a batch of {batch} in {chunks} micro-batches of {batch // chunks}"
        if batch % compiled == 0:
            return text, None
        return text, (f"chunks={compiled} does not divide {batch}, which runs as {chunks} equal "
                      f"micro-batches of {batch // chunks} (no larger than an even split "
                      f"gives); pass batches that {compiled} divides (a DataLoader's "
                      "drop_last=True drops a short last batch)")

    def split_inputs(self, tensors: Sequence[torch.Tensor],
                     chunks: int) -> list[list[torch.Tensor]]:
        """Micro-batches: every batched input split into `chunks` equal parts along its batch
        dim (`chunks` as microbatches gives it for the batch)."""
        batch = self.batch_size(tensors)
        if chunks < 1 or batch % chunks:
            raise RuntimeInputError(
                f"batch size {batch} cannot be split into {chunks} equal micro-batches",
                hint="split the batch into Signature.microbatches(batch, chunks) parts")
        parts: list[list[torch.Tensor]] = []
        for leaf, t in zip(self.tensor_leaves, tensors):
            if leaf.batch_dim is None:
                parts.append([t] * chunks)
            else:
                parts.append(list(t.tensor_split(chunks, dim=leaf.batch_dim)))
        return [[p[i] for p in parts] for i in range(chunks)]

    def unflatten_inputs(self, tensors: Sequence[torch.Tensor]) -> tuple[ModelArgs, ModelKwargs]:
        """(args, kwargs) of the model from its flat tensor inputs (constants filled back in)."""
        values: list[Any] = []  # tensors and the baked constants, in leaf order
        it = iter(tensors)
        for leaf in self.leaves:
            values.append(next(it) if leaf.is_tensor else leaf.constant)
        args, kwargs = pytree.tree_unflatten(values, self.in_spec)
        return tuple(args), dict(kwargs)

    # -- outputs --------------------------------------------------------------------------------

    def unflatten_outputs(self, leaves: Sequence[Any]) -> Any:
        return pytree.tree_unflatten(list(leaves), self.out_spec)

    def output_names(self) -> list[str]:
        """How each output leaf is reached from what forward returns (`output['loss']`,
        `output[0]`), for messages; `output i` where the output's type cannot be rebuilt."""
        count = self.out_spec.num_leaves
        try:
            numbered = pytree.tree_unflatten(list(range(count)), self.out_spec)
            paths = {leaf: pytree.keystr(path)
                     for path, leaf in pytree.tree_flatten_with_path(numbered)[0]}
        except Exception:  # a container whose constructor checks its fields
            paths = {}
        return [f"output{paths[i]}" if i in paths else f"output {i}" for i in range(count)]

    def batch_free_outputs(self) -> list[str]:
        """The outputs the same on every micro-batch (out_batch_free), for messages."""
        names = self.output_names()
        return [names[i] for i, free in enumerate(self.out_batch_free) if free]

    def unjoinable_outputs(self) -> list[str]:
        """The tensor outputs without a batch dimension that the batch computes (a loss the
        model computes, a statistic over the batch): micro-batches' values of them cannot be
        joined into the batch's, so only a program of one micro-batch can return them."""
        names = self.output_names()
        return [names[i] for i, (is_t, dim, free) in enumerate(zip(
                    self.out_is_tensor, self.out_batch_dims, self.out_batch_free))
                if is_t and dim is None and not free]

    @property
    def keywords(self) -> list[str]:
        """The keyword inputs of the compiled call."""
        return _call_shape(self.in_spec)[1]

    def join_outputs(self, per_microbatch: Sequence[Sequence[Any]]) -> list[Any]:
        """Concatenates each output leaf along its batch dimension; of a batch-free one (see
        out_batch_free), the same on every micro-batch, the first micro-batch's."""
        joined: list[Any] = []
        for i, (is_t, dim, free) in enumerate(zip(self.out_is_tensor, self.out_batch_dims,
                                                  self.out_batch_free)):
            values = [mb[i] for mb in per_microbatch]
            first = values[0]
            if is_t != isinstance(first, torch.Tensor) or (
                    dim is not None and not 0 <= dim < first.dim()):
                # only a hand-edited program.json describes its outputs otherwise
                what = f"a tensor of shape {tuple(first.shape)}" \
                    if isinstance(first, torch.Tensor) else f"a {type(first).__name__}"
                raise RuntimeInputError(
                    f"output {i} is {what}, but the program's signature says "
                    + (f"its batch dimension is {dim}" if is_t else "it is no tensor"),
                    hint="program.json's signature does not describe this program: write the "
                         "program again (program.write(DIR) or fxpipe compile ... --out DIR)")
            if not is_t:
                joined.append(values[0])
            elif dim is None:
                if len(values) == 1 or free:
                    joined.append(values[0])
                    continue
                raise RuntimeInputError(
                    f"output {i} (shape {tuple(values[0].shape)}) has no batch dimension, so "
                    f"{len(values)} micro-batch results cannot be joined",
                    hint="return per-example values (compute reductions such as the loss "
                         "outside the model, e.g. with loss_fn), or use chunks=1")
            else:
                joined.append(torch.cat(values, dim=dim))
        return joined


_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
          inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.KEYWORD_ONLY,
          inspect.Parameter.VAR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
PARAMETER_KINDS = tuple(kind.name for kind in _KINDS)  # as Signature.forward names them


def forward_parameters(forward: inspect.Signature) -> tuple[tuple[str, str], ...]:
    """A forward's parameters as Signature records them: (name, kind name)."""
    return tuple((name, p.kind.name) for name, p in forward.parameters.items())


def _call_shape(spec: pytree.TreeSpec) -> tuple[int, list[str]]:
    """A call's number of positional inputs and its keywords, from its (args, kwargs) spec."""
    args, kwargs = pytree.tree_unflatten([None] * spec.num_leaves, spec)
    return len(args), list(kwargs)


def _ordered_like(value: Any, spec: pytree.TreeSpec) -> Any:
    """`value` with every dict's keys in the order `spec` has them (the compiled call's), where
    the keys are the same: a call's keyword order, or a dict's, does not change what it is."""
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    if spec.type is dict and isinstance(value, dict) and set(value) == set(spec.context):
        return {k: _ordered_like(value[k], child) for k, child in zip(spec.context, children)}
    if spec.type in (tuple, list) and type(value) is spec.type and len(value) == len(children):
        return spec.type(_ordered_like(v, child) for v, child in zip(value, children))
    return value


def _same_constant(a: object, b: object) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - exotic __eq__
        return a is b


def _shape_of(leaf: LeafSpec, value: torch.Tensor) -> tuple[int, ...]:
    """A tensor input's shape as LeafSpec writes it: its batch dimension as -1."""
    return tuple(-1 if d == leaf.batch_dim else n for d, n in enumerate(value.shape))
