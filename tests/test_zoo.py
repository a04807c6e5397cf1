"""The model zoo (tests/zoo_models.py): third-party models from small configs, random weights.

Every entry compiles and equals the eager model in eval mode at 2 and 4 stages, and in training
mode at 2 stages its gradients equal the plain model's over the same micro-batches
(fxpipe.testing.reference_step: per-micro-batch BatchNorm, the same random streams). The loss is
linear in every batched output, so each output's gradient is checked.

Needs the zoo's libraries (`.ci/zoo` installs them in a venv of its own and fails if this module
is skipped). With FXPIPE_ZOO_TABLE=path the run writes its summary table (model, capture front
end, compile CPU and wall seconds, pass/fail) there.

No check compares zeros: a floating reference output that is all zeros fails the check, and so
does a parameter whose gradient in the plain model is all zeros (unless ZERO_GRADIENTS gives the
reason), since an all-zero reference is matched by anything that also returns zeros. The zoo
fills the weights that libraries initialise to zero (zoo_models.fill_zero_parameters) so that
its models have neither.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

import fxpipe
from fxpipe import ir
from fxpipe.testing.reference_step import reference_forward

for _library in ("torchvision", "timm", "diffusers", "transformers",
                 "segmentation_models_pytorch", "monai"):
    pytest.importorskip(_library)

import zoo_models  # noqa: E402 - after the libraries it builds from are known to be there

pytestmark = pytest.mark.slow

# Models that cannot pass, with the reason (the closing note lists them).
LEFT_OUT = {
    "hf_switch_moe": "its sparse MLP loops over the experts the router chose (`for expert_idx "
                     "in expert_hit`, from nonzero): data-dependent control flow that neither "
                     "torch.fx nor torch.export captures; fxpipe refuses it with a CaptureError "
                     "naming that line",
    "hf_llava": "`image_features = list(image_features)` (modeling_llava.py) splits the batch "
                "into a Python list of samples, so the exported graph holds for the example's "
                "batch size only and cannot run on micro-batches; fxpipe refuses it naming that "
                "line (scattering image features at token positions itself pipelines: "
                "tests/test_backward_inplace_and_train_paths.py)",
}
# Models that need a capture option, with the reason.
CAPTURE = {
    "hf_detr": "follow_branches",  # train mode clamps non-finite encoder states behind an `if`
}
# Parameters whose gradient is exactly zero in the plain model by construction, per model, with
# the reason; any other all-zero gradient fails the gradient check.
_CLASS_TOKEN_HEAD = ("the last block's query pooling and relative position bias act only on the "
                     "patch-token queries, and the head reads only the class token")
ZERO_GRADIENTS: dict[str, dict[str, str]] = {
    "hf_detr": {
        "model.decoder.layers.0.self_attn.v_proj.weight":
            "the decoder starts from zeros (the object queries enter only as position "
            "embeddings added to queries and keys), so the first self-attention's values are "
            "its bias alone",
    },
    "tv_mvit_v2_small_cfg": {f"blocks.1.attn.{p}": _CLASS_TOKEN_HEAD for p in (
        "rel_pos_h", "rel_pos_w", "rel_pos_t", "pool_q.pool.weight")},
}
ENTRIES = [e.name for e in zoo_models.ZOO if e.name not in LEFT_OUT]
RESULTS: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module", autouse=True)
def _one_thread_and_table() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    path = os.environ.get("FXPIPE_ZOO_TABLE")
    if path:
        with open(path, "w") as f:
            f.write(_table())


def _table() -> str:
    lines = ["| model | library | category | capture (eval / train) | "
             "compile CPU s (eval@2) | compile wall s (eval@2) | eval@2 | eval@4 | train-grad@2 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for entry in zoo_models.ZOO:
        if entry.name in LEFT_OUT:
            continue
        r = RESULTS.get(entry.name, {})
        cpu = f"{r['cpu_seconds']:.1f}" if "cpu_seconds" in r else "-"
        wall = f"{r['wall_seconds']:.1f}" if "wall_seconds" in r else "-"
        cells = [entry.name, entry.library, entry.category,
                 f"{r.get('method_eval', '-')} / {r.get('method_train', '-')}", cpu, wall,
                 *(r.get(k, "not run") for k in ("eval2", "eval4", "train2"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _record(name: str, key: str, value: Any) -> None:
    RESULTS.setdefault(name, {})[key] = value


def _assert_not_all_zero(leaf: Any, what: str) -> None:
    """A floating reference that is all zeros would be matched by any output of zeros."""
    if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel():
        assert leaf.detach().any(), f"{what} is all zeros: the check would compare zeros"


def _assert_outputs_close(got: Any, expected: Any) -> None:
    assert type(got) is type(expected), (type(got), type(expected))
    got_leaves, expected_leaves = pytree.tree_leaves(got), pytree.tree_leaves(expected)
    assert len(got_leaves) == len(expected_leaves)
    for i, (g, e) in enumerate(zip(got_leaves, expected_leaves)):
        if not isinstance(e, torch.Tensor):
            assert g == e, f"output leaf {i}"
            continue
        _assert_not_all_zero(e, f"reference output leaf {i}")
        scale = float(e.detach().abs().max()) if e.numel() and e.is_floating_point() else 1.0
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-5 + 1e-4 * scale,
                                   msg=lambda m, i=i: f"output leaf {i}: {m}")


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", ENTRIES)
def test_zoo_model_equals_eager_in_eval_mode(name, stages):
    key = f"eval{stages}"
    _record(name, key, "FAIL")
    model, args, kwargs = zoo_models.get(name).build()
    model.eval()
    cpu, wall = time.process_time(), time.perf_counter()
    program = fxpipe.compile(model, args, example_kwargs=kwargs, stages=stages, chunks=2,
                             capture=CAPTURE.get(name, "auto"))
    if stages == 2:
        _record(name, "cpu_seconds", time.process_time() - cpu)
        _record(name, "wall_seconds", time.perf_counter() - wall)
        _record(name, "method_eval", program.graph_module.meta[ir.CAPTURE].method)
    with torch.no_grad():
        _assert_outputs_close(program(*args, **kwargs), model(*args, **kwargs))
    _record(name, key, "pass")


def _linear_loss(out: Any, weights: list[torch.Tensor | None]) -> torch.Tensor:
    """Linear in every batched float output, so the loss of the joined micro-batch outputs
    checks the gradient of each of them."""
    total = torch.zeros(())
    for leaf, w in zip(pytree.tree_leaves(out), weights):
        if w is not None:
            total = total + (leaf.float() * w).sum() / zoo_models.BATCH
    return total


@pytest.mark.parametrize("name", ENTRIES)
def test_zoo_model_gradients_equal_the_plain_models_over_the_same_microbatches(name):
    _record(name, "train2", "FAIL")
    model, args, kwargs = zoo_models.get(name).build()
    model.train()
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, args, example_kwargs=kwargs, stages=2, chunks=2,
                             capture=CAPTURE.get(name, "auto"))
    _record(name, "method_train", program.graph_module.meta[ir.CAPTURE].method)
    torch.manual_seed(1)
    out = program(*args, **kwargs)
    generator = torch.Generator().manual_seed(2)
    weights = [torch.randn(leaf.shape, generator=generator)
               if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim()
               and leaf.shape[0] == zoo_models.BATCH else None
               for leaf in pytree.tree_leaves(out)]
    assert any(w is not None for w in weights), "no batched output to take a loss of"
    _linear_loss(out, weights).backward()
    torch.manual_seed(1)
    reference = reference_forward(program, plain, *args, **kwargs)
    for i, (leaf, w) in enumerate(zip(pytree.tree_leaves(reference), weights)):
        if w is not None:
            _assert_not_all_zero(leaf, f"reference output leaf {i}")
    _linear_loss(reference, weights).backward()
    checked = 0
    zero = []
    allowed = ZERO_GRADIENTS.get(name, {})
    ours = dict(model.named_parameters())
    for pname, p in plain.named_parameters():
        if p.grad is None:
            assert ours[pname].grad is None or not ours[pname].grad.any(), pname
            continue
        if p.grad.numel() and not p.grad.any() and pname not in allowed:
            zero.append(pname)
        scale = float(p.grad.abs().max()) if p.grad.numel() else 1.0
        torch.testing.assert_close(ours[pname].grad, p.grad, rtol=1e-3, atol=1e-6 + 1e-4 * scale,
                                   msg=lambda m, n=pname: f"gradient of {n}: {m}")
        checked += 1
    assert checked
    assert not zero, (f"{len(zero)} parameter(s) with an all-zero gradient in the plain model, "
                      f"so their check compares zeros: {zero}")
    _record(name, "train2", "pass")


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_t5", "diffusers_dit"])
def test_written_program_of_a_library_model_with_structured_outputs_runs(name, tmp_path):
    """Their outputs are library types (CausalLMOutputWithCrossAttentions, Seq2SeqLMOutput,
    Transformer2DModelOutput) that the launcher rebuilds in a fresh process."""
    model, args, kwargs = zoo_models.get(name).build()
    program = fxpipe.compile(model.train(), args, example_kwargs=kwargs, stages=2, chunks=2)
    program(*args, **kwargs)  # builds it
    program.write(str(tmp_path), reference_steps=0)
    proc = subprocess.run([sys.executable, str(tmp_path / "program.py"), "--steps", "1"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "step 0 loss" in proc.stdout
