"""init_weights: a meta model's stages get the model's own initializers, module by module, with
values that do not depend on the partition; what no initializer sets is an error."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import CheckpointError, ConfigError
from fxpipe.models import gpt
from fxpipe.runtime.program.materialize import initialize

transformers = pytest.importorskip("transformers")

CONFIG = {"vocab_size": 512, "seq_len": 32, "d_model": 64, "n_layer": 3, "n_head": 4,
          "dropout": 0.0}
IDX = torch.randint(512, (8, 32), generator=torch.Generator().manual_seed(0))


def meta(build, *args, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return build(*args, **kwargs)


def initialized(model: nn.Module, stages: int, x: torch.Tensor, seed: int = 0):
    program = fxpipe.compile(model, (x,), stages=stages, chunks=2, profile="a100",
                             check="shapes")
    program.init_weights(seed=seed)
    return program


@pytest.mark.slow
def test_initial_values_do_not_depend_on_the_partition():
    model = meta(gpt.GPT, **CONFIG)
    whole = initialized(model, 1, IDX).state_dict()
    for stages in (2, 3, 4):
        program = initialized(model, stages, IDX)
        state = program.state_dict()
        assert state.keys() == whole.keys()
        for key in whole:
            torch.testing.assert_close(state[key], whole[key], rtol=0, atol=0, msg=key)
    assert all(t.is_meta for t in model.state_dict().values())  # the model stays on meta
    assert program(IDX).shape == (8, 32, 512)


def test_every_module_draws_from_its_own_seed_and_the_seed_changes_them():
    state = initialized(meta(gpt.GPT, **CONFIG), 2, IDX).state_dict()
    first, second = state["blocks.0.attn.c_attn.weight"], state["blocks.1.attn.c_attn.weight"]
    assert not torch.equal(first, second)
    assert 0.015 < float(first.std()) < 0.025  # the model's _init_weights: normal(0, 0.02)
    assert torch.equal(state["blocks.0.ln_1.weight"], torch.ones(64))  # LayerNorm's reset
    assert torch.equal(state["wte.weight"], state["lm_head.weight"])  # tied: one tensor
    other = initialized(meta(gpt.GPT, **CONFIG), 2, IDX, seed=1).state_dict()
    assert not torch.equal(other["blocks.0.attn.c_attn.weight"], first)


def _llama(**changes: int):
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                                   **changes)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_a_transformers_model_gets_its_rotary_frequencies_from_its_initializers():
    model = meta(_llama)
    ids = torch.randint(0, 128, (4, 16))
    program = fxpipe.compile(model, (ids,), example_kwargs={"use_cache": False}, stages=2,
                             chunks=2, profile="a100", check="shapes")
    program.init_weights()
    real = _llama()
    tensors = {}
    for module in program.stage_modules:
        tensors.update(module.named_model_tensors())
    assert torch.equal(tensors["model.rotary_emb.inv_freq"], real.model.rotary_emb.inv_freq)
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.ones(32))  # RMSNorm has no reset_parameters: _init_weights
    assert torch.isfinite(program(ids, use_cache=False).logits).all()


class Causal(nn.Module):
    """A mask buffer computed in __init__: on meta it has no values, and nothing recomputes it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) @ self.mask


class CausalWithReset(Causal):
    """The same mask, recomputed by reset_parameters as well: initializers set it on meta."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.mask.copy_(torch.tril(torch.ones(4, 4)))


def test_a_buffer_no_initializer_sets_is_an_error_naming_it():
    program = fxpipe.compile(meta(Causal), (torch.randn(4, 4),), stages=1, profile="a100",
                             check="shapes")
    with pytest.raises(CheckpointError, match="no initializer of Causal writes mask") as error:
        program.init_weights()
    assert "reset_parameters" in str(error.value)


def test_a_buffer_that_reset_parameters_computes_gets_its_values():
    program = fxpipe.compile(meta(CausalWithReset), (torch.randn(4, 4),), stages=1,
                             profile="a100", check="shapes")
    program.init_weights()
    assert torch.equal(program.stage_modules[0].named_model_tensors()["mask"],
                       torch.tril(torch.ones(4, 4)))


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def reset_parameters(self) -> None:  # draws for both children, whichever stage holds them
        for p in self.parameters():
            nn.init.normal_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_an_initializer_drawing_for_tensors_of_several_stages_is_refused():
    with torch.device("meta"):
        pair = Pair()
    tensors = {"a.weight": pair.a.weight}  # a stage holding only a: b's draws are skipped
    with pytest.raises(CheckpointError, match="reset_parameters of the model .Pair. draws"):
        initialize(pair, tensors, torch.device("cpu"))
    both = initialize(pair, dict(pair.named_parameters()), torch.device("cpu"))
    spread = {name: float(t.detach().std()) > 0.5 for name, t in both.items()}
    assert spread == dict.fromkeys(both, True)


def test_init_weights_of_a_model_with_weights_is_an_error():
    program = fxpipe.compile(gpt.GPT(**CONFIG), (IDX,), stages=2, profile="a100")
    with pytest.raises(ConfigError, match="already has weights"):
        program.init_weights()


def test_balancing_by_measurement_is_refused_for_a_meta_model_with_what_to_do_instead(
        tmp_path, monkeypatch):
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))  # no balanced cut remembered
    with pytest.raises(ConfigError, match="meta device") as error:
        fxpipe.compile(meta(gpt.GPT, **CONFIG), (IDX,), stages=2, chunks=2, profile="a100",
                       check="shapes", balance="dynamic")
    assert "balance='cost'" in (error.value.hint or "")
