"""Training losses: the default one, the names a written program uses for them, and the time the
last stage spends on the loss (the partition counts it)."""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.fx import GraphModule

from fxpipe import ir
from fxpipe.errors import ConfigError, LossError
from fxpipe.profile import DeviceProfile, median_time

__all__ = ["default_loss", "loss_of", "needs_target", "loss_name", "resolve_loss",
           "loss_function", "loss_time",
           "loss_saved_bytes", "NAMED", "LossFn", "counted", "IGNORED"]

LossFn = Callable[..., torch.Tensor]


def default_loss(output: Any, target: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy for integer targets, mean squared error for float targets, and without a
    target the mean of squares of every floating-point output.

    The first floating-point tensor of the output is the prediction (logits over its last
    dimension for cross-entropy, or over dimension 1 when the target has the prediction's shape
    without that one: `_refuse_class_dimension`). Every variant is a mean over the batch, so
    micro-batch losses weighted by their share of the batch add up to the full-batch loss.
    """
    floats = [t for t in pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise TypeError("the model output has no floating-point tensor to compute a loss on")
    if target is None:
        squares = [t.float().square().mean() for t in floats]
        total = squares[0]
        for square in squares[1:]:
            total = total + square
        return total
    prediction = floats[0]
    try:
        floating = target.is_floating_point()
    except AttributeError:
        raise LossError(f"the built-in losses take one target tensor, and the target is a "
                        f"{type(target).__name__}",
                        hint="pass loss_fn=, a function of (outputs, target) that reads the "
                             "target's parts") from None
    if floating:
        return F.mse_loss(prediction, target)
    shape, wanted = prediction.shape, target.shape
    last = wanted == shape[:-1]  # compared inline: the last stage runs this per micro-batch
    second = wanted == shape[:1] + shape[2:] and len(shape) > 2
    if last != second:  # one reading fits: classes last, or in dim 1 as torch reads them
        return F.cross_entropy(prediction.reshape(-1, shape[-1]), target.reshape(-1)) if last \
            else F.cross_entropy(prediction, target)
    _refuse_class_dimension(prediction, target, ambiguous=last)
    return _classes_last(prediction, target)  # a target with one entry per row, flattened


def _classes_last(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(prediction.reshape(-1, prediction.shape[-1]), target.reshape(-1))


def _refuse_class_dimension(prediction: torch.Tensor, target: torch.Tensor,
                            ambiguous: bool) -> None:
    """Where cross-entropy finds the classes: the prediction's last dimension (a language
    model's [batch, tokens, vocabulary] against [batch, tokens], or any target with one entry
    per row of it), or dimension 1 as torch's F.cross_entropy does, when the target has the
    prediction's shape without it and not without the last (a segmentation's [N, C, H, W]
    against [N, H, W]). Raises for a shape that fits both (every dimension but the batch's
    alike: either reading would be a guess) or neither."""
    shape, wanted = tuple(prediction.shape), tuple(target.shape)
    if ambiguous:
        raise LossError(
            f"cross-entropy cannot tell the class dimension of a prediction of shape {shape} "
            f"against a target of shape {wanted}: it could be the last (a language model's "
            f"vocabulary) or dimension 1 (torch's F.cross_entropy)",
            hint="pass loss_fn=torch.nn.functional.cross_entropy for classes in dimension 1, "
                 "or loss_fn=lambda out, t: torch.nn.functional.cross_entropy(out.flatten(0, "
                 "-2), t.flatten()) for the last")
    if target.numel() * shape[-1] != prediction.numel():
        raise LossError(
            f"cross-entropy takes a target with one class index per row of the prediction: "
            f"the prediction has shape {shape}, so the target's shape is {shape[:-1]} (classes "
            f"in the last dimension)"
            + (f" or {shape[:1] + shape[2:]} (classes in dimension 1, as torch's "
               f"F.cross_entropy)" if prediction.dim() > 2 else "")
            + f", but it is {wanted}",
            hint="pass targets of that shape, or loss_fn= a function of (outputs, target)")


def loss_of(loss_fn: LossFn, output: Any, target: torch.Tensor | None) -> torch.Tensor:
    """`loss_fn(output, target)` (without a target: `loss_fn(output)`), refused unless it is one
    floating-point number in a tensor: what backward starts from, and what micro-batch losses
    add up to (autograd's own errors name neither the loss function nor what it returned)."""
    try:
        loss = loss_fn(output, target) if target is not None else loss_fn(output)
    except TypeError as error:
        if target is not None or not needs_target(loss_fn):
            raise
        raise LossError(f"the loss function {_name(loss_fn)} takes a target, and the step was "
                        "given none",
                        hint="pass the batch's targets: program.step(inputs, target=y)") \
            from error
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    what = f"a {loss.dtype} tensor of shape {tuple(loss.shape)}" \
        if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
    raise LossError(f"the loss function {_name(loss_fn)} returned {what}; a step needs one "
                    "floating-point number in a tensor, the loss of the batch it was given",
                    hint="return a mean or a sum over the examples (e.g. reduction='mean', or "
                         ".mean()), and only the loss (log the rest outside the loss function)")


def _name(loss_fn: LossFn) -> str:
    """How a message names a loss function (a function's name, else its class's)."""
    return getattr(loss_fn, "__name__", type(loss_fn).__name__)


def needs_target(loss_fn: LossFn) -> bool:
    """Whether `loss_fn` cannot be called with the output alone (as a step without a target
    calls it); False where its signature cannot be read."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return False
    try:
        signature.bind(None)
    except TypeError:
        return True
    return False


def _cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    return default_loss(output, target.long() if isinstance(target, torch.Tensor) else target)


def _mse(output: Any, target: torch.Tensor) -> torch.Tensor:
    return default_loss(output, target.float() if isinstance(target, torch.Tensor) else target)


NAMED = {"default": default_loss, "cross_entropy": _cross_entropy, "mse": _mse}

IGNORED = -100  # cross-entropy's ignore_index: a target it leaves out of its mean


def counted(loss_fn: Any, target: torch.Tensor | None) -> torch.Tensor | None:
    """How many targets a loss of NAMED averages over, as a 0-dim tensor on the target's device
    (no host read): cross-entropy leaves out those equal to IGNORED. None where it averages
    over every element alike (mean squared error, no target), or for a loss not in NAMED.
    Each of them is a mean over what it counts, so on a batch joined from parts it is the
    parts' losses weighted by their counts."""
    if target is None:
        return None
    try:
        if loss_fn is _cross_entropy or \
                (loss_fn is default_loss and not target.is_floating_point()):
            return (target != IGNORED).sum()
    except AttributeError:  # a structured target, which the built-in losses refuse
        pass
    return None


def loss_name(loss_fn: Any) -> str:
    """How a written program refers to a loss: a name above, or "module:function"."""
    if loss_fn is None:
        return "default"
    if isinstance(loss_fn, str):
        resolve_loss(loss_fn)
        return loss_fn
    for name, fn in NAMED.items():
        if fn is loss_fn:
            return name
    module, qualname = getattr(loss_fn, "__module__", None), getattr(loss_fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ConfigError(f"loss_fn {qualname or repr(loss_fn)} cannot be imported by the "
                          f"written program: {_unimportable(module, qualname)}",
                          hint="define it at module level of a module beside your script (e.g. "
                               "losses.py) and import it from there, or pass one of "
                               f"{sorted(NAMED)}")
    return f"{module}:{qualname}"


def _unimportable(module: str | None, qualname: str) -> str:
    """Why a function has no module:name the written program could import it by."""
    if "<lambda>" in qualname:
        return "it is a lambda, which has no name"
    if "<locals>" in qualname:
        return f"it is defined inside {qualname.split('.<locals>')[0]}()"
    if module == "__main__":
        script = getattr(sys.modules.get("__main__"), "__file__", None)
        where = f" ({os.path.basename(script)})" if script else ""
        return (f"it is defined in the script being run{where}, which the program would run "
                "again to import it")
    return "it names no module"


def resolve_loss(name: str) -> Any:
    """The loss function a written program names (see loss_name)."""
    if name in NAMED:
        return NAMED[name]
    module, _, qualname = name.partition(":")
    if not qualname:
        raise ConfigError(f"unknown loss {name!r}",
                          hint=f"use one of {sorted(NAMED)} or module:function")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def loss_function(loss_fn: LossFn | str | None) -> LossFn:
    """The loss a step runs: a function as given, a name of NAMED resolved, None the default."""
    resolved: LossFn = resolve_loss(loss_fn) if isinstance(loss_fn, str) else \
        loss_fn or default_loss
    return resolved


def _prediction(gm: GraphModule) -> ir.TensorInfo | None:
    """The output the default loss reads: the first floating-point one (not a complex one,
    which default_loss leaves out too)."""
    outputs = next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes
    infos = [n.meta.get(ir.TENSOR) for n in outputs]
    return next((i for i in infos if isinstance(i, ir.TensorInfo)
                 and i.dtype.is_floating_point), None)


def loss_saved_bytes(gm: GraphModule, b: int) -> float:
    """Bytes the default loss keeps for its backward per micro-batch of size b, as loss_time
    assumes it (cross-entropy over the last dimension of the first floating output): the last
    stage holds them from the micro-batch's forward to its backward, beside its activations.
    Found on the meta device with autograd's saved-tensor hooks, each storage once."""
    info = _prediction(gm)
    if info is None:
        return 0.0
    shape = info.concrete_shape(b)
    logits = torch.empty(shape, dtype=info.dtype, device="meta", requires_grad=True)
    target = torch.zeros(shape[:-1], dtype=torch.long, device="meta") if len(shape) > 1 else None
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if target is None:
            default_loss(logits)
        else:  # the classes where the estimate assumes them, whatever the shapes look like
            _classes_last(logits, target)
    return float(sum(saved.values()))


def loss_time(gm: GraphModule, b: int, profile: DeviceProfile, measured: bool,
              device: torch.device | None = None) -> float:
    """Seconds per micro-batch of the default loss on the first floating output (forward and
    backward): the last stage runs it after the model, so the partition must count it.
    Measured on `device` (where the last stage runs; default the CPU) in the output's dtype."""
    info = _prediction(gm)
    if info is None:
        return 0.0
    shape = info.concrete_shape(b)
    if measured:
        device = device or torch.device("cpu")
        logits = torch.randn(shape, device=device, dtype=info.dtype, requires_grad=True)
        target = torch.zeros(shape[:-1], dtype=torch.long, device=device) \
            if len(shape) > 1 else None

        def run() -> None:
            torch.autograd.backward(default_loss(logits) if target is None
                                    else _classes_last(logits, target))
            if device.type == "cuda":  # the kernels are asynchronous: time them, not the launch
                torch.cuda.synchronize(device)

        return median_time(run, warmup=2, repeat=5)
    numel = float(ir.evaluate(info.numel, b))
    # log-softmax, gather and mean forward; their gradients backward: ~3 kernels each way
    return 2 * profile.compute_time(6 * numel, 3 * numel * info.dtype.itemsize, kernels=3)
