"""Capture does no work twice: an exported graph takes its symbolic shapes from export's own
values (the same ir.TENSOR that propagating them again writes), and a meta model checked by
shapes runs on fake tensors a pinned number of times."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe import ir
from fxpipe.frontend import shapes
from fxpipe.frontend.capture import CaptureInfo, capture
from fxpipe.models import MODELS, gpt, load


class Padded(nn.Module):
    """F.pad's fake kernel specialises the batch: propagation samples it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.pad(x, (1, 1)))


def _transformers(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, bool]]:
    transformers = pytest.importorskip("transformers")
    if name == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=64,
                                       vocab_size=128, max_position_embeddings=64,
                                       bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128,
                                      n_positions=64, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(128, (4, 16), generator=torch.Generator().manual_seed(0))
    return model, (ids,), {"use_cache": False}


def _cases() -> list[tuple[str, bool]]:
    """Each model in eval mode; in train mode those whose graph differs there (dropout,
    BatchNorm's batch statistics)."""
    names = (*MODELS, "llama", "gpt2", "padded", "input_grad")
    return [(name, False) for name in names] + [(name, True) for name in ("gpt2", "resnet")]


def _model(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, bool]]:
    if name in ("llama", "gpt2"):
        return _transformers(name)
    if name == "padded":
        return Padded(), (torch.randn(4, 8),), {}
    if name == "input_grad":
        x = torch.randn(4, 8, requires_grad=True)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh()), (x,), {}
    model, inputs, kwargs = load(name)
    return model, inputs, kwargs


@pytest.mark.parametrize(("name", "training"), _cases())
def test_export_shapes_are_the_propagated_ones(name: str, training: bool) -> None:
    model, inputs, kwargs = _model(name)
    model.train(training)
    gm = capture(model, inputs, kwargs, method="export", inline_modules=True)
    info: CaptureInfo = gm.meta[ir.CAPTURE]
    dims = info.signature.input_batch_dims
    from_export = {n.name: n.meta[ir.TENSOR] for n in gm.graph.nodes if n.op != "output"}
    sampled = gm.meta[ir.SAMPLED]
    used_export = shapes.export_infos(gm, dims) is not None
    assert used_export == (name != "recurrent"), "an LSTM's values are run again"
    shapes.propagate_shapes(gm, info.signature.flatten_inputs(inputs, kwargs), dims)
    propagated = {n.name: n.meta[ir.TENSOR] for n in gm.graph.nodes if n.op != "output"}
    assert from_export == propagated
    assert sampled == gm.meta[ir.SAMPLED]
    assert info.fake_runs == (1 if used_export else 2)  # export's trace (and propagation)


def _meta_gpt() -> nn.Module:
    with torch.device("meta"):
        return gpt.GPT(vocab_size=512, seq_len=32, d_model=64, n_layer=2, n_head=4, dropout=0.0)


# The eager run on the example batch and on its first half (the batch layout: the second half of
# an even batch has the first's shapes, and meta tensors have nothing else), and export's trace.
# The graph's output shapes are checked from export's symbolic values, which also give every
# node's shapes; nothing else runs the model or the graph on fake tensors.
META_SHAPES_RUNS = 3


def test_meta_model_checked_by_shapes_runs_a_pinned_number_of_times() -> None:
    idx = torch.zeros(8, 32, dtype=torch.long)
    gm = capture(_meta_gpt().eval(), (idx,), method="export", check="shapes",
                 inline_modules=True)
    assert gm.meta[ir.CAPTURE].fake_runs == META_SHAPES_RUNS
    program = fxpipe.compile(_meta_gpt().eval(), (idx,), stages=2, chunks=2, check="shapes",
                             capture="export")
    assert program.built.capture_info.fake_runs == META_SHAPES_RUNS


def test_meta_shape_check_still_refuses_a_wrong_output_shape() -> None:
    from fxpipe.frontend.batching import BatchLayout, infer_batch_layout
    from fxpipe.frontend.check import compare_shapes

    gm = capture(_meta_gpt().eval(), (torch.zeros(8, 32, dtype=torch.long),), method="export",
                 check="shapes", inline_modules=True)
    layout: BatchLayout = infer_batch_layout(
        _meta_gpt().eval(), (torch.zeros(8, 32, dtype=torch.long, device="meta"),), {},
        [torch.zeros(8, 32, dtype=torch.long, device="meta")], [0])
    infos = {n: n.meta[ir.TENSOR] for n in gm.graph.nodes if n.op != "output"}
    assert compare_shapes(gm, infos, layout) is None
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    info = infos[out]
    infos[out] = ir.TensorInfo((info.shape[0], info.shape[1], info.shape[2] + 1), info.dtype,
                               info.batch_dim)
    assert "has shape" in str(compare_shapes(gm, infos, layout))
    infos[out] = ir.TensorInfo(info.shape, torch.float16, info.batch_dim)
    assert "dtype" in str(compare_shapes(gm, infos, layout))


def test_meta_model_traced_by_fx_is_checked_by_its_propagated_shapes() -> None:
    # The eager runs of the batch layout (2) and one propagation of shapes, which both checks
    # the graph's output shapes on the example batch and on its half and writes ir.TENSOR.
    idx = torch.zeros(8, 32, dtype=torch.long)
    gm = capture(_meta_gpt().eval(), (idx,), method="fx", check="shapes", inline_modules=True)
    assert gm.meta[ir.CAPTURE].fake_runs == 3
    real = capture(gpt.GPT(vocab_size=512, seq_len=32, d_model=64, n_layer=2, n_head=4,
                           dropout=0.0).eval(), (idx,), method="fx", inline_modules=True)

    def tensors(g: torch.fx.GraphModule) -> list[ir.TensorInfo]:  # (devices differ: meta, cpu)
        return [n.meta[ir.TENSOR] for n in g.graph.nodes if n.op != "output"
                and isinstance(n.meta[ir.TENSOR], ir.TensorInfo)]

    assert len(tensors(gm)) > 10 and tensors(gm) == tensors(real)


def test_meta_fx_check_by_shapes_refuses_a_graph_that_fails_on_the_batch() -> None:
    from fxpipe.frontend import capture as capture_module

    idx = torch.zeros(8, 32, dtype=torch.long)
    gm = capture(_meta_gpt().eval(), (idx,), method="fx", check="shapes", inline_modules=True)
    info: CaptureInfo = gm.meta[ir.CAPTURE]
    layout = capture_module.infer_batch_layout(
        _meta_gpt().eval(), (idx.to("meta"),), {}, [idx.to("meta")], [0])
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):  # a graph whose output has another shape
        wrong = gm.graph.call_function(torch.ops.aten.sum.dim_IntList, (out.args[0][0], [2]))
    out.args = ((wrong, *out.args[0][1:]),)
    gm.recompile()
    tensors = [idx.to("meta")]
    problem = capture_module._check_by_shapes(gm, tensors, info.signature, layout,
                                              capture_module._Runs())
    assert problem is not None and "has shape" in problem
