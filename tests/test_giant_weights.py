"""load_weights: a meta-compiled program reads its stages' tensors by the model's state_dict names
from a torch state dict, a safetensors file or a save_pretrained folder, and then computes what
the plain model loaded from the same files computes; wrong names and shapes are clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import fxpipe
from fxpipe.errors import CheckpointError, NotBuiltError
from fxpipe.models import gpt
from fxpipe.storage import weights
from fxpipe.storage.weights import match_names, open_weights

transformers = pytest.importorskip("transformers")

CONFIG = {"vocab_size": 512, "seq_len": 32, "d_model": 64, "n_layer": 2, "n_head": 4,
          "dropout": 0.0}
IDX = torch.randint(512, (8, 32), generator=torch.Generator().manual_seed(0))
TARGET = gpt.target((IDX,))


def meta_program(model: nn.Module | None = None, stages: int = 2, **kwargs) -> fxpipe.Program:
    if model is None:
        with torch.device("meta"):
            model = gpt.GPT(**CONFIG)
    return fxpipe.compile(model, (IDX,), stages=stages, chunks=4, profile="a100",
                          check="shapes", **kwargs)


@pytest.fixture(scope="module")
def plain() -> nn.Module:
    torch.manual_seed(3)
    return gpt.GPT(**CONFIG)


def assert_trains_like(program: fxpipe.Program, model: nn.Module) -> None:
    """Loss and every gradient of one step equal the plain model's."""
    loss = program.step(IDX, target=TARGET)
    expected = nn.functional.cross_entropy(model(IDX).flatten(0, 1), TARGET.flatten())
    model.zero_grad()
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), rel=1e-5)
    names = program._state_names()
    for module in program.stage_modules:
        for qualname, tensor in module.named_model_tensors().items():
            key = names.keys[qualname][0]
            torch.testing.assert_close(tensor.grad, model.get_parameter(key).grad,
                                       rtol=1e-4, atol=1e-6, msg=key)


def test_a_program_without_weights_refuses_to_run_and_says_how_to_get_them():
    program = meta_program()
    with pytest.raises(NotBuiltError, match="meta device") as error:
        program(IDX)
    assert "load_weights" in str(error.value) and "init_weights" in str(error.value)


@pytest.mark.parametrize("kind", ["torch", "safetensors"])
def test_weights_from_a_file_train_like_the_plain_model(tmp_path, plain, kind):
    state = plain.state_dict()
    if kind == "torch":
        path = tmp_path / "model.pt"
        torch.save(state, path)
    else:  # safetensors keeps one copy of a tied tensor: lm_head.weight is wte.weight
        path = tmp_path / "model.safetensors"
        save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, path)
    program = meta_program()
    program.load_weights(path)
    assert all(not p.is_meta for p in program.parameters())
    first, last = (m.named_model_tensors() for m in program.stage_modules)
    assert torch.equal(first["wte.weight"], state["wte.weight"])  # the tied weight lands on
    assert torch.equal(last["wte.weight"], state["wte.weight"])  # both stages that use it
    assert first["wte.weight"] is last["wte.weight"]  # in one process: one tensor, as in the model
    assert_trains_like(program, plain)


def _llama(tie: bool = True):
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                                   tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg).eval()


def _save_bin_shards(model: nn.Module, folder, shards: int = 3) -> None:
    """The sharded layout older transformers wrote: pytorch_model-*.bin and an index."""
    state = model.state_dict()
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({k: state[k] for k in keys[i::shards]}, folder / name)
        weight_map.update(dict.fromkeys(keys[i::shards], name))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
def test_a_sharded_checkpoint_folder_loads_into_a_meta_transformers_model(tmp_path, layout):
    torch.manual_seed(0)
    plain = _llama()
    if layout == "safetensors":  # save_pretrained, as transformers writes it today
        plain.save_pretrained(tmp_path, max_shard_size="20KB")
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
    else:
        _save_bin_shards(plain, tmp_path)
    with torch.device("meta"):
        model = _llama()
    ids = torch.randint(0, 128, (4, 16))
    program = fxpipe.compile(model, (ids,), example_kwargs={"use_cache": False}, stages=2,
                             chunks=2, profile="a100", check="shapes")
    program.load_weights(tmp_path)
    torch.testing.assert_close(program(ids, use_cache=False).logits,
                               plain(ids, use_cache=False).logits, rtol=1e-5, atol=1e-6)


def test_missing_extra_and_misshapen_names_are_errors_naming_them(tmp_path, plain):
    state = dict(plain.state_dict())
    del state["blocks.1.mlp.c_fc.bias"]
    state["blocks.9.ln_1.weight"] = torch.ones(64)
    torch.save(state, tmp_path / "wrong.pt")
    with pytest.raises(CheckpointError) as error:
        meta_program().load_weights(tmp_path / "wrong.pt")
    message = str(error.value)
    assert "1 tensors of the model are missing: blocks.1.mlp.c_fc.bias" in message
    assert "1 names are not the model's: blocks.9.ln_1.weight" in message
    del state["blocks.9.ln_1.weight"]
    state["blocks.1.mlp.c_fc.bias"] = torch.zeros(128)
    torch.save(state, tmp_path / "shape.pt")
    with pytest.raises(CheckpointError, match=r"blocks.1.mlp.c_fc.bias is \[128\] in the "
                                              r"checkpoint, \[256\] in the model"):
        meta_program().load_weights(tmp_path / "shape.pt")


def test_strict_false_ignores_names_the_model_does_not_have(tmp_path, plain):
    state = {**plain.state_dict(), "rotary.inv_freq": torch.ones(4)}
    torch.save(state, tmp_path / "extra.pt")
    program = meta_program()
    program.load_weights(tmp_path / "extra.pt", strict=False)
    assert_trains_like(program, plain)


def test_values_are_cast_to_the_models_dtypes(tmp_path, plain):
    save_file({k: v.to(torch.bfloat16) for k, v in plain.state_dict().items()
               if k != "lm_head.weight"}, tmp_path / "bf16.safetensors")
    program = meta_program()
    program.load_weights(tmp_path / "bf16.safetensors")
    weight = program.stage_modules[0].named_model_tensors()["wte.weight"]
    assert weight.dtype == torch.float32
    assert torch.equal(weight, plain.wte.weight.detach().to(torch.bfloat16).float())


def test_a_program_with_weights_is_overwritten_in_place(tmp_path, plain):
    torch.save(plain.state_dict(), tmp_path / "model.pt")
    model = gpt.GPT(**CONFIG)
    program = fxpipe.compile(model, (IDX,), stages=2, chunks=4, profile="a100")
    program.load_weights(tmp_path / "model.pt")
    assert torch.equal(model.wte.weight, plain.wte.weight)  # the model shares the tensors


def test_bad_paths_and_files_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no weights at"):
        open_weights(tmp_path / "nothing.pt")
    with pytest.raises(CheckpointError, match="found no weights in the folder"):
        open_weights(tmp_path)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="not a state dict"):
        open_weights(tmp_path / "list.pt")


def test_match_names_takes_the_first_key_of_a_tied_tensor_the_checkpoint_holds():
    wanted = {"wte.weight": ("wte.weight", "lm_head.weight"), "ln.bias": ("ln.bias",)}
    known = ["wte.weight", "lm_head.weight", "ln.bias"]
    assert match_names(["lm_head.weight", "ln.bias"], wanted, known) == {
        "wte.weight": "lm_head.weight", "ln.bias": "ln.bias"}
    with pytest.raises(CheckpointError, match="missing: wte.weight or lm_head.weight"):
        match_names(["ln.bias"], wanted, known)


def test_safetensors_reads_in_chunks_give_every_tensor_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "CHUNK_BYTES", 64)  # a few rows at a time
    tensors = {"rows": torch.randn(37, 5), "scalar": torch.tensor(3.0),
               "empty": torch.zeros(0, 4), "ints": torch.arange(10)}
    save_file(tensors, tmp_path / "t.safetensors")
    source = open_weights(tmp_path / "t.safetensors")
    for key, value in tensors.items():
        assert torch.equal(source.read(key, torch.device("cpu"), value.dtype), value), key


def test_a_meta_program_resumes_from_an_fxpipe_checkpoint_and_refuses_to_save_nothing(
        tmp_path, plain):
    program = fxpipe.compile(gpt.GPT(**CONFIG), (IDX,), stages=2, chunks=4, profile="a100")
    torch.save(plain.state_dict(), tmp_path / "model.pt")
    program.load_weights(tmp_path / "model.pt")
    program.save(str(tmp_path / "ckpt"))
    resumed = meta_program()
    with pytest.raises(NotBuiltError, match="meta device"):
        resumed.save(str(tmp_path / "nothing"))
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1)
    with pytest.raises(fxpipe.FxPipeError, match="optimizer was made before the stages had"):
        resumed.load(str(tmp_path / "ckpt"), optimizer=optimizer)
    resumed.load(str(tmp_path / "ckpt"))
    assert_trains_like(resumed, plain)
