"""fxpipe.capture on Hugging Face transformers models built from small configs (random weights)."""
from __future__ import annotations

import pytest
import torch

import fxpipe
from fxpipe import ir
from fxpipe.untouched import seeded

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), {"use_cache": False}


def _bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=128, max_position_embeddings=64)
    return transformers.BertModel(cfg), {}


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=64, vocab_size=128,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg), {"use_cache": False}


@pytest.mark.parametrize("build", [_gpt2, _bert, _llama], ids=["gpt2", "bert", "llama"])
def test_transformers_models_are_captured_and_match_eager(build):
    torch.manual_seed(0)
    model, kwargs = build()
    model.eval()
    ids = torch.randint(0, 128, (4, 16))
    gm = fxpipe.capture(model, (ids,), kwargs)
    info = gm.meta[ir.CAPTURE]
    assert info.method == "export"  # fx cannot trace transformers 5
    assert info.signature.input_batch_dims == (0,)
    assert all(d == 0 for d in info.signature.out_batch_dims)
    for batch in (ids, ids[:3]):
        with seeded(0):
            expected = model(batch, **kwargs)
        got = gm(batch, **kwargs)
        assert type(got) is type(expected)  # the ModelOutput structure comes back
        for key in expected.keys():
            torch.testing.assert_close(got[key], expected[key])
