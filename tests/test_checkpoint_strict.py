"""Strict loads: a checkpoint that does not fit the model or optimizer loading it, or whose
files are damaged, is refused with a CheckpointError naming the file, the key and both values;
strict=False loads what fits and warns about the rest."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

import fxpipe
from fxpipe.errors import CheckpointError
from fxpipe.models import mlp

X = torch.randn(4, 8)
TARGET = torch.zeros(4, dtype=torch.long)


def _program(depth: int = 2, num_classes: int = 10, model=None):
    if model is None:
        model, _ = mlp.build(depth=depth, width=16, in_features=8, num_classes=num_classes,
                             batch=4)
    return fxpipe.compile(model, (X,), stages=2, chunks=2, profile="a100")


def _trained(program, optimizer_class=torch.optim.Adam):
    optimizer = optimizer_class(program.parameters(), lr=1e-3)
    program.step(X, target=TARGET)
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of a 2-block MLP with Adam state; tests copy it before they damage it."""
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    program = _program()
    program.save(str(directory), optimizer=_trained(program), step=1)
    return directory


@pytest.fixture
def ckpt(saved, tmp_path):
    copy = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", str(saved), str(copy)], check=True)
    return copy


def _parameter(program, key: str) -> torch.nn.Parameter:
    """The program's parameter that the model calls `key`."""
    pointer = program.state_dict()[key].data_ptr()
    return next(p for p in program.parameters() if p.data_ptr() == pointer)


def _shard(directory):
    meta = json.loads((directory / "checkpoint.json").read_text())
    return directory / meta["folder"] / meta["shards"][0]["file"]


def _rewrite(directory, change) -> None:
    """Changes the shard's content and re-stamps checkpoint.json, as a save of it would."""
    path = _shard(directory)
    shard = torch.load(path, weights_only=True)
    change(shard)
    torch.save(shard, path)
    _restamp(directory)


def _restamp(directory) -> None:
    meta = json.loads((directory / "checkpoint.json").read_text())
    path = _shard(directory)
    meta["shards"][0].update(bytes=path.stat().st_size,
                             sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    (directory / "checkpoint.json").write_text(json.dumps(meta))


# -- loads that accepted the wrong thing ---------------------------------------------------------


def test_a_checkpoint_of_a_deeper_model_is_refused_naming_its_extra_keys(tmp_path):
    deep = _program(depth=4)
    deep.save(str(tmp_path / "deep"))
    with pytest.raises(CheckpointError, match=r"unexpected key blocks\.2\.fc1\.weight in "
                                              r"save-000001/shard-00000\.pt") as e:
        _program(depth=2).load(str(tmp_path / "deep"))
    assert "strict=False" in str(e.value)


def test_a_checkpoint_of_another_model_class_is_refused(ckpt):
    class Other(mlp.MLP):
        pass

    other = Other(in_features=8, width=16, depth=2, num_classes=10)
    with pytest.raises(CheckpointError, match="model: MLP in checkpoint.json, this model is Other"):
        _program(model=other).load(str(ckpt))


def test_a_smaller_tensor_is_not_broadcast_into_the_model(tmp_path):
    one = _program(num_classes=1)
    one.save(str(tmp_path / "one"))
    ten = _program(num_classes=10)
    before = ten.state_dict()["head.bias"].clone()
    with pytest.raises(CheckpointError, match=r"head\.bias in save-000001/shard-00000\.pt: "
                                              r"expected float32\[10\], found float32\[1\]"):
        ten.load(str(tmp_path / "one"))
    assert torch.equal(ten.state_dict()["head.bias"], before)  # nothing was copied


def test_a_tensor_of_another_dtype_is_not_cast(ckpt):
    _rewrite(ckpt, lambda s: s["model"].update({"head.bias": torch.arange(10)}))
    with pytest.raises(CheckpointError, match=r"head\.bias in save-000001/shard-00000\.pt: "
                                              r"expected float32\[10\], found int64\[10\]"):
        _program().load(str(ckpt))


def test_a_missing_key_is_refused(ckpt):
    _rewrite(ckpt, lambda s: s["model"].pop("ln_f.weight"))
    with pytest.raises(CheckpointError, match=r"missing key ln_f\.weight: expected "
                                              r"float32\[16\], found none"):
        _program().load(str(ckpt))


def test_flipped_bytes_in_tensor_data_are_refused(ckpt):
    path = _shard(ckpt)
    data = bytearray(path.read_bytes())
    bias = torch.load(path, weights_only=True)["model"]["head.bias"]
    at = bytes(data).find(bias.numpy().tobytes())
    assert at > 0
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"shard-00000\.pt: sha256 [0-9a-f]{16}\.\.\., "
                                              r"checkpoint.json says [0-9a-f]{16}"):
        fxpipe.load_checkpoint(str(ckpt))


def test_an_optimizer_is_not_reset_by_a_checkpoint_without_optimizer_state(tmp_path):
    program = _program()
    program.save(str(tmp_path / "bare"))
    optimizer = _trained(program)
    kept = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    with pytest.raises(CheckpointError, match="optimizer: expected Adam state, found none"):
        program.load(str(tmp_path / "bare"), optimizer=optimizer)
    with pytest.warns(UserWarning, match="optimizer is left as it is"):
        program.load(str(tmp_path / "bare"), optimizer=optimizer, strict=False)
    for key, value in optimizer.state_dict()["state"][0].items():
        assert torch.equal(value, kept[key]), key


def test_adam_state_is_not_loaded_into_sgd(ckpt):
    program = _program()
    sgd = torch.optim.SGD(program.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match="optimizer: expected SGD state, found Adam state"):
        program.load(str(ckpt), optimizer=sgd)
    program.step(X, target=TARGET)
    sgd.step()  # untouched, so it still steps (it raised KeyError: 'momentum' before)


def test_an_optimizer_over_other_param_groups_is_refused(ckpt):
    program = _program()
    params = list(program.parameters())
    optimizer = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3)
    with pytest.raises(CheckpointError, match="in param group 1, in group 0 of the checkpoint"):
        program.load(str(ckpt), optimizer=optimizer)


# -- damaged files name the file -----------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch, about the garbage bytes
def test_a_damaged_shard_is_refused_naming_it(ckpt, damage):
    path = _shard(ckpt)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"",
                      "garbage": os.urandom(len(data))}[damage])
    with pytest.raises(CheckpointError, match=r"save-000001/shard-00000\.pt: \d+ bytes, "
                                              r"checkpoint.json says \d+|sha256"):
        fxpipe.load_checkpoint(str(ckpt))
    _restamp(ckpt)  # a damaged file that matches its checksum still names the file
    with pytest.raises(CheckpointError, match=r"shard-00000\.pt cannot be read as a checkpoint "
                                              r"shard \("):
        fxpipe.load_checkpoint(str(ckpt))


@pytest.mark.parametrize("text", ["{not json", "", "[]", '{"format": 2}'])
def test_a_bad_checkpoint_json_is_refused_naming_it(ckpt, text):
    (ckpt / "checkpoint.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"ckpt/checkpoint\.json (cannot be read as JSON|"
                                              r"is malformed)"):
        fxpipe.load_checkpoint(str(ckpt))


def test_a_checkpoint_of_the_older_layout_is_refused_with_its_format(ckpt):
    (ckpt / "checkpoint.json").write_text(json.dumps({"fxpipe": "0.1.0", "shards": 1, "step": 3,
                                                      "optimizer": False, "model": "MLP"}))
    with pytest.raises(CheckpointError, match="checkpoint format 1, this fxpipe reads format 2"):
        fxpipe.load_checkpoint(str(ckpt))


def test_a_malicious_pickle_does_not_run(ckpt, tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model": {}, "evil": Payload()}, _shard(ckpt))
    _restamp(ckpt)
    with pytest.raises(CheckpointError, match="cannot be read as a checkpoint shard"):
        _program().load(str(ckpt))
    assert not marker.exists()


# -- strict=False --------------------------------------------------------------------------------


def test_strict_false_loads_what_fits_and_names_what_it_skipped(tmp_path):
    deep = _program(depth=4, num_classes=1)
    saved = _trained(deep)
    deep.save(str(tmp_path / "deep"), optimizer=saved)
    program = _program(depth=2, num_classes=10)
    optimizer = _trained(program)
    head = program.state_dict()["head.bias"].clone()
    kept = {k: v.clone() for k, v in optimizer.state[_parameter(program, "head.bias")].items()}
    with pytest.warns(UserWarning) as warned:
        program.load(str(tmp_path / "deep"), optimizer=optimizer, strict=False)
    assert torch.equal(optimizer.state[_parameter(program, "proj.weight")]["exp_avg"],
                       saved.state[_parameter(deep, "proj.weight")]["exp_avg"])  # restored
    now = optimizer.state[_parameter(program, "head.bias")]
    assert kept and now.keys() == kept.keys()  # its tensor was skipped: its state is kept
    for key, value in now.items():
        assert torch.equal(value, kept[key]), key
    message = str(warned[0].message)
    assert "unexpected key blocks.3.fc2.bias" in message
    assert "head.bias in save-000001/shard-00000.pt: expected float32[10], found float32[1]" \
        in message
    assert "loaded the rest (strict=False)" in message
    mine = program.state_dict()
    for key, value in deep.state_dict().items():
        if key.startswith(("proj.", "blocks.0.", "blocks.1.", "ln_f.")):
            assert torch.equal(mine[key], value), key
    assert torch.equal(mine["head.bias"], head)  # skipped, not broadcast


def test_a_written_program_refuses_to_resume_from_adam_state(ckpt, tmp_path):
    program = _program()
    program.write(str(tmp_path / "prog"), target=TARGET, reference_steps=0)
    result = subprocess.run([sys.executable, str(tmp_path / "prog" / "program.py"), "--steps",
                             "1", "--resume", str(ckpt)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{ckpt} holds the state of Adam, and this run trains with SGD (--optimizer sgd)" \
        in result.stderr
    assert "hint: program.py trains with sgd or adamw: resume a checkpoint of Adam with " \
        "program.load(directory, optimizer=...) in your own loop" in result.stderr
