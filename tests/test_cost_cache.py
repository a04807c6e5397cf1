"""The cost pass costs each distinct node signature once: on a model with repeated layers the
cached costs are exactly the ones every node gets when costed on its own."""
from __future__ import annotations

import pytest
import torch

from fxpipe import ir
from fxpipe.frontend.capture import capture
from fxpipe.models import gpt
from fxpipe.passes import cost


def _costs(gm: torch.fx.GraphModule) -> tuple[cost.CostSummary, dict[str, ir.Cost]]:
    summary = cost.annotate_costs(gm)
    return summary, {n.name: n.meta[ir.COST] for n in ir.compute_nodes(gm.graph)}


def _gpt() -> torch.fx.GraphModule:
    model = gpt.GPT(vocab_size=128, seq_len=16, d_model=32, n_layer=3, n_head=2, dropout=0.0)
    return capture(model, (torch.randint(128, (4, 16)),), inline_modules=True)


def _llama_on_meta() -> torch.fx.GraphModule:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=64, vocab_size=128,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    return capture(model, (torch.zeros(4, 16, dtype=torch.long),), {"use_cache": False},
                   inline_modules=True, check="shapes")


@pytest.mark.parametrize("build", [_gpt, _llama_on_meta], ids=["gpt", "llama_on_meta"])
def test_cached_costs_equal_the_uncached_ones(build, monkeypatch: pytest.MonkeyPatch) -> None:
    gm = build()
    cached, by_node = _costs(gm)
    assert cached.cache_hits > len(by_node) / 2  # the repeated layers are hits
    monkeypatch.setattr(cost._CostRunner, "_cache_key", lambda self, n, leaves: None)
    alone, alone_by_node = _costs(gm)
    assert alone.cache_hits == 0
    assert alone_by_node == by_node
    assert (alone.fwd_flops, alone.bwd_flops, alone.param_bytes, alone.saved_bytes) == \
        (cached.fwd_flops, cached.bwd_flops, cached.param_bytes, cached.saved_bytes)
