"""Giant models under torchrun: every rank compiles the model on the meta device and allocates,
initializes or reads only its own stage; the pipeline then trains like the plain model loaded
from the same files, and each rank's peak memory stays below the plain model's."""
from __future__ import annotations

import pytest
import torch
from ranks import spawn
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fxpipe
from fxpipe.losses import default_loss
from fxpipe.models import gpt

transformers = pytest.importorskip("transformers")

GPT_CONFIG = {"vocab_size": 512, "seq_len": 32, "d_model": 64, "n_layer": 2, "n_head": 4,
              "dropout": 0.0}
LLAMA = {"num_hidden_layers": 2, "hidden_size": 768, "num_attention_heads": 12,
         "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 32000,
         "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 0,
         "tie_word_embeddings": False}  # 62M parameters (247 MB), 40% in each embedding
STEPS, LR = 3, 0.1


class Allocations(TorchDispatchMode):
    """Bytes of every storage an operation creates outside the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta \
                    and t.untyped_storage().data_ptr() not in inputs:
                self.nbytes += t.untyped_storage().nbytes()
        return out


def _stage_bytes(program: fxpipe.Program) -> int:
    tensors = {id(t): t for m in program.stage_modules for t in m.named_model_tensors().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _reset_peak() -> int:
    """Starts a new peak of this process's resident memory (Linux: VmHWM); returns the current."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _peak() -> int:
    """The peak resident memory since _reset_peak (as getrusage's ru_maxrss counts it)."""
    return _status("VmHWM")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


# --- each rank allocates only its own stage ---------------------------------------------------

def _allocations(rank: int, world: int, path: str) -> dict:
    with torch.device("meta"):
        model = gpt.GPT(**GPT_CONFIG)
    idx = torch.randint(512, (8, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    for how in ("init", "load"):
        program = fxpipe.compile(model, (idx,), stages=2, chunks=2, profile="a100",
                                 check="shapes")
        allocations = Allocations()
        with allocations:
            program.init_weights() if how == "init" else program.load_weights(path)
        out[how] = {"allocated": allocations.nbytes, "stage": _stage_bytes(program),
                    "names": sorted(program.state_dict()),
                    "wte": program.state_dict()["wte.weight"],
                    "model_on_meta": all(t.is_meta for t in model.state_dict().values()),
                    "loss": program.step(idx, target=gpt.target((idx,)))}
    return out


def test_each_rank_allocates_and_reads_only_the_tensors_of_its_own_stage(tmp_path):
    torch.manual_seed(0)
    plain = gpt.GPT(**GPT_CONFIG)
    state = plain.state_dict()
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"},
              tmp_path / "model.safetensors")
    model_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    smallest = min(p.numel() * p.element_size() for p in plain.parameters())
    ranks = spawn(2, __name__, "_allocations", str(tmp_path / "model.safetensors"))
    for how in ("init", "load"):
        first, last = ranks[0][how], ranks[1][how]
        for rank in (first, last):
            # the stage, and less than any tensor of another stage (the executor's small flags)
            assert 0 <= rank["allocated"] - rank["stage"] < smallest
            assert rank["stage"] < model_bytes
            assert rank["model_on_meta"]
        assert set(first["names"]) | set(last["names"]) == set(state)
        assert torch.equal(first["wte"], last["wte"])  # the tied weight: on both, the same
        assert first["loss"] == last["loss"]
    assert torch.equal(ranks[0]["load"]["wte"], state["wte.weight"])


# --- end to end: save_pretrained, meta compile, 2 ranks, against the plain model ---------------

def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    vocab = LLAMA["vocab_size"]
    return torch.randint(0, vocab, (4, 16), generator=g), torch.randint(0, vocab, (4, 16),
                                                                         generator=g)


def _train(model, params, step_fn, compare=None) -> list[float]:
    """STEPS steps of SGD; `compare(step)` checks the gradients before each update."""
    optimizer = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(STEPS):
        losses.append(step_fn())
        if compare is not None:
            compare(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _plain(rank: int, world: int, folder: str, grads_path: str) -> dict:
    ids, target = _batch()

    def load():
        return transformers.LlamaForCausalLM.from_pretrained(folder).eval()

    def step_fn(model):
        def run() -> float:
            loss = default_loss(model(ids, use_cache=False), target)
            loss.backward()
            return float(loss)
        return run

    before = _reset_peak()
    model = load()
    losses = _train(model, model.parameters(), step_fn(model))
    growth = _peak() - before  # measured first: the recorded gradients below take memory
    del model
    model, grads = load(), {}

    def record(step: int) -> None:
        grads.update({f"{step}/{k}": p.grad.clone() for k, p in model.named_parameters()})

    assert _train(model, model.parameters(), step_fn(model), record) == losses
    save_file(grads, grads_path)
    return {"losses": losses, "growth": growth}


def _pipelined(rank: int, world: int, folder: str, grads_path: str) -> dict:
    ids, target = _batch()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    program = fxpipe.compile(model, (ids,), example_kwargs={"use_cache": False}, stages=2,
                             chunks=2, profile="a100", check="shapes")
    names = {}  # parameter -> the model's key (untied: its qualified name)

    def step_fn() -> float:
        return program.step(ids, use_cache=False, target=target)

    before = _reset_peak()
    program.load_weights(folder)  # this rank's tensors only, from the safetensors shards
    loaded = _peak() - before
    losses = _train(model, program.parameters(), step_fn)
    growth = _peak() - before
    program.load_weights(folder)  # again, in place: now every gradient is compared
    names.update({id(getattr(m, attr)): q for m in program.stage_modules
                  for attr, q in m.PARAMETERS.items()})
    worst = [0.0]

    def compare(step: int) -> None:
        for p in program.parameters():
            expected = _read(grads_path, f"{step}/{names[id(p)]}")
            torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6)
            worst[0] = max(worst[0], float((p.grad - expected).abs().max()))

    assert _train(model, program.parameters(), step_fn, compare) == losses
    return {"losses": losses, "growth": growth, "loaded": loaded, "worst": worst[0],
            "stage": _stage_bytes(program), "keys": len(names)}


def _read(path: str, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return f.get_tensor(key).clone()


@pytest.mark.slow
def test_ranks_load_their_stage_from_save_pretrained_and_train_like_the_plain_model(tmp_path):
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    plain.save_pretrained(tmp_path / "ckpt", max_shard_size="100MB")
    model_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    del plain
    grads = str(tmp_path / "grads.safetensors")
    (reference,) = spawn(1, __name__, "_plain", str(tmp_path / "ckpt"), grads, bound=600)
    ranks = spawn(2, __name__, "_pipelined", str(tmp_path / "ckpt"), grads, bound=600)
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=1e-5, atol=0)
        assert rank["stage"] < 0.7 * model_bytes
        assert rank["loaded"] < 0.7 * model_bytes  # reading: one tensor at a time, mapped
        # params, gradients and activations of one stage, against the plain model's
        assert rank["growth"] < reference["growth"], (rank["growth"], reference["growth"])
    assert sum(rank["keys"] for rank in ranks) == 2 * 9 + 3  # every parameter, on one rank
    print(f"peak memory growth: plain {reference['growth'] / 2**20:.0f} MiB, ranks "
          f"{[round(r['growth'] / 2**20) for r in ranks]} MiB (loading "
          f"{[round(r['loaded'] / 2**20) for r in ranks]} MiB); model {model_bytes / 2**20:.0f} "
          f"MiB; largest gradient difference {max(r['worst'] for r in ranks):.2e}")
