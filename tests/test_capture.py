"""fxpipe.capture: any model to a checked GraphModule with symbolic shapes."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import sympy
import torch
from torch import nn

import fxpipe
from fxpipe import ir
from fxpipe.errors import CaptureError, ConfigError, RuntimeInputError
from fxpipe.models import MODELS
from fxpipe.models import load as load_model
from fxpipe.testing.reference_step import reference_step
from fxpipe.untouched import seeded


def _load(name):
    model, inputs, kwargs = load_model(name)
    return model, inputs, kwargs


def _assert_same(gm, model, inputs, kwargs):
    with seeded(1):
        expected = model(*inputs, **kwargs)
    with seeded(1):
        got = gm(*inputs, **kwargs)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("inline", [False, True], ids=["modules", "functional"])
@pytest.mark.parametrize("name", MODELS)
def test_capture_reproduces_every_reference_model(name, inline):
    model, inputs, kwargs = _load(name)
    gm = fxpipe.capture(model, inputs, kwargs, inline_modules=inline)
    _assert_same(gm, model, inputs, kwargs)
    info = gm.meta[ir.CAPTURE]
    assert info.method == ("export" if name == "recurrent" else "fx")
    assert info.training is True
    # the batch dimension of every input and output
    expected_dim = 1 if name == "recurrent" else 0
    assert set(info.signature.input_batch_dims) == {expected_dim}
    assert set(info.signature.out_batch_dims) == {expected_dim}


@pytest.mark.parametrize("name", MODELS)
def test_captured_graph_runs_at_another_batch_size(name):
    model, inputs, kwargs = _load(name)
    gm = fxpipe.capture(model, inputs, kwargs, inline_modules=True)
    layout_dim = 1 if name == "recurrent" else 0
    small = tuple(x.narrow(layout_dim, 0, 3) for x in inputs)
    small_kwargs = {k: v.narrow(layout_dim, 0, 3) for k, v in kwargs.items()}
    _assert_same(gm, model, small, small_kwargs)


def test_every_value_gets_a_symbolic_tensor_info():
    model, inputs, _ = _load("gpt")
    gm = fxpipe.capture(model, inputs, inline_modules=True)
    b = ir.BATCH
    seen_batched = 0
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        info = ir.value_info(node)
        if isinstance(info, ir.TensorInfo):
            if info.batch_dim is not None:
                seen_batched += 1
                assert b in info.shape[info.batch_dim].free_symbols
            if node.op == "get_attr":
                assert info.batch_dim is None
    logits = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert ir.tensor_info(logits).shape == (b, sympy.Integer(32), sympy.Integer(512))
    assert seen_batched > 10


def test_module_level_capture_calls_submodules_by_qualified_name():
    model, inputs, _ = _load("mlp")
    gm = fxpipe.capture(model, inputs, method="fx")
    targets = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert "blocks.0.fc1" in targets and "head" in targets


def test_functional_capture_keeps_parameters_of_the_model():
    model, inputs, _ = _load("gpt")
    gm = fxpipe.capture(model, inputs, inline_modules=True)
    params = {id(p) for p in model.parameters()}
    assert {id(p) for p in gm.parameters()} <= params
    # tied embedding / head: one parameter, one get_attr
    attrs = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert sum(gm.get_parameter(t) is model.wte.weight for t in attrs) == 1


def test_gradients_of_the_captured_graph_reach_the_model_parameters():
    model, inputs, _ = _load("mlp")
    gm = fxpipe.capture(model, inputs, inline_modules=True)
    gm(*inputs).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_capture_restores_batchnorm_statistics_and_mode():
    model, inputs, _ = _load("resnet")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fxpipe.capture(model, inputs, inline_modules=True)
    after = model.state_dict()
    assert model.training
    for k, v in before.items():
        assert torch.equal(v, after[k]), k


def test_capture_records_eval_mode():
    model, inputs, _ = _load("gpt")
    model.eval()
    gm = fxpipe.capture(model, inputs, inline_modules=True)
    assert gm.meta[ir.CAPTURE].training is False
    _assert_same(gm, model, inputs, {})


class _Hooked(nn.Module):
    """A skip connection carried by a forward hook on a leaf module: fx does not run hooks of
    the modules it keeps as leaves, so the trace silently drops the skip."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mid, self.dec = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(8, 4)
        self.skips: list[torch.Tensor] = []
        self.enc.register_forward_hook(lambda m, i, o: self.skips.append(o))

    def forward(self, x):
        h = self.mid(self.enc(x))
        skip = self.skips.pop() if self.skips else torch.zeros_like(h)
        return self.dec(torch.cat([h, skip], -1))


def test_auto_falls_back_to_export_when_the_fx_trace_is_wrong():
    model, x = _Hooked(), torch.randn(6, 4)
    gm = fxpipe.capture(model, (x,))
    info = gm.meta[ir.CAPTURE]
    assert info.method == "export"
    assert "differs" in info.fallback_reason
    _assert_same(gm, model, (x,), {})


class _ShapeBranch(nn.Module):
    """Python control flow on a shape: torch.fx cannot trace it, torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) if x.shape[-1] == 4 else h


def test_the_report_says_which_front_end_captured_the_model_and_why():
    x = torch.randn(6, 4)
    fx_line = fxpipe.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (x,), stages=2,
                             chunks=2).report().capture
    assert fx_line == "captured with fx; checked: values against the eager model"
    report = fxpipe.compile(_ShapeBranch(), (x,), stages=2, chunks=2).report()
    assert report.capture is not None and report.capture.startswith(
        "captured with export (the fx trace was not kept: torch.fx cannot trace _ShapeBranch")
    assert f"capture: {report.capture}" in str(report)
    assert report.json()["capture"] == report.capture


def test_leaf_modules_the_export_fallback_traced_through_are_warned_of_and_reported():
    model, x = _Hooked(), torch.randn(6, 4)
    with pytest.warns(UserWarning, match=r"leaf_modules \(Linear\) were traced through.*"
                                         r"not kept \(fx trace differs"):
        gm = fxpipe.capture(model, (x,), leaf_modules=[nn.Linear])
    info = gm.meta[ir.CAPTURE]
    assert info.method == "export" and info.inlined_leaves == ("Linear",)
    assert "traced through leaf_modules Linear" in info.describe()
    _assert_same(gm, model, (x,), {})


@pytest.mark.parametrize("method", ["export", "follow_branches"])
def test_leaf_modules_with_a_front_end_that_has_none_are_refused(method):
    with pytest.raises(ConfigError, match=rf"leaf_modules \(ReLU, dec\).*'{method}'"):
        fxpipe.capture(_Hooked(), (torch.randn(6, 4),), method=method,
                       leaf_modules=[nn.ReLU, "dec"])


def test_explicit_fx_rejects_a_wrong_trace():
    with pytest.raises(CaptureError, match="computes something else.*\n.*export"):
        fxpipe.capture(_Hooked(), (torch.randn(6, 4),), method="fx")


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.abs().max() > 1e6:  # data-dependent: neither fx nor export can capture it
            return h * 2
        return h


def test_uncapturable_model_names_the_source_line_and_gives_a_hint():
    with pytest.raises(CaptureError) as err:
        fxpipe.capture(_DataDependent(), (torch.randn(4, 4),))
    message = str(err.value)
    assert "test_capture.py" in message and "if h.abs().max() > 1e6" in message
    assert "hint:" in message and "torch.cond" in message


@pytest.mark.parametrize("how", ["script", "trace"])
@pytest.mark.parametrize("method", ["auto", "fx", "export"])
def test_a_torchscript_submodule_is_refused_naming_it(how, method):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[1] = torch.jit.script(model[1]) if how == "script" else \
        torch.jit.trace(model[1], torch.randn(2, 8))
    with pytest.raises(CaptureError, match=r"holds TorchScript modules \('1', made by "
                                           r"torch.jit.script or torch.jit.trace\)") as error:
        fxpipe.capture(model, (torch.randn(4, 4),), method=method)
    assert "before torch.jit.script" in error.value.hint


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    hidden: torch.Tensor
    layers: int = 2


@dataclasses.dataclass
class _RegisteredOut(_Out):
    pass


torch.export.register_dataclass(_RegisteredOut)


class _DataclassOut(nn.Module):
    def __init__(self, out: type[_Out]) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(8, 16), nn.Linear(16, 4), out

    def forward(self, x: torch.Tensor) -> _Out:
        h = torch.tanh(self.a(x))
        return self.out(self.b(h), h)


def test_a_dataclass_output_is_refused_unless_registered_then_trains_as_the_plain_model():
    # unregistered, pytree takes it for one opaque output: a program would return the first
    # micro-batch's object
    x = torch.randn(8, 8)
    with pytest.raises(CaptureError, match=r"output of _DataclassOut is an object of type "
                                           r"_Out") as error:
        fxpipe.compile(_DataclassOut(_Out), (x,), stages=2, chunks=2)
    assert "torch.export.register_dataclass(_Out)" in error.value.hint
    torch.manual_seed(0)
    model = _DataclassOut(_RegisteredOut)
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    out = program(x)
    assert isinstance(out, _RegisteredOut) and out.layers == 2
    torch.testing.assert_close(out.logits, plain(x).logits)
    loss = program.step(x, target=None, loss_fn=lambda o: o.logits.pow(2).sum())
    expected = plain(x).logits.pow(2).sum()
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b, self.reentrant = nn.Linear(8, 16), nn.Linear(16, 4), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.a(t)), x,
                                              use_reentrant=self.reentrant)
        return self.b(h)


def test_reentrant_checkpointing_under_export_is_refused_with_the_way_out():
    # export loses the reentrant region's gradients; the refusal says which flag keeps them
    x = torch.randn(4, 8)
    with pytest.raises(CaptureError, match="gives gradients to other parameters") as error:
        fxpipe.compile(_Checkpointed(True), (x,), stages=2, chunks=2, capture="export")
    assert "use_reentrant=False" in error.value.hint
    torch.manual_seed(0)
    model = _Checkpointed(False)
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, capture="export")
    loss = program.step(x, target=None, loss_fn=lambda out: out.pow(2).mean())
    expected = plain(x).pow(2).mean()
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class _Packed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        return self.head(self.rnn(packed)[1][0][-1])


def test_an_rnn_over_a_packed_sequence_is_refused_saying_how_to_run_it_padded():
    with pytest.raises(CaptureError) as error:
        fxpipe.compile(_Packed(), (torch.randn(4, 6, 8), torch.tensor([6, 3, 5, 2])),
                       stages=2, chunks=2)
    assert "PackedSequence" in error.value.hint and "lengths - 1" in error.value.hint


class _LayerDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.2:  # skips a layer now and then
                continue
            x = torch.tanh(layer(x))
        return x


def test_a_branch_on_a_random_draw_in_training_is_refused_saying_how_to_compile_it():
    with pytest.raises(CaptureError, match="decides what to compute from the values") as error:
        fxpipe.compile(_LayerDrop().train(), (torch.randn(4, 8),), stages=2, chunks=2)
    assert "config.layerdrop = 0.0" in error.value.hint and "eval mode" in error.value.hint
    torch.manual_seed(0)
    model = _LayerDrop().eval()  # the way out the hint gives
    x = torch.randn(4, 8)
    torch.testing.assert_close(fxpipe.compile(model, (x,), stages=2, chunks=2)(x), model(x))


def test_recurrent_model_has_its_batch_in_dim_1():
    model, inputs, _ = _load("recurrent")
    gm = fxpipe.capture(model, inputs)
    info = gm.meta[ir.CAPTURE]
    assert info.signature.input_batch_dims == (1,)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert ir.tensor_info(out).batch_dim == 1


class _TimeFirstClassifier(nn.Module):
    """A sequence-first encoder ([time, batch, features]) whose output is a mean over time: cut
    along time, every output keeps its shape, so only the cut along dim 1 shows the batch."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)  # batch_first=False
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)).mean(0)


def test_a_time_first_model_pooled_over_time_has_its_batch_in_dim_1_and_trains():
    torch.manual_seed(0)
    model = _TimeFirstClassifier()
    plain = copy.deepcopy(model)
    x, y = torch.randn(6, 8, 16), torch.randint(0, 3, (8,))
    gm = fxpipe.capture(model, (x,))
    assert gm.meta[ir.CAPTURE].signature.input_batch_dims == (1,)
    program = fxpipe.compile(model, (x,), stages=2, chunks=4)
    loss = program.step(x, target=y)
    expected = reference_step(program, plain, x, target=y)
    assert loss == pytest.approx(expected, rel=1e-5)
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)


def test_a_model_returning_only_a_mean_over_the_batch_keeps_dim_0():
    class MeanLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).pow(2).mean()

    gm = fxpipe.capture(MeanLoss(), (torch.randn(8, 4),))
    assert gm.meta[ir.CAPTURE].signature.input_batch_dims == (0,)


class _BufferArithmetic(nn.Module):
    """An operation on buffers alone (a rotary table from its frequencies, a mask from a
    buffer): fx's tracer by default runs it once and freezes its result into the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, 8))
        self.register_buffer("gate", torch.ones(8), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * torch.cos(self.inv_freq * 2.0) + self.gate * self.inv_freq


class _BufferAsPythonValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("table", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.table.shape[0]):  # a buffer's size as a Python int
            x = self.fc(x) + self.table[i]
        return x


@pytest.mark.parametrize("method", ["fx", "auto", "export"])
def test_buffers_changed_after_compiling_are_what_the_program_runs(method):
    torch.manual_seed(0)
    model = _BufferArithmetic().eval()
    x = torch.randn(8, 8)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, capture=method)
    state = {k: v * 3.0 for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # in place: the stages hold these tensors
    model.gate.fill_(2.0)
    torch.testing.assert_close(program(x), model(x))


def test_a_buffer_read_as_a_python_value_is_still_traced_by_fx():
    torch.manual_seed(0)
    model = _BufferAsPythonValue().eval()
    x = torch.randn(4, 8)
    gm = fxpipe.capture(model, (x,), method="fx")
    torch.testing.assert_close(gm(x), model(x))


def test_keyword_inputs_and_dict_outputs():
    model, inputs, kwargs = _load("branchy")
    gm = fxpipe.capture(model, inputs, kwargs)
    out = gm(*inputs, **kwargs)
    assert set(out) == {"logits", "aux"}
    assert [leaf.name for leaf in gm.meta[ir.CAPTURE].signature.leaves] == ["x", "y", "gate"]


def test_non_tensor_inputs_are_baked_and_checked():
    class Scaled(nn.Module):
        def forward(self, x, scale=1.0):
            return x * scale

    gm = fxpipe.capture(Scaled(), (torch.randn(4, 3), 2.0))
    torch.testing.assert_close(gm(torch.ones(2, 3), 2.0), torch.full((2, 3), 2.0))
    with pytest.raises(RuntimeInputError, match="compiled with 2.0"):
        gm(torch.ones(2, 3), 3.0)


def test_inputs_of_another_shape_are_rejected_with_the_expected_shape():
    model, inputs, _ = _load("mlp")
    gm = fxpipe.capture(model, inputs)
    with pytest.raises(RuntimeInputError, match=r"shape \(8, 16\).*\(B, 32\)"):
        gm(torch.randn(8, 16))
    with pytest.raises(RuntimeInputError, match="dtype"):
        gm(inputs[0].double())


def test_explicit_batch_dims_are_checked():
    model, inputs, _ = _load("mlp")
    with pytest.raises(CaptureError, match="1 tensor inputs"):
        fxpipe.capture(model, inputs, batch_dims=[0, 0])


def test_non_separable_model_is_refused_with_a_hint():
    class Mixer(nn.Module):
        def forward(self, x):
            return x - x.mean()  # every example depends on the whole batch

    with pytest.raises(CaptureError, match="separable") as err:
        fxpipe.capture(Mixer(), (torch.randn(4, 3),))
    assert "batch_dims" in str(err.value)
