"""What one aten kernel costs: its op class, its FLOPs and the bytes it moves.

The cost pass (fxpipe.passes.cost) counts every kernel of every node with these functions, and
the measured profile (fxpipe.profile.measure) counts its micro-benchmarks with the same ones, so a
rate measured in "FLOPs as counted here per second" applies to the counts of any model.

Op classes: matrix multiplications, attention, convolutions, recurrent layers, embeddings and
other gathers, reductions (including normalisations and softmax, which reduce along a
dimension), kernels that draw random numbers (dropout's mask), and element-wise kernels
(everything else: arithmetic, activations, copies, concatenation).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import torch
import torch.utils._pytree as pytree
from torch._ops import OpOverload
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ELEMENTWISE_FACTOR", "Count", "op_class", "is_free", "kernel_flops", "kernel_bytes",
           "draws_random", "KernelCounter"]

Count: TypeAlias = int | torch.SymInt
"""A count of elements, bytes or FLOPs: symbolic in the batch size on fake tensors."""
_Op: TypeAlias = OpOverload[..., Any]

# FLOPs per output element of kernels that torch's counter does not count (default 1).
ELEMENTWISE_FACTOR = {
    "native_layer_norm": 8, "native_layer_norm_backward": 12, "native_batch_norm": 8,
    "native_batch_norm_backward": 12, "_native_batch_norm_legit": 8,
    "_native_batch_norm_legit_functional": 8, "native_group_norm": 8,
    "native_group_norm_backward": 12, "_softmax": 5, "_softmax_backward_data": 4,
    "_log_softmax": 5, "_log_softmax_backward_data": 4, "gelu": 8, "gelu_backward": 12,
    "silu": 4, "silu_backward": 6, "sigmoid": 4, "tanh": 4, "exp": 2, "log": 2, "erf": 4,
    "native_dropout": 2, "bernoulli_": 2, "rsqrt": 2, "sqrt": 2, "pow": 2,
}
SDPA_CPU = "_scaled_dot_product_flash_attention_for_cpu"

_FREE_OPS = {torch.ops.aten.detach, torch.ops.aten.sym_size, torch.ops.aten.sym_numel,
             torch.ops.aten.sym_stride, torch.ops.aten.lift_fresh, torch.ops.aten._unsafe_view,
             torch.ops.aten._assert_tensor_metadata}

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation",
           "addmv", "mv", "dot", "vdot", "_int_mm", "_scaled_mm"}
# recurrent layers: a small matmul and the gates per time step, one step after another
_RECURRENT = {"mkldnn_rnn_layer", "mkldnn_rnn_layer_backward", "_thnn_fused_lstm_cell",
              "_thnn_fused_lstm_cell_backward_impl", "_thnn_fused_gru_cell",
              "_thnn_fused_gru_cell_backward", "_cudnn_rnn", "_cudnn_rnn_backward", "miopen_rnn",
              "miopen_rnn_backward"}
# drawing random numbers: a generator step per element, far slower than arithmetic on a CPU
_RANDOM = {"bernoulli", "native_dropout", "rand", "randn", "rand_like", "randn_like", "normal",
           "uniform", "randint", "randint_like", "randperm", "multinomial", "exponential",
           "geometric", "cauchy", "log_normal", "random"}
_EMBEDDING = {"embedding", "embedding_dense_backward", "embedding_backward", "_embedding_bag",
              "_embedding_bag_backward", "_embedding_bag_dense_backward", "index_select",
              "gather", "scatter_add", "index_add", "index_put", "index", "_index_put_impl"}
_REDUCTION = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "var_mean",
              "std_mean", "norm", "linalg_vector_norm", "logsumexp", "cumsum", "cumprod",
              "argmax", "argmin", "all", "any", "topk", "sort", "nll_loss_forward",
              "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward", "mse_loss",
              "mse_loss_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
              "native_layer_norm", "native_layer_norm_backward", "native_batch_norm",
              "native_batch_norm_backward", "_native_batch_norm_legit",
              "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
              "native_group_norm", "native_group_norm_backward", "_softmax",
              "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data",
              "binary_cross_entropy", "binary_cross_entropy_backward"}


def op_class(func: _Op) -> str:
    """The class of an aten kernel (one of fxpipe.profile.device.OP_CLASSES)."""
    name = func._overloadpacket.__name__
    if name.rstrip("_") in _RANDOM:
        return "random"
    if name in _MATMUL:
        return "matmul"
    if name in _RECURRENT:
        return "recurrent"
    if "scaled_dot_product" in name or "_attention" in name:
        return "attention"
    if "convolution" in name or name.startswith(("conv", "_slow_conv", "slow_conv")):
        return "convolution"
    if name.rstrip("_") in _EMBEDDING:
        return "embedding"
    if name.rstrip("_") in _REDUCTION:
        return "reduction"
    return "elementwise"


def is_free(func: _Op) -> bool:
    """Launches no kernel: views, detach, shape queries."""
    return func.namespace == "prim" or func.is_view or func._overloadpacket in _FREE_OPS


def kernel_flops(func: _Op, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Count:
    """FLOPs of one kernel: torch's formulas for matmul, convolution and attention (plus CPU
    flash attention, which torch's counter reports as 0); for every other kernel its largest
    tensor's elements times a per-op factor (ELEMENTWISE_FACTOR, default 1)."""
    packet = func._overloadpacket
    flops: Count
    if packet.__name__ in ("mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"):
        return _lstm_layer_flops(args, backward=packet.__name__.endswith("backward"))
    if packet in flop_counter.flop_registry:
        flops = flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)
        return flops
    name = packet.__name__
    # torch.utils.flop_counter's sdpa formulas are unannotated
    if name == SDPA_CPU:
        q, k, v = args[:3]
        flops = flop_counter.sdpa_flop_count(  # type: ignore[no-untyped-call]
            q.shape, k.shape, v.shape)
        return flops
    if name == SDPA_CPU + "_backward":
        grad_out, q, k, v = args[:4]
        flops = flop_counter.sdpa_backward_flop_count(  # type: ignore[no-untyped-call]
            grad_out.shape, q.shape, k.shape, v.shape)
        return flops
    largest = max((t.numel() for t in pytree.tree_leaves((args, out))
                   if isinstance(t, torch.Tensor)), default=0, key=_hint)
    return ELEMENTWISE_FACTOR.get(name, 1) * largest


def kernel_bytes(func: _Op, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Count:
    """Bytes a kernel reads and writes: its tensors, except that an embedding lookup reads only
    the rows it gathers (as many bytes as it writes), not its whole table."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
    if func._overloadpacket.__name__ == "embedding" and len(args) >= 2:
        indices: torch.Tensor = args[1]
        result: torch.Tensor = out
        written: Count = result.numel() * result.element_size()
        return 2 * written + indices.numel() * indices.element_size()
    total: Count = 0
    for t in tensors:
        total = total + t.numel() * t.element_size()
    return total


def _hint(x: Count) -> int:
    if isinstance(x, torch.SymInt):
        hint: int | None = x.node.hint
        return hint if hint is not None else 0
    return int(x)


def sequential_kernels(func: _Op, args: tuple[Any, ...]) -> int:
    """Kernels one call runs one after another: an LSTM layer, one per time step (each a
    small matmul and its element-wise gates, each paying a launch); 1 for everything else."""
    name = func._overloadpacket.__name__
    if name not in ("mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"):
        return 1
    x: torch.Tensor = args[0]
    batch_first = bool(args[21] if name.endswith("backward") else args[14])
    steps = x.shape[1] if batch_first else x.shape[0]
    return steps if isinstance(steps, int) and steps > 0 else 1


def _lstm_layer_flops(args: tuple[Any, ...], backward: bool) -> Count:
    """One LSTM layer over a sequence: the four gate matmuls per step (2*T*B*4H*(I+H)) plus
    about ten element-wise operations per hidden unit and step; backward is twice the matmuls
    (input and weight gradients) plus the element-wise part."""
    x: torch.Tensor = args[0]
    w_ih: torch.Tensor = args[1]
    w_hh: torch.Tensor = args[2]
    batch_first = bool(args[21] if backward else args[14])
    steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    four_h, inp = w_ih.shape
    hidden = w_hh.shape[1]
    matmul = 2 * steps * batch * four_h * (inp + hidden)
    pointwise = 10 * steps * batch * hidden
    return (2 * matmul if backward else matmul) + pointwise


def draws_random(func: _Op, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a kernel draws random numbers: tagged so by torch, and not a dropout (or an
    attention with dropout) that is inactive (p = 0, or not training), which draws nothing."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    values = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
              for i, a in enumerate(func._schema.arguments)}
    for name in ("p", "dropout_p"):
        if name in values and not values[name]:
            return False
    return values.get("train", values.get("training", True)) is not False


# TorchDispatchMode's __init_subclass__ and __init__ are unannotated in torch.
class KernelCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the FLOPs, bytes and kernels of every aten kernel that runs, per op class, and
    whether one drew random numbers. The cost pass counts on fake tensors (counts symbolic in
    the batch size) and the measured profile on real ones, with this one counter, so a rate
    measured in "FLOPs as counted here per second" applies to the counts of any model."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        # op class -> ([FLOPs], [bytes]) of its calls, in the order they ran
        self.by_class: dict[str, tuple[list[Count], list[Count]]] = {}
        # op class -> kernels its calls ran (more than calls where one call runs a sequence)
        self.launches: dict[str, int] = {}
        self.random = False  # a kernel drew random numbers (dropout, rand, bernoulli ...)

    def __torch_dispatch__(self, func: _Op, types: Sequence[type], args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.random = self.random or draws_random(func, args, kwargs)
        if not is_free(func):
            name = op_class(func)
            flops, nbytes = self.by_class.setdefault(name, ([], []))
            flops.append(kernel_flops(func, args, kwargs, out))
            nbytes.append(kernel_bytes(func, args, kwargs, out))
            self.launches[name] = self.launches.get(name, 0) + sequential_kernels(func, args)
        return out

    @property
    def flops(self) -> list[Count]:
        return [f for flops, _ in self.by_class.values() for f in flops]

    @property
    def bytes(self) -> list[Count]:
        return [b for _, nbytes in self.by_class.values() for b in nbytes]

    @property
    def kernels(self) -> int:
        return sum(self.launches.values())

    def totals(self, op_class: str) -> tuple[float, float, int]:
        """(FLOPs, bytes, kernels) of one op class, summed (real tensors only)."""
        flops, nbytes = self.by_class.get(op_class, ([], []))
        return float(sum(flops)), float(sum(nbytes)), self.launches.get(op_class, 0)
