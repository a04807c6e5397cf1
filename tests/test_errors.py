"""Bad input gets an FxPipeError that states the values involved and a hint, before any work."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import (
    CaptureError,
    ConfigError,
    FxPipeError,
    LossError,
    NotBuiltError,
    PartitionError,
    RuntimeInputError,
)
from fxpipe.models import branchy, gpt, mlp


@pytest.fixture(scope="module")
def example():
    model, (x,) = mlp.build()
    return model, x


def _compile(example, **options):
    model, x = example
    options.setdefault("profile", "a100")
    return fxpipe.compile(model, (x,), **options)


def _check(error: FxPipeError, *fragments: str) -> None:
    text = str(error)
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    assert error.hint, text


@pytest.mark.parametrize("stages", [0, -1, 1.5])
def test_stages_below_one(example, stages):
    with pytest.raises(ConfigError) as err:
        _compile(example, stages=stages)
    _check(err.value, f"stages must be an integer >= 1 (got {stages})")


def test_more_stages_than_compute_nodes(example):
    with pytest.raises(PartitionError) as err:
        _compile(example, stages=500)
    _check(err.value, "operations that can start a stage (500 >", "use at most",
           "a stage needs at least one operation that computes a floating-point value")
    assert "atom" not in str(err.value)  # the partition's word, not the user's
    assert "leaf_modules" not in str(err.value)  # none were passed: fewer cannot help
    assert "inline_modules" not in str(err.value)  # an option of capture, not of compile


class _BranchesOnValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:
            return h * 2
        return h


def test_data_dependent_control_flow_names_the_line_and_what_to_write_instead():
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(_BranchesOnValues(), (torch.randn(4, 4),), profile="a100")
    headline, at, detail = err.value.message.splitlines()
    assert headline.startswith("_BranchesOnValues decides what to compute from the values in a "
                               "tensor, which neither torch.fx nor torch.export can capture")
    assert at.strip().startswith("at ") and "test_errors.py:" in at and "if h.sum() > 0:" in at
    assert detail.strip().startswith("detail: torch.export could not decide ")  # its expression
    for internal in ("unhinted", "GuardOnDataDependentSymNode", "Size-like"):
        assert internal not in str(err.value)
    _check(err.value, "torch.where", "torch.cond")


@pytest.mark.parametrize("chunks", [0, -2])
def test_chunks_below_one(example, chunks):
    with pytest.raises(ConfigError) as err:
        _compile(example, chunks=chunks)
    _check(err.value, f"chunks must be an integer >= 1 or 'auto' (got {chunks})")


def test_chunks_larger_than_the_batch(example):
    with pytest.raises(ConfigError) as err:
        _compile(example, chunks=16)
    _check(err.value, "chunks (16) is larger than the batch size (8)")


def test_batch_that_chunks_does_not_divide_lists_the_sizes_that_work(example):
    with pytest.raises(ConfigError) as err:
        _compile(example, chunks=3)
    _check(err.value, "batch size 8 cannot be split into 3 equal micro-batches", "[1, 2, 4, 8]")


def test_memory_limit_too_small_states_the_minimum(example):
    with pytest.raises(PartitionError) as err:
        _compile(example, memory_limit=1000)
    _check(err.value, "limit 1000 < minimum", "raise the memory limit to at least")


@pytest.mark.parametrize("option,value,expected", [
    ("balance", "speed", "unknown balance mode 'speed'"),
    ("remat", "sometimes", "unknown remat mode 'sometimes'"),
    ("schedule", "zigzag", "unknown schedule 'zigzag'"),
    ("capture", "magic", "unknown capture method 'magic'"),
    ("memory_limit", -5, "memory_limit must be a positive number of bytes (got -5)"),
])
def test_unknown_modes(example, option, value, expected):
    with pytest.raises(ConfigError) as err:
        _compile(example, **{option: value})
    _check(err.value, expected)


def test_remat_auto_needs_a_memory_limit(example):
    with pytest.raises(ConfigError) as err:
        _compile(example, remat="auto")
    _check(err.value, "remat='auto'", "memory_limit")


def test_split_point_that_names_no_module(example):
    with pytest.raises(PartitionError) as err:
        _compile(example, split_points=["nowhere"])
    _check(err.value, "split point 'nowhere' names no module")


def test_split_points_in_the_wrong_order(example):
    with pytest.raises(PartitionError) as err:
        _compile(example, stages=3, split_points=["blocks.5", "blocks.2"])
    _check(err.value, "split point 'blocks.2'", "does not come after the previous cut")


def test_fewer_devices_than_stages(example):
    with pytest.raises(ConfigError) as err:
        _compile(example, stages=3, devices=["cpu", "cpu"])
    _check(err.value, "fewer devices than stages (2 < 3)")


@pytest.mark.parametrize("devices, expected, hint", [
    (["tpu", "cpu"], "devices[0] = 'tpu' is not a torch device (Expected one of", "'cuda:0'"),
    (["cpu", "cuda:7"], "devices name ['cuda:7'], but this process sees", "devices=['cpu'] * N"),
])
def test_a_device_torch_does_not_know_or_this_process_does_not_see(example, devices, expected,
                                                                   hint):
    with pytest.raises(ConfigError) as err:
        _compile(example, stages=2, devices=devices)
    _check(err.value, expected, hint)


def test_memory_limit_and_memory_per_device_take_a_size_with_a_unit(example):
    model, x = example
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, memory_limit="1.5 GiB",
                             profile="a100")
    assert program.config.memory_limit == 1.5 * 2**30
    plan = fxpipe.plan(model, (x,), devices=2, memory_per_device="80GB", profile="a100",
                       max_chunks=2)
    assert plan.memory_per_device == 80e9
    with pytest.raises(ConfigError) as err:
        _compile(example, memory_limit="16 gigs")
    _check(err.value, "memory_limit must be a number of bytes or a size like 8GiB, 1.5GB or "
                      "500000000 (got '16 gigs')", "KiB = 1024")


@pytest.mark.parametrize("loss_fn, returned", [
    (lambda out, y: (nn.functional.mse_loss(out, y), out.detach()), "returned a tuple"),
    (lambda out, y: (out - y) ** 2, "returned a torch.float32 tensor of shape (8, 10)"),
    (lambda out, y: float(out.mean()), "returned a float"),
])
def test_a_loss_function_that_does_not_return_one_number_is_named_with_what_it_returned(
        example, loss_fn, returned):
    model, x = example
    program = _compile(example, chunks=2)
    with pytest.raises(LossError) as err:
        program.step(x, target=torch.randn(8, 10), loss_fn=loss_fn)
    _check(err.value, f"the loss function <lambda> {returned}; a step needs one "
                      "floating-point number", "reduction='mean'")


def test_a_loss_that_takes_a_target_without_one_is_named_in_a_step_and_in_write(example,
                                                                                tmp_path):
    model, x = example
    program = _compile(example, chunks=2)
    with pytest.raises(LossError) as err:
        program.step(x, loss_fn=nn.functional.mse_loss)
    _check(err.value, "the loss function mse_loss takes a target, and the step was given none",
           "target=y")
    for loss_fn, name in ((nn.functional.mse_loss, "torch.nn.functional:mse_loss"),
                          ("mse", "mse")):
        with pytest.raises(ConfigError) as err:
            program.write(str(tmp_path / "out"), loss_fn=loss_fn)
        _check(err.value, f"the loss {name} takes a target, and write() was given none",
               "target=y")
    assert not (tmp_path / "out").exists()
    program.write(str(tmp_path / "out"), loss_fn="mse", target=torch.randn(8, 10),
                  reference_steps=1)
    assert (tmp_path / "out" / "program.py").exists()


def test_inputs_that_differ_from_compile_time(example):
    program = _compile(example)
    with pytest.warns(UserWarning, match="compiling the program again"), \
            pytest.raises(RuntimeInputError) as err:
        program(torch.randn(8, 31))  # compiled again for it, which the model cannot take
    _check(err.value, "inputs of shapes (B, 31) differ from the compiled (B, 32)",
           "RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeInputError) as err:
        program(torch.randn(8, 32, dtype=torch.float64))
    _check(err.value, "dtype torch.float64", "torch.float32")
    with pytest.raises(RuntimeInputError) as err:
        program(torch.randn(8, 32), torch.randn(8, 32))
    _check(err.value, "another structure than at compile time")


def test_missing_keyword_input():
    model, inputs = branchy.build()
    program = fxpipe.compile(model, inputs, example_kwargs=branchy.example_kwargs(inputs),
                             profile="a100")
    with pytest.raises(RuntimeInputError) as err:
        program(*inputs)
    names = sorted(branchy.example_kwargs(inputs))
    _check(err.value, f"missing keyword inputs {names}", f"keyword inputs {names})")
    assert "TreeSpec" not in str(err.value)


class _Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x=None, batch=None):
        return self.b(torch.relu(self.a(x) * batch["scale"] + batch["shift"]))


def test_keywords_and_dict_keys_in_another_order_are_the_same_call():
    model = _Keywords()
    x, scale, shift = torch.randn(8, 8), torch.rand(8, 1), torch.randn(8, 16)
    program = fxpipe.compile(model, example_kwargs={"x": x, "batch": {"scale": scale,
                                                                      "shift": shift}},
                             stages=2, chunks=2, profile="a100")
    expected = model(x=x, batch={"scale": scale, "shift": shift})
    torch.testing.assert_close(program(batch={"shift": shift, "scale": scale}, x=x), expected)
    with pytest.raises(RuntimeInputError) as err:  # other keys are still another call
        program(x=x, batch={"scale": scale, "bias": shift})
    _check(err.value, "another structure than at compile time")


def test_inputs_by_position_or_by_keyword_bind_as_forward_binds_them():
    model = _Keywords()
    x, batch = torch.randn(8, 8), {"scale": torch.rand(8, 1), "shift": torch.randn(8, 16)}
    expected = model(x, batch)
    by_keyword = fxpipe.compile(model, example_kwargs={"x": x, "batch": batch}, stages=2,
                                chunks=2, profile="a100")
    torch.testing.assert_close(by_keyword(x, batch), expected)
    torch.testing.assert_close(by_keyword(x, batch=batch), expected)
    by_position = fxpipe.compile(model, (x, batch), stages=2, chunks=2, profile="a100")
    torch.testing.assert_close(by_position(batch=batch, x=x), expected)
    loss = by_position.step(batch=batch, x=x, target=torch.randn(8, 4),
                            loss_fn=nn.functional.mse_loss)
    assert loss > 0 and model.a.weight.grad is not None
    with pytest.raises(RuntimeInputError) as err:  # an input the example did not have
        by_position(x)
    _check(err.value, "1 positional inputs instead of 2")


class _OneList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)

    def forward(self, xs):
        return self.a(xs[0] + xs[1])


def test_example_inputs_that_forward_cannot_take_are_refused_before_any_run():
    x = torch.randn(8, 8)
    with pytest.raises(ConfigError) as err:  # the list taken as two positional inputs
        fxpipe.compile(_OneList(), [x, x], stages=2, chunks=2, profile="a100")
    _check(err.value, "the example inputs do not fit _OneList.forward(xs): too many positional "
                      "arguments (2 positional input(s), keywords [])", "example_inputs=([x, y],)")
    with pytest.raises(ConfigError) as err:
        fxpipe.compile(_OneList(), ([x, x],), example_kwargs={"ys": x}, stages=2, chunks=2,
                       profile="a100")
    _check(err.value, "unexpected keyword argument 'ys'", "example_kwargs the keyword inputs")


def test_outputs_that_cannot_be_joined_along_a_batch_dimension():
    class MeanLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.out = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return self.out(h).mean(dim=1), h.mean()  # the second: over the batch

    x = torch.randn(8, 4)
    with pytest.raises(ConfigError) as err:  # refused when compiled, not at every call
        fxpipe.compile(MeanLoss(), (x,), stages=2, chunks=4, profile="a100")
    _check(err.value, "output[1] of the model has no batch dimension", "4 micro-batches",
           "loss_fn", "chunks=1")
    model = MeanLoss()
    program = fxpipe.compile(model, (x,), stages=2, chunks=1, profile="a100")
    for got, want in zip(program(x), model(x)):
        torch.testing.assert_close(got, want)


def test_a_loss_computed_from_labels_points_at_the_step():
    class WithLabels(nn.Module):  # as a transformers model given labels=
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, x, labels=None):
            logits = self.head(torch.relu(self.fc(x)))
            loss = nn.functional.cross_entropy(logits, labels)
            return {"loss": loss, "logits": logits}

    x, labels = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with pytest.raises(ConfigError) as err:
        fxpipe.compile(WithLabels(), (x,), example_kwargs={"labels": labels}, stages=2,
                       chunks=2, profile="a100")
    _check(err.value, "output['loss'] of the model has no batch dimension",
           "compile without labels=", "target=next_tokens")


def test_report_before_the_first_call_of_a_lazy_program(example):
    model, x = example
    program = fxpipe.compile(model, stages=2)
    with pytest.raises(NotBuiltError) as err:
        program.report()
    _check(err.value, "has not been built yet", "call it once", "example_inputs")
    with pytest.raises(NotBuiltError):
        program.stages  # noqa: B018


def test_a_model_that_cannot_be_captured_end_to_end():
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            if h.abs().max() > 1e6:
                return h * 2
            return h

    with pytest.raises(CaptureError) as err:
        fxpipe.compile(DataDependent(), (torch.randn(8, 4),), stages=2, profile="a100")
    _check(err.value, "if h.abs().max() > 1e6", "torch.cond")


def test_every_error_is_an_fxpipe_error_and_builtin_where_expected():
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, FxPipeError)
    assert issubclass(PartitionError, ValueError)
    assert issubclass(RuntimeInputError, ValueError)


class _TwoLayers(nn.Module):
    """Two linear layers (so that there are two stages) and, in subclasses, something a pipeline
    cannot reproduce."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


class _BatchSizeOutput(_TwoLayers):
    def forward(self, x):
        return self.b(self.a(x)), x.shape[0]


class _Counter(_TwoLayers):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return self.b(self.a(x))


class _MovingAverage(_TwoLayers):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        h = self.a(x)
        self.ema.copy_(0.9 * self.ema + 0.1 * h.detach().mean(0))
        return self.b(h)


class _InPlaceInput(_TwoLayers):
    def forward(self, x):
        x.add_(3.0)
        return self.b(self.a(x))


def test_an_output_number_that_depends_on_the_batch_size_is_refused():
    # The pipeline returned the micro-batch size (2) where the model returns the batch size (8).
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(_BatchSizeOutput(), (torch.randn(8, 4),), stages=2, chunks=4,
                       profile="a100")
    _check(err.value, "output[1] of _BatchSizeOutput is a Python number that depends on the "
                      "batch (8 for the batch of 8, 4 for its first 4 examples)", "x.shape[0]")


class DynamicCache:
    """Stands for a library's per-batch state object (a key/value cache): not a tensor, not a
    structure pytree looks into, and not equal between two batches."""

    def __init__(self, batch: int) -> None:
        self.batch = batch


class _CacheOutput(_TwoLayers):
    def forward(self, x):
        return self.b(self.a(x)), DynamicCache(x.shape[0])


class _StateOutput(_TwoLayers):
    def forward(self, x):
        return self.b(self.a(x)), _TwoLayers()


@pytest.mark.parametrize("model, kind, hint", [
    (_CacheOutput, "DynamicCache", "use_cache=False in example_kwargs and in every call"),
    (_StateOutput, "_TwoLayers", "return tensors only (or a list, tuple or dict of them)")])
def test_an_output_object_that_is_not_a_tensor_is_refused_naming_its_type(model, kind, hint):
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(model(), (torch.randn(8, 4),), stages=2, chunks=4, profile="a100")
    _check(err.value, f"output[1] of {model.__name__} is an object of type {kind}, which "
                      "differs between the batch and its first half", hint)
    assert "Python number" not in str(err.value)
    assert ("Hugging Face" in str(err.value)) == (kind == "DynamicCache")


@pytest.mark.parametrize("model, buffer", [(_Counter, "count"), (_MovingAverage, "ema")])
def test_a_buffer_updated_in_forward_is_refused_and_left_as_it_was(model, buffer):
    # The counter was never updated, the average was updated once per micro-batch.
    module = model()
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(module, (torch.randn(8, 4),), stages=2, chunks=4, profile="a100")
    _check(err.value, f"{model.__name__} updates its buffer {buffer} in forward",
           "once per call, on the whole batch", "outside forward")
    assert not getattr(module, buffer).any()


def test_batch_norm_statistics_are_still_accepted():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    fxpipe.compile(model, (torch.randn(8, 4),), stages=2, chunks=2, profile="a100")


def test_compile_leaves_the_callers_inputs_unchanged_and_names_an_input_written_in_place():
    x = torch.zeros(8, 4)
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(_InPlaceInput(), (x,), stages=2, chunks=4, profile="a100")
    _check(err.value, "_InPlaceInput modifies its input x in place", "x = x + 1")
    assert not x.any()


class _HalvesARow(_TwoLayers):
    def forward(self, x):
        with torch.no_grad():
            self.a.weight[0].mul_(0.5)
        return self.b(self.a(x))


class _ScalesThroughData(_TwoLayers):
    def forward(self, x):
        self.a.weight.data.mul_(0.5)
        return self.b(self.a(x))


class _ClampsThroughData(_TwoLayers):
    def forward(self, x):
        self.a.weight.data.clamp_(-0.01, 0.01)
        return self.b(self.a(x))


@pytest.mark.parametrize("model", [_HalvesARow, _ScalesThroughData, _ClampsThroughData])
def test_a_parameter_written_in_forward_is_refused_as_the_write_and_left_as_it_was(model):
    # The row was halved, the weight scaled x0.03125 by five trial forwards and reported as
    # "not separable", the clamped weight compiled: each on the caller's parameter.
    torch.manual_seed(0)
    module = model()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(module, (torch.randn(8, 4),), stages=2, chunks=4, profile="a100")
    _check(err.value, f"{model.__name__} updates its parameter a.weight in forward",
           "through .data", "left it as it was", "outside forward")
    for name, p in module.named_parameters():
        assert torch.equal(p, before[name]), name


class _StoresAuxLoss(_TwoLayers):
    """Keeps an auxiliary loss for the training loop to add, as mixture-of-experts layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.aux_loss = None

    def forward(self, x):
        h = self.a(x)
        self.aux_loss = h.square().mean()
        return self.b(h)


class _CachesPositions(_TwoLayers):
    """Keeps a tensor without gradient it computes on its first call."""

    def forward(self, x):
        if getattr(self, "positions", None) is None:
            self.positions = torch.arange(x.shape[-1], dtype=x.dtype)
        return self.b(self.a(x + self.positions))


@pytest.mark.parametrize("capture", ["auto", "fx", "export"])
def test_a_tensor_with_gradient_stored_on_a_module_in_forward_is_refused_and_put_back(capture):
    # The attribute kept the tensor of the compile's last run: a loss that added it trained
    # on that one value, through a stale graph, every step.
    module = _StoresAuxLoss()
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(module, (torch.randn(8, 4),), stages=2, chunks=4, profile="a100",
                       capture=capture)
    _check(err.value, "_StoresAuxLoss's forward stores a tensor that carries gradient on a "
                      "module (aux_loss;", "stale value", "return it from forward as one more "
                                                          "output")
    assert module.aux_loss is None


class _StoresAndBranches(_StoresAuxLoss):
    def forward(self, x):
        h = self.a(x)
        self.aux_loss = h.square().mean()
        return self.b(h) if h.sum() > 0 else h  # data-dependent: no front end captures it


def test_what_forward_stored_is_put_back_also_when_capture_fails_for_another_reason():
    torch.manual_seed(0)
    module = _StoresAndBranches()
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(module, (torch.randn(8, 4),), stages=2, chunks=4, profile="a100")
    assert "stores a tensor" not in str(err.value)  # the capture's own error
    assert module.aux_loss is None


def test_a_tensor_without_gradient_cached_in_forward_compiles_and_is_put_back():
    torch.manual_seed(0)
    module, x = _CachesPositions(), torch.randn(8, 4)
    program = fxpipe.compile(module, (x,), stages=2, chunks=4, profile="a100")
    assert getattr(module, "positions", None) is None  # as before compiling
    torch.testing.assert_close(program(x), module(x))


class _InputThroughData(_TwoLayers):
    def forward(self, x):
        x.data.mul_(2.0)
        return self.b(self.a(x))


def test_an_input_written_through_data_is_named_as_written_not_as_not_separable():
    x = torch.ones(8, 4)
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(_InputThroughData(), (x,), stages=2, chunks=4, profile="a100")
    _check(err.value, "_InputThroughData modifies its input x in place (or through .data)",
           "x = x + 1")
    assert torch.equal(x, torch.ones(8, 4))


def test_compile_runs_on_copies_of_the_example_batch():
    model, (x,) = mlp.build()
    before = x.clone()
    program = fxpipe.compile(model, (x,), stages=2, chunks=4, profile="a100")
    assert torch.equal(x, before)
    assert all(t.data_ptr() != x.data_ptr() for t in program._example)


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.b(torch.relu(self.a(x))) + y


@pytest.mark.parametrize("batch_dims", [None, [0, 0]])
def test_an_example_batch_of_one_says_it_needs_two_samples(batch_dims):
    x = torch.randn(1, 4)
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(_TwoInputs(), (x, x), stages=2, chunks=1, profile="a100",
                       batch_dims=batch_dims)
    _check(err.value, "has 1 sample", "at least 2 samples", "batch = chunks works")
    assert "batch_dims" not in err.value.hint  # giving them does not help


def test_an_empty_example_batch_has_its_own_message():
    x = torch.randn(0, 4)
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(_TwoInputs(), (x, x), stages=2, chunks=1, profile="a100")
    _check(err.value, "example batch of _TwoInputs is empty")


def test_compile_takes_batch_dims_and_checks_them():
    x, y = torch.randn(4, 4), torch.randn(4)
    program = fxpipe.compile(_TwoInputs(), (x, y), stages=2, chunks=4, profile="a100",
                             batch_dims=[0, None])  # y broadcast to every sample
    assert program.built.signature.input_batch_dims == (0, None)
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(_TwoInputs(), (x, y), profile="a100", batch_dims=[0])
    _check(err.value, "batch_dims has 1 entries for 2 tensor inputs")
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(_TwoInputs(), (x, y), profile="a100", batch_dims=[0, 1])
    _check(err.value, "does not name a dimension of each batched input")
    with pytest.raises(ConfigError) as err:
        fxpipe.compile(_TwoInputs(), (x, y), profile="a100", batch_dims=[True, None])
    _check(err.value, "batch_dims must hold a dimension index or None")


@pytest.mark.parametrize("option", ["stages", "chunks", "dp_bucket_mb", "memory_limit"])
def test_a_bool_is_not_a_number_of_anything(example, option):
    with pytest.raises(ConfigError) as err:
        _compile(example, **{option: True})
    _check(err.value, f"{option} must be", "(got True)")


def test_compile_of_a_function_asks_for_an_nn_module():
    with pytest.raises(ConfigError) as err:
        fxpipe.compile(lambda x: x)
    _check(err.value, "needs a torch.nn.Module (got function", "class Fn(torch.nn.Module)")


def test_compile_of_a_model_and_example_pair_asks_to_unpack_it_without_printing_the_batch():
    pair = gpt.build()  # (model, example), as every bundled build() returns
    with pytest.raises(ConfigError) as err:
        fxpipe.compile(pair)
    _check(err.value, "got a tuple of 2 whose first item is the module GPT",
           "model, example = ...")
    assert "tensor(" not in str(err.value) and len(str(err.value)) < 300, str(err.value)


class _ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        scale = self.a.weight.sum().item()
        return self.b(self.a(x)) * scale


def test_item_in_forward_names_the_op_and_line_without_guard_text():
    with pytest.raises(fxpipe.FxPipeError) as err:
        fxpipe.compile(_ReadsAValue(), (torch.randn(8, 4),), stages=2, chunks=2, profile="a100")
    _check(err.value, "item (call_method item) reads a tensor's value",
           "in forward: scale = self.a.weight.sum().item()", "keep the value a tensor")
    assert "guard" not in str(err.value).lower()


def test_parameters_of_a_lazy_program_are_the_models_so_an_optimizer_made_first_trains_it():
    model, x = mlp.build()[0], mlp.build()[1][0]
    program = fxpipe.compile(model, stages=2, chunks=4, profile="a100")
    assert [id(p) for p in program.parameters()] == [id(p) for p in model.parameters()]
    optimizer = torch.optim.SGD(program.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    program(x).sum().backward()
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert {id(p) for p in program.parameters()} == {id(p) for p in model.parameters()}
    lazy = fxpipe.compile(model, stages=2)  # its state too is the model's until it is built
    assert {k: id(v) for k, v in lazy.state_dict(keep_vars=True).items()} == \
        {k: id(v) for k, v in model.state_dict(keep_vars=True).items()}


def test_capture_with_batch_dims_and_one_sample_gives_the_same_clear_message():
    x = torch.randn(1, 4)
    with pytest.raises(CaptureError) as err:
        fxpipe.capture(_TwoInputs(), (x, x), batch_dims=[0, 0])
    _check(err.value, "has 1 sample", "at least 2 samples")


def test_an_optimizer_holding_a_parameter_outside_the_program_is_named_on_save_and_load(
        tmp_path):
    # Both gave a bare KeyError(<an id>).
    model, (x,) = mlp.build()
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, profile="a100")
    extra = nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.Adam([*program.parameters(), extra])
    program.step(x)
    optimizer.step()
    program.save(str(tmp_path / "fine"), optimizer=torch.optim.Adam(program.parameters()))
    for call in (lambda: program.save(str(tmp_path / "ckpt"), optimizer=optimizer),
                 lambda: program.load(str(tmp_path / "fine"), optimizer=optimizer)):
        with pytest.raises(ConfigError) as err:
            call()
        _check(err.value, "the optimizer holds 1 parameter(s) that are not this program's",
               "a tensor of shape (3,)", "program.parameters()")


def test_a_global_batch_that_replicas_cannot_share_equally_names_both(example):
    from fxpipe.runtime.communication.mesh import Mesh
    from fxpipe.runtime.execution.rank import shard_batch
    model, x = example
    program = _compile(example, stages=2, chunks=4)
    signature = program.built.signature
    with pytest.raises(RuntimeInputError) as err:
        shard_batch(signature, [x[:5]], None, Mesh((0, 1), 2, 0))
    _check(err.value, "global batch 5", "shared equally by 2 data-parallel replicas",
           "multiple of 2")
    shard, _ = shard_batch(signature, [x[:8]], None, Mesh((0, 1), 2, 2))  # replica 1
    torch.testing.assert_close(shard[0], x[4:8])
    assert signature.microbatches(4, 4) == 4
    assert signature.microbatches(2, 4) == 2  # a replica's 2 examples: 2 micro-batches of 1


def test_a_target_of_another_batch_size_is_refused_before_any_run():
    from fxpipe.models import gpt
    model, (idx,) = gpt.build(dropout=0.0)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=4, profile="a100")
    target = gpt.target((idx,))
    with pytest.raises(RuntimeInputError) as err:
        program.step(idx, target=target[:4])
    _check(err.value, "target shape (4, 32)", "size 8, the inputs' batch")
    assert all(p.grad is None for p in program.parameters())


def test_step_takes_a_built_in_loss_by_name():
    from fxpipe.models import gpt
    model, (idx,) = gpt.build(dropout=0.0)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=4, profile="a100")
    target = gpt.target((idx,))
    assert program.step(idx, target=target, loss_fn="cross_entropy") == \
        pytest.approx(program.step(idx, target=target))
    with pytest.raises(ConfigError) as err:
        program.step(idx, target=target, loss_fn="crossentropy")
    _check(err.value, "unknown loss 'crossentropy'", "cross_entropy")
