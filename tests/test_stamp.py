"""Repeated blocks captured once (fxpipe.frontend.stamp): a stamped capture is the full capture,
node for node up to names; every case it cannot prove falls back and says why."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

from fxpipe import ir
from fxpipe.frontend.capture import capture
from fxpipe.passes.cost import annotate_costs
from fxpipe.untouched import seeded
from models import gpt

transformers = pytest.importorskip("transformers")


def canonical(gm: fx.GraphModule, costs: bool = False) -> list[tuple[Any, ...]]:
    """The graph without node names: op, target, arguments as positions, shape (and cost)."""
    index: dict[fx.Node, int] = {}
    rows = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        args = fx.map_arg((node.args, node.kwargs), lambda n: ("node", index[n]))
        target = node.target if node.op != "placeholder" else "input"
        row = (node.op, target, args, node.meta.get(ir.TENSOR), node.name)
        rows.append(row + ((node.meta.get(ir.COST),) if costs else ()))
    return rows


def _gpt() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    model, inputs = gpt.build(n_layer=6, dropout=0.0, batch=4)
    return model, inputs, {}


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))


def _llama() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    cfg = transformers.LlamaConfig(num_hidden_layers=5, hidden_size=32, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=64, vocab_size=128,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg), (_ids(),), {"use_cache": False}


def _mistral() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    cfg = transformers.MistralConfig(num_hidden_layers=5, hidden_size=32, num_attention_heads=2,
                                     num_key_value_heads=1, intermediate_size=64, vocab_size=128,
                                     max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return transformers.MistralForCausalLM(cfg), (_ids(),), {"use_cache": False}


def _gpt2() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    cfg = transformers.GPT2Config(n_layer=5, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), (_ids(),), {"use_cache": False}


def _bert() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    cfg = transformers.BertConfig(num_hidden_layers=5, hidden_size=32, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=128, max_position_embeddings=64)
    return transformers.BertModel(cfg), (_ids(),), {}


MODELS = {"gpt": _gpt, "llama": _llama, "gpt2": _gpt2, "mistral": _mistral, "bert": _bert}


def _both(build: Any, method: str = "auto") -> tuple[nn.Module, fx.GraphModule, fx.GraphModule,
                                                     tuple[Any, ...], dict[str, Any]]:
    torch.manual_seed(0)
    model, inputs, kwargs = build()
    model.eval()
    full = capture(model, inputs, kwargs, method=method, inline_modules=True)
    stamped = capture(model, inputs, kwargs, method=method, inline_modules=True, stamp=True)
    return model, full, stamped, inputs, kwargs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_stamped_capture_is_the_full_capture(name: str) -> None:
    model, full, stamped, inputs, kwargs = _both(MODELS[name])
    info = stamped.meta[ir.CAPTURE]
    assert info.stamped == len(_blocks(model)) - 3, info.stamp_note
    assert info.stamp_note.startswith(f"stamped {info.stamped} of the"), info.stamp_note
    assert full.meta[ir.CAPTURE].stamp_note is None
    assert canonical(stamped) == canonical(full)
    assert list(stamped.state_dict()) == list(full.state_dict())
    annotate_costs(full)
    annotate_costs(stamped)
    assert canonical(stamped, costs=True) == canonical(full, costs=True)
    with seeded(0):
        expected = model(*inputs, **kwargs)
    got = stamped(*inputs, **kwargs)
    for e, g in zip(_tensors(expected), _tensors(got)):
        torch.testing.assert_close(g, e)


def test_the_bundled_gpt_stamped_under_fx_and_export() -> None:
    for method in ("fx", "export"):
        model, full, stamped, _, _ = _both(_gpt, method)
        assert stamped.meta[ir.CAPTURE].stamped == 3
        assert canonical(stamped) == canonical(full)
        assert set(stamped.state_dict()) == set(full.state_dict())


def _blocks(model: nn.Module) -> nn.ModuleList:
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 4:
            return module
    raise AssertionError("no list of blocks")


def _tensors(value: Any) -> list[torch.Tensor]:
    import torch.utils._pytree as pytree

    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]
