"""The captured graph's code is generated when first used (fxpipe.frontend.lazy_code), and is
never stale: calling the module or reading its code after a change sees the change."""
from __future__ import annotations

import copy
import operator
import pickle

import torch
from torch import fx, nn

import fxpipe
from fxpipe.frontend.lazy_code import is_compiled, recompile_lazily
from fxpipe.models import load


def test_a_capture_leaves_its_code_to_be_generated_on_first_call():
    model, (x,), _ = load("mlp", deterministic=True)
    gm = fxpipe.capture(model, (x,), inline_modules=True)
    assert not is_compiled(gm)
    torch.testing.assert_close(gm(x), model(x))
    assert is_compiled(gm)


def test_reading_the_code_generates_it_from_the_graph_as_it_is_now():
    model, (x,), _ = load("mlp", deterministic=True)
    gm = fxpipe.capture(model, (x,), inline_modules=True)
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert all(name in gm.code for name in names)
    assert is_compiled(gm)
    assert "def forward" in gm.print_readable(print_output=False)


def _double() -> fx.GraphModule:
    """x * 2, built node by node (a traced forward's string annotations would not pickle)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(operator.mul, (x, 2)))
    return fx.GraphModule(nn.Module(), graph)


def test_a_graph_changed_after_recompile_lazily_runs_as_changed():
    gm = _double()
    x = torch.ones(3)
    assert torch.equal(gm(x), x * 2)
    (mul,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    mul.args = (mul.args[0], 5)
    recompile_lazily(gm)
    assert not is_compiled(gm) and "5" not in gm.__dict__.get("_code", "")
    assert torch.equal(gm(x), x * 5)  # not the code generated before the change
    assert "5" in gm.code
    mul.args = (mul.args[0], 7)
    recompile_lazily(gm)
    assert "7" in gm.code and torch.equal(gm(x), x * 7)


def test_a_lazy_module_copies_and_pickles_with_its_current_graph():
    gm = _double()
    (mul,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    mul.args = (mul.args[0], 3)
    recompile_lazily(gm)
    x = torch.ones(2)
    assert torch.equal(copy.deepcopy(gm)(x), x * 3)
    recompile_lazily(gm)
    assert torch.equal(pickle.loads(pickle.dumps(gm))(x), x * 3)
    assert torch.equal(gm(x), x * 3)


def test_the_history_shows_the_captured_code_before_a_pass_rewrote_the_graph():
    # deferred BatchNorm rewrites the captured graph: the capture's snapshot is its code from
    # before the rewrite, not the graph as it is later
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    program = fxpipe.compile(model.train(), (torch.randn(8, 4),), stages=2, chunks=2,
                             deferred_batch_norm=True, profile="a100")
    texts = {s.after: s.text for s in program.built.history}
    assert "capture" in texts and "defer_batch_norm" in texts
    assert texts["capture"] != texts["defer_batch_norm"]
    lazy = fxpipe.compile(model.eval(), (torch.randn(8, 4),), stages=2, chunks=2,
                          profile="a100")
    assert not is_compiled(lazy.built.captured)
    assert "def forward" in {s.after: s.text for s in lazy.built.history}["capture"]
