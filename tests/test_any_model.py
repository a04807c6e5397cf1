"""Plain-torch models that stand for the ways third-party models broke fxpipe, one per class.

Each test is the smallest model that failed the way a zoo model did (tests/zoo_models.py):

1. A size taken in one stage and used in a later one was frozen at the full batch: fake kernels
   of constant padding and interpolation specialise the batch symbol (NOTE [Specialising
   kernels] in fxpipe.frontend.shapes); Swin windows, CrossViT's class token, UNets, VAEs.
2. A wrapped function whose module is shadowed by the function itself (torchvision.ops.
   stochastic_depth): the generated code must reach the function by a path that resolves to it.
3. Two identical LSTM calls: the second hit the cost cache, which reran aten.lstm on symbolic
   fakes.
4. A written program whose model returns a registered output type must load its signature in a
   fresh process.
5. BatchNorm: a subclass with its own forward (timm's BatchNormAct2d) must keep it in the fx
   trace; momentum=None must train; a stacked LSTM must not stay one operation.
6. nn.Transformer with a causal mask: its own mask check is data-dependent under export.
7. A module converted inside forward (`self.classifier.to(dtype)`) while export traces.

The last part checks each fix from another side (the specialisation found without the list of
known operations, by the cost pass alone, a frozen size refused by ir.verify, ...).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe import ir


def _assert_pipeline_matches(model: nn.Module, x: torch.Tensor, **options) -> fxpipe.Program:
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, **options)
    with torch.no_grad():
        torch.testing.assert_close(program(x), model(x))
    return program


def _grads_match_microbatches(model: nn.Module, x: torch.Tensor, chunks: int = 2) -> None:
    """Gradients through the pipeline equal the plain model's over the same micro-batches."""
    reference = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=2, chunks=chunks)
    program(x).square().sum().backward()
    for part in x.chunk(chunks):
        reference(part).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


# --- 1. sizes that cross stages -------------------------------------------------------------------

class _PaddedWindows(nn.Module):
    """Swin-style: B, H, W, C = x.shape; pad to a window multiple; reshape(B, ...) later."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        h = F.pad(self.norm(x), (0, 0, 0, 1, 0, 1))[:, :H, :W]
        h = self.proj(h)
        return self.head(h.reshape(B, H * W, C))


def test_size_of_padded_input_used_in_a_later_stage_follows_the_microbatch():
    x = torch.randn(4, 4, 4, 8)
    _assert_pipeline_matches(_PaddedWindows().eval(), x, split_points=["proj"])


class _UpsampleThenTokens(nn.Module):
    """Decoder-style: upsample, then flatten to tokens with the batch size read before it; the
    shape check keeps fx out, so this goes through torch.export."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:  # a Python branch on a shape: export captures it, fx cannot
            x = x[..., :-1]
        b = x.shape[0]
        h = F.interpolate(self.conv(x), scale_factor=2.0, mode="nearest").reshape(b, 4, -1)
        return self.proj(h.transpose(1, 2)).reshape(b, -1)


def test_batch_size_read_before_interpolate_follows_the_microbatch_under_export():
    x = torch.randn(4, 4, 6, 6)
    program = _assert_pipeline_matches(_UpsampleThenTokens().eval(), x, split_points=["proj"])
    assert program.graph_module.meta[ir.CAPTURE].method == "export"


def test_shapes_stay_symbolic_in_the_batch_after_padding():
    x = torch.randn(4, 4, 4, 8)
    gm = fxpipe.capture(_PaddedWindows().eval(), (x,), inline_modules=True)
    output = next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes[0]
    assert ir.BATCH in output.meta[ir.TENSOR].shape[0].free_symbols


# --- 2. a callee whose qualified name is shadowed -------------------------------------------------

_SHADOWED = '''
"""Like torchvision.ops.stochastic_depth: the package re-exports the function under the name of
the module that defines it, and torch.fx.wrap keeps it a single call."""
import torch
import torch.fx
from torch import nn


def stochastic_depth(x, p, training):
    if not training or p == 0.0:
        return x
    keep = torch.empty([x.shape[0]] + [1] * (x.dim() - 1)).bernoulli_(1 - p)
    return x * keep / (1 - p)


torch.fx.wrap("stochastic_depth")


class StochasticDepth(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        return stochastic_depth(x, self.p, self.training)
'''


@pytest.fixture
def shadowing_package(tmp_path, monkeypatch):
    package = tmp_path / "shadowpkg"
    package.mkdir()
    (package / "stochastic_depth.py").write_text(_SHADOWED)
    (package / "__init__.py").write_text(
        "from .stochastic_depth import StochasticDepth, stochastic_depth\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    yield importlib.import_module("shadowpkg")
    for name in ("shadowpkg", "shadowpkg.stochastic_depth"):
        sys.modules.pop(name, None)


def test_wrapped_function_whose_module_is_shadowed_by_it_runs_in_the_stage(shadowing_package):
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.drop = shadowing_package.StochasticDepth(0.0)
            self.b = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(x + self.drop(self.a(x)))

    _assert_pipeline_matches(Residual().eval(), torch.randn(4, 8))


# --- 3. functional RNN ops with symbolic sizes ----------------------------------------------------

class _TwoLSTMs(nn.Module):
    """Two LSTM layers of the same shape after a projection (an encoder and a decoder stack)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.encoder = nn.LSTM(16, 16, num_layers=2, batch_first=True)
        self.decoder = nn.LSTM(16, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.encoder(self.embed(x))
        h, _ = self.decoder(h)
        return self.head(h)


def test_identical_lstm_layers_are_costed():
    _assert_pipeline_matches(_TwoLSTMs().eval(), torch.randn(4, 6, 8))


# --- 4. written programs of models with structured outputs ----------------------------------------

_OUTPUT_TYPE = '''
"""A library output type registered with pytree, as transformers registers its ModelOutputs."""
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree


@dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


pytree.register_pytree_node(
    Output, lambda o: ([o.logits, o.hidden], None), lambda values, _: Output(*values),
    serialized_type_name="outlib.Output")
'''


def test_written_program_of_a_model_with_a_registered_output_type_runs(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "outlib.py").write_text(_OUTPUT_TYPE)
    monkeypatch.syspath_prepend(str(lib))
    import importlib

    outlib = importlib.import_module("outlib")

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(8, 16)
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor):
            hidden = torch.tanh(self.body(x))
            return outlib.Output(self.head(hidden), hidden)

    try:
        model, x = Tagger(), torch.randn(4, 8)
        program = fxpipe.compile(model, (x,), stages=2, chunks=2)
        assert isinstance(program(x), outlib.Output)
        out = tmp_path / "program"
        program.write(str(out))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(lib), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, str(out / "program.py"), "--steps", "1"],
                              capture_output=True, text=True, env=env, timeout=300,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
    finally:
        sys.modules.pop("outlib", None)


# --- 5. BatchNorm and recurrent layers in training ------------------------------------------------

class _BatchNormReLU(nn.BatchNorm2d):
    """timm's BatchNormAct2d in two lines: a BatchNorm2d subclass whose forward adds more."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(x))


def _conv_net(norm: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm, nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))


def test_batchnorm_subclass_with_its_own_forward_keeps_the_fx_capture():
    model = _conv_net(_BatchNormReLU(8)).train()
    x = torch.randn(4, 3, 8, 8)
    gm = fxpipe.capture(model, (x,), inline_modules=True)
    info = gm.meta[ir.CAPTURE]
    assert info.method == "fx", info.fallback_reason


def test_batchnorm_with_cumulative_average_trains_like_the_plain_model():
    _grads_match_microbatches(_conv_net(nn.BatchNorm2d(8, momentum=None)).train(),
                              torch.randn(4, 3, 8, 8))


def test_stacked_lstm_is_split_into_balanced_stages():
    class Stacked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(16, 256)
            self.lstm = nn.LSTM(256, 256, num_layers=4, batch_first=True)
            self.head = nn.Linear(256, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.lstm(self.embed(x))[0])

    # large enough that compute outweighs the messages a cut between layers adds (the solver
    # charges each message its measured latency: a tiny LSTM is rightly kept in one stage)
    program = fxpipe.compile(Stacked().train(), (torch.randn(8, 24, 16),), stages=2, chunks=2)
    times = [stage.time for stage in program.plan.stages]
    assert max(times) / min(times) < 1.5, times


# --- 6. torch's own data-dependent checks ---------------------------------------------------------

class _CausalSeq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.transformer = nn.Transformer(16, 2, num_encoder_layers=1, num_decoder_layers=1,
                                          dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 50)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.head(self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask))


def test_transformer_with_a_causal_mask_is_captured():
    model = _CausalSeq2Seq().eval()
    src, tgt = torch.randint(0, 50, (4, 7)), torch.randint(0, 50, (4, 5))
    program = fxpipe.compile(model, (src, tgt), stages=2, chunks=2)
    with torch.no_grad():
        torch.testing.assert_close(program(src, tgt), model(src, tgt))


# --- 7. modules converted inside forward ----------------------------------------------------------

class _Router(nn.Module):
    """As SwitchTransformersTop1Router: converts its classifier to a dtype in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(8, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 8:  # a shape check: fx cannot trace it, so export must
            raise ValueError("expected 8 features")
        self.classifier = self.classifier.to(torch.float32)
        return self.head(self.classifier(x))


def test_module_converted_to_its_own_dtype_inside_forward_is_captured():
    _assert_pipeline_matches(_Router().eval(), torch.randn(4, 8))


# --- the fixes, each from another side ------------------------------------------------------------

def test_an_operation_that_specialises_the_batch_is_found_without_the_list_of_known_ones(
        monkeypatch):
    from fxpipe.frontend import shapes

    monkeypatch.setattr(shapes, "known_specialising", lambda key: False)
    gm = fxpipe.capture(_PaddedWindows().eval(), (torch.randn(4, 4, 4, 8),), inline_modules=True)
    assert F.pad in gm.meta[ir.SAMPLED]
    output = next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes[0]
    assert ir.BATCH in output.meta[ir.TENSOR].shape[0].free_symbols


def test_the_cost_pass_finds_an_operation_that_specialises_the_batch_by_itself():
    from fxpipe.passes.cost import annotate_costs

    gm = fxpipe.capture(_PaddedWindows().eval(), (torch.randn(4, 4, 4, 8),), inline_modules=True)
    gm.meta[ir.SAMPLED] = frozenset()  # as if capture had not found it
    annotate_costs(gm)
    head = next(n for n in gm.graph.nodes if n.name == "head")
    assert ir.BATCH in ir.cost(head).fwd_flops.free_symbols  # not frozen at the example's 4


def test_verify_rejects_an_output_whose_batch_size_is_frozen():
    from fxpipe.errors import InvariantError

    gm = fxpipe.capture(_PaddedWindows().eval(), (torch.randn(4, 4, 4, 8),), inline_modules=True)
    ir.verify(gm, after="capture")
    output = next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes[0]
    info = output.meta[ir.TENSOR]
    output.meta[ir.TENSOR] = ir.TensorInfo((4, *info.shape[1:]), info.dtype, None)
    with pytest.raises(InvariantError, match="batch dimension 0"):
        ir.verify(gm, after="capture")


@pytest.fixture
def hidden_module_package(tmp_path, monkeypatch):
    """The function's module is shadowed and no package attribute holds the function."""
    package = tmp_path / "hiddenpkg"
    package.mkdir()
    (package / "stochastic_depth.py").write_text(_SHADOWED)
    (package / "__init__.py").write_text(
        "from . import stochastic_depth as _impl\n"
        "StochasticDepth = _impl.StochasticDepth\n"
        "stochastic_depth = None  # shadows the module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    yield importlib.import_module("hiddenpkg")
    for name in ("hiddenpkg", "hiddenpkg.stochastic_depth"):
        sys.modules.pop(name, None)


def test_wrapped_function_whose_module_is_shadowed_by_another_value_runs_in_the_stage(
        hidden_module_package):
    model = nn.Sequential(nn.Linear(8, 8), hidden_module_package.StochasticDepth(0.0),
                          nn.Linear(8, 8)).eval()
    program = _assert_pipeline_matches(model, torch.randn(4, 8))
    source = "\n".join(stage.source for stage in program.built.stages)
    assert "from hiddenpkg.stochastic_depth import stochastic_depth as" in source


def test_batchnorm_with_cumulative_average_keeps_the_statistics_of_the_microbatches():
    model = _conv_net(nn.BatchNorm2d(8, momentum=None)).train()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)
    fxpipe.compile(model, (x,), stages=2, chunks=2)(x)
    for part in x.chunk(2):
        plain(part)
    for (name, ours), theirs in zip(model[1].state_dict().items(), plain[1].state_dict().values()):
        torch.testing.assert_close(ours, theirs, msg=name)


def test_deferring_a_cumulative_average_batchnorm_is_refused_with_a_fix():
    from fxpipe.errors import ConfigError

    model = _conv_net(nn.BatchNorm2d(8, momentum=None)).train()
    with pytest.raises(ConfigError, match="set a momentum"):
        fxpipe.compile(model, (torch.randn(4, 3, 8, 8),), stages=2, chunks=2,
                       deferred_batch_norm=True).build(torch.randn(4, 3, 8, 8))


def test_stacked_lstm_with_dropout_between_layers_trains_like_the_plain_model():
    from fxpipe.testing.reference_step import reference_step

    class Stacked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(8, 16, num_layers=3, dropout=0.3, batch_first=True,
                                bidirectional=True)
            self.head = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.lstm(x)[0])

    model = Stacked().train()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 5, 8)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    assert len([n for n in program.graph_module.graph.nodes
                if n.target is torch.ops.aten.lstm.input]) == 3
    torch.manual_seed(3)
    loss = program.step(x)
    torch.manual_seed(3)
    assert loss == pytest.approx(reference_step(program, plain, x), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_transformer_encoder_layers_are_split_into_balanced_stages():
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.TransformerEncoder(layer, 4), nn.Linear(32, 4))
    program = fxpipe.compile(model.train(), (torch.randn(4, 6, 8),), stages=2, chunks=2)
    times = [stage.time for stage in program.plan.stages]
    assert max(times) / min(times) < 1.5, times
