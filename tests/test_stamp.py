"""Repeated blocks captured once (fxpipe.frontend.stamp): a stamped capture is the full capture,
node for node up to names; every case it cannot prove falls back and says why."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxpipe
from fxpipe import ir
from fxpipe.frontend.blocks import BlockRun, find_blocks, reduced
from fxpipe.frontend.capture import capture
from fxpipe.passes.cost import annotate_costs
from fxpipe.testing.reference_step import reference_step
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
    model, inputs = gpt.build(n_layer=7, dropout=0.0, batch=4)
    return model, inputs, {}


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))


def _llama() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    cfg = transformers.LlamaConfig(num_hidden_layers=7, hidden_size=32, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=64, vocab_size=128,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg), (_ids(),), {"use_cache": False}


def _mistral() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    cfg = transformers.MistralConfig(num_hidden_layers=7, hidden_size=32, num_attention_heads=2,
                                     num_key_value_heads=1, intermediate_size=64, vocab_size=128,
                                     max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return transformers.MistralForCausalLM(cfg), (_ids(),), {"use_cache": False}


def _gpt2() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    cfg = transformers.GPT2Config(n_layer=7, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), (_ids(),), {"use_cache": False}


def _bert() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    cfg = transformers.BertConfig(num_hidden_layers=7, hidden_size=32, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=128, max_position_embeddings=64)
    return transformers.BertModel(cfg), (_ids(),), {}


def _t5() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """Encoder and decoder stacks; block 0 of each owns the relative position bias."""
    cfg = transformers.T5Config(num_layers=7, num_decoder_layers=7, d_model=32, d_kv=8, d_ff=64,
                                num_heads=2, vocab_size=128, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    ids = _ids()
    return transformers.T5Model(cfg), (ids,), {"decoder_input_ids": ids, "use_cache": False}


def _vit() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """A timm ViT: its blocks an nn.Sequential, read by a classification head after a norm."""
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                              embed_dim=32, num_heads=2, depth=6, num_classes=10)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return model, (images,), {}


def _hf_vit() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """transformers' ViT: a vision transformer the test tier always has (timm needs a
    torchvision built for the installed torch)."""
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
                                 num_hidden_layers=6, num_attention_heads=2, intermediate_size=64,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                 num_labels=10)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return transformers.ViTForImageClassification(cfg), (images,), {}


MODELS = {"gpt": _gpt, "llama": _llama, "gpt2": _gpt2, "mistral": _mistral, "bert": _bert,
          "t5": _t5, "vit": _vit, "hf_vit": _hf_vit}


def _both(build: Any, method: str = "auto", inline: bool = True
          ) -> tuple[nn.Module, fx.GraphModule, fx.GraphModule, tuple[Any, ...], dict[str, Any]]:
    torch.manual_seed(0)
    model, inputs, kwargs = build()
    model.eval()
    full = capture(model, inputs, kwargs, method=method, inline_modules=inline)
    stamped = capture(model, inputs, kwargs, method=method, inline_modules=inline, stamp=True)
    return model, full, stamped, inputs, kwargs


# mistral's blocks are llama's with another attention window, and T5's (two lists, about 8 s)
# are the slowest: the slow tier checks them
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in ("mistral", "t5") else n for n in sorted(MODELS)])
def test_a_stamped_capture_is_the_full_capture(name: str) -> None:
    model, full, stamped, inputs, kwargs = _both(MODELS[name])
    info = stamped.meta[ir.CAPTURE]
    lists = _lists(model)  # T5: its encoder's and its decoder's blocks
    assert len(lists) == (2 if name == "t5" else 1)
    assert info.stamped == sum(len(blocks) - 3 for blocks in lists.values()), info.stamp_note
    assert info.stamp_note == "stamped " + " and ".join(
        f"{len(b) - 3} of the {len(b)} blocks of {p}" for p, b in lists.items()) + \
        " from the graph of one"
    assert full.meta[ir.CAPTURE].stamp_note is None
    assert canonical(stamped) == canonical(full)
    assert list(stamped.state_dict()) == list(full.state_dict())
    annotate_costs(full)
    handed = annotate_costs(stamped).handed_over
    assert canonical(stamped, costs=True) == canonical(full, costs=True)
    # blocks 3..N-2 took block 2's costs (the cut at block 3 the others cost is what is compared)
    assert handed == sum(1 for n in ir.compute_nodes(stamped.graph) for p, b in lists.items()
                         if _block_index(n, p) in range(3, len(b) - 1))
    with seeded(0):
        expected = model(*inputs, **kwargs)
    got = stamped(*inputs, **kwargs)
    for e, g in zip(_tensors(expected), _tensors(got)):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("inline", [True, False], ids=["functional", "modules"])
@pytest.mark.parametrize("method", ["fx", "export"])
def test_the_bundled_gpt_stamped_under_fx_and_export(method: str, inline: bool) -> None:
    model, full, stamped, inputs, _ = _both(_gpt, method, inline)
    assert stamped.meta[ir.CAPTURE].stamped == 4
    assert canonical(stamped) == canonical(full)
    assert list(stamped.state_dict()) == list(full.state_dict())
    torch.testing.assert_close(stamped(*inputs), model(*inputs))


def _lists(model: nn.Module) -> dict[str, nn.ModuleList | nn.Sequential]:
    """The lists of blocks: ModuleLists, and Sequentials (timm's ViT blocks) of 4 or more."""
    return {p: m for p, m in model.named_modules()
            if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 4}


def _block_index(node: fx.Node, path: str) -> int | None:
    from fxpipe.frontend.stamp import _block_of

    return _block_of(node, path)


def _tensors(value: Any) -> list[torch.Tensor]:
    import torch.utils._pytree as pytree

    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


# --- the pipelined model ----------------------------------------------------------------------

def _loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    keyed = isinstance(output, dict) or hasattr(output, "keys")
    if keyed and "logits" not in output:  # T5Model: its decoder's last hidden state
        return output["last_hidden_state"].float().pow(2).mean()
    logits = output["logits"] if keyed else output
    if logits.dim() == 2:  # the ViT: a class per image
        return nn.functional.cross_entropy(logits, target)
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _target(name: str, inputs: tuple[Any, ...]) -> torch.Tensor:
    """A class per token (the language models), or per image (the ViT)."""
    generator = torch.Generator().manual_seed(1)
    if name in ("vit", "hf_vit"):
        return torch.randint(0, 10, inputs[0].shape[:1], generator=generator)
    return torch.randint(0, 128, inputs[0].shape, generator=generator)


@pytest.mark.parametrize("name", ["gpt", "llama", pytest.param("t5", marks=pytest.mark.slow),
                                  "vit", "hf_vit"])  # T5 (about 4 s) in the slow tier
def test_the_pipelined_stamped_model_equals_the_eager_model(name: str) -> None:
    torch.manual_seed(0)
    model, inputs, kwargs = MODELS[name]()
    model.train()
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, inputs, example_kwargs=kwargs, stages=2, chunks=2,
                             stamp=True)
    info = program.built.capture_info
    assert info.stamped == sum(len(b) - 3 for b in _lists(model).values()), info.stamp_note
    assert "repeated blocks: stamped" in program.report().text()
    with torch.no_grad(), seeded(0):
        got = program(*inputs, **kwargs)
    with torch.no_grad(), seeded(0):
        expected = plain(*inputs, **kwargs)
    for e, g in zip(_tensors(expected), _tensors(got)):
        torch.testing.assert_close(g, e)
    target = _target(name, inputs)
    loss_fn = _loss
    with seeded(0):
        loss = program.step(*inputs, target=target, loss_fn=loss_fn, **kwargs)
    with seeded(0):
        expected_loss = reference_step(program, plain, *inputs, target=target, loss_fn=loss_fn,
                                       **kwargs)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    ours = {n: p.grad for n, p in model.named_parameters()}
    theirs = {n: p.grad for n, p in plain.named_parameters()}
    assert ours.keys() == theirs.keys()
    for key, grad in theirs.items():
        assert grad is not None and ours[key] is not None, key
        torch.testing.assert_close(ours[key], grad, msg=key)


# --- what falls back --------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, width: int, index: int = 0, p: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(p)
        self.layer_idx = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


class _IndexBlock(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * (self.layer_idx + 1)


class _Net(nn.Module):
    def __init__(self, blocks: list[nn.Module], width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class _SkipBlock(_Block):
    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) + skip


class _SkipNet(_Net):
    """Each block reads the output of the block two before: not a chain."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [self.embed(x)]
        for block in self.blocks:
            outs.append(block(outs[-1], outs[-2] if len(outs) > 1 else outs[-1]))
        return self.head(outs[-1])


class _BetweenNet(_Net):
    """An operation between the blocks, outside any of them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) * 0.5
        return self.head(h)


class _CountedNet(_Net):
    """Loops over a number of layers kept apart from the list, as range(config.n_layer) does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i in range(5):
            h = self.blocks[i](h)
        return self.head(h)


def _hooked() -> nn.Module:
    net = _Net([_Block(8, i) for i in range(5)])
    net.blocks[3].register_forward_hook(lambda m, i, o: o * 2)
    return net


def _shared() -> nn.Module:
    net = _Net([_Block(8, i) for i in range(5)])
    net.blocks[4].fc.weight = net.blocks[3].fc.weight
    return net


FALLBACKS = {
    "different config": (lambda: _Net([_Block(8, i, p=0.5 if i == 3 else 0.0)
                                       for i in range(5)]), "blocks 1 and 3 of blocks differ"),
    "hook": (_hooked, "blocks.3 has a hook (forward hook)"),
    "own index": (lambda: _Net([_IndexBlock(8, i) for i in range(5)]),
                  "the blocks of blocks read their position (layer_idx) in forward"),
    "shared weights": (_shared, "blocks 3 and 4 of blocks share the weight 'fc.weight'"),
    "not a chain": (lambda: _SkipNet([_SkipBlock(8, i) for i in range(5)]), "not a chain"),
    "between": (lambda: _BetweenNet([_Block(8, i) for i in range(5)]), "between the blocks"),
    "too few": (lambda: _Net([_Block(8, i) for i in range(3)]), "4 or more blocks"),
    "counted loop": (lambda: _CountedNet([_Block(8, i) for i in range(5)]),
                     "the model with 3 blocks of blocks was not captured"),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
@pytest.mark.parametrize("method", ["fx", "export"])
def test_blocks_that_cannot_be_stamped_fall_back_and_say_why(case: str, method: str) -> None:
    build, why = FALLBACKS[case]
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(4, 4)
    full = capture(model, (x,), method=method, inline_modules=True)
    gm = capture(model, (x,), method=method, inline_modules=True, stamp=True)
    info = gm.meta[ir.CAPTURE]
    assert info.stamped == 0
    assert info.stamp_note.startswith("not stamped: ") and why in info.stamp_note, \
        info.stamp_note
    assert "\n" not in info.stamp_note
    assert canonical(gm) == canonical(full)
    torch.testing.assert_close(gm(x), model(x))


def test_the_report_says_why_blocks_were_not_stamped() -> None:
    torch.manual_seed(0)
    model = _hooked().train()
    x = torch.randn(4, 4)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, stamp=True)
    assert "repeated blocks: not stamped: blocks.3 has a hook (forward hook)" \
        in program.report().text()
    torch.testing.assert_close(program(x), model(x))


class _Detached(_Block):  # the values of every block alike, the gradient not
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_idx == 2:
            x = x.detach()
        return x + torch.tanh(self.fc(x))


class _Clamped(_Block):  # a clamp the example batch does not reach
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_idx == 2:
            x = x.clamp(-5, 5)
        return x + torch.tanh(self.fc(x))


class _Late(_Block):  # blocks 1, 2 and the last agree
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + torch.tanh(self.fc(x))
        return y * 2 if self.layer_idx == 3 else y


@pytest.mark.parametrize("block", [_Detached, _Clamped, _Late])
def test_blocks_reading_their_position_are_not_stamped_and_train_as_the_plain_model(block):
    # a block not traced (2, 3) branches where the traced ones (0, 1, 5) do not: no check of
    # values finds a detach, or a clamp the example batch does not reach
    torch.manual_seed(0)
    model = _Net([block(8, i) for i in range(6)])
    plain = copy.deepcopy(model)
    x = torch.randn(4, 4)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, stamp=True)
    info = program.built.capture_info
    assert info.stamped == 0
    assert "the blocks of blocks read their position (layer_idx) in forward" in info.stamp_note
    loss = program.step(x, target=None, loss_fn=lambda out: out.pow(2).mean())
    expected = plain(x).pow(2).mean()
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    theirs = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad is None) == (theirs[name].grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, theirs[name].grad, msg=name)
    big = 100 * torch.randn(4, 4)
    torch.testing.assert_close(program(big), plain(big))


def test_a_block_whose_position_is_kept_but_not_read_is_stamped() -> None:
    torch.manual_seed(0)
    model = _Net([_Block(8, i) for i in range(6)])  # layer_idx kept for bookkeeping only
    gm = capture(model.eval(), (torch.randn(4, 4),), method="fx", inline_modules=True,
                 stamp=True)
    assert gm.meta[ir.CAPTURE].stamped == 3
    assert all(type(b.layer_idx) is int for b in model.blocks)  # put back


def test_a_stamped_capture_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model, inputs, kwargs = _llama()
    model.eval()
    modules = [(name, type(m), m) for name, m in model.named_modules()]
    state = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    values = {k: v.detach().clone() for k, v in state.items()}
    gm = capture(model, inputs, kwargs, stamp=True)
    assert gm.meta[ir.CAPTURE].stamped == 4
    assert [(name, type(m), m) for name, m in model.named_modules()] == modules
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(state) and all(after[k] is state[k] for k in state)
    for k, v in values.items():
        torch.testing.assert_close(after[k].detach(), v)


def test_the_model_is_put_back_when_the_reduced_capture_fails() -> None:
    model = _Net([_Block(8, i) for i in range(5)])
    blocks = list(model.blocks)
    run = find_blocks(model)
    assert run == BlockRun("blocks", 5)
    with pytest.raises(RuntimeError, match="while reduced"):
        with reduced(model, run):
            assert list(model.blocks) == [blocks[0], blocks[1], blocks[4]]
            raise RuntimeError("while reduced")
    assert list(model.blocks) == blocks
    assert [name for name, _ in model.named_modules()] == \
        ["", "embed", "blocks", *[f"blocks.{i}{part}" for i in range(5)
                                  for part in ("", ".fc", ".drop")], "head"]


# --- at depth ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_model_of_hundreds_of_layers_on_meta_is_stamped_and_pipelined() -> None:
    layers, stages = 300, 12
    with torch.device("meta"):
        model = gpt.GPT(vocab_size=256, seq_len=16, d_model=32, n_layer=layers, n_head=2,
                        dropout=0.0)
    idx = torch.zeros(8, 16, dtype=torch.long)
    program = fxpipe.compile(model, (idx,), stages=stages, chunks=4, check="shapes",
                             profile="h100", stamp=True)
    info = program.built.capture_info
    assert info.stamped == layers - 3, info.stamp_note
    # never run whole: the stamped graph's shape propagation stands for the 300 layers
    assert "derived from the stamped graph" in info.checked, info.checked
    assert len(program.built.stages) == stages
    names = set(model.state_dict())
    weights = {n for n, _ in model.named_parameters()}  # lm_head.weight is wte.weight, tied
    held: set[str] = set()
    for stage in program.built.stages:
        own = set(stage.graph.graph_module.state_dict())
        assert own <= names, sorted(own - names)[:5]
        held |= own
    assert held == weights


class _Wrapper(nn.Module):
    """A function held as a module in a plain dict, one per block (transformers' kernel
    wrappers, `_kernel_funcs`): equal blocks by class and layout, not by identity."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _with_wrappers(scales: list[float]) -> _Net:
    blocks = [_Block(8, i) for i in range(len(scales))]
    for block, scale in zip(blocks, scales):
        block.__dict__["_kernel_funcs"] = {"rotary": _Wrapper(scale)}
    return _Net(blocks)


def test_modules_held_in_a_plain_attribute_compare_by_class_and_layout() -> None:
    assert find_blocks(_with_wrappers([1.0] * 5)) == BlockRun("blocks", 5)
    differ = find_blocks(_with_wrappers([1.0, 1.0, 1.0, 2.0, 1.0]))
    assert isinstance(differ, str) and "_kernel_funcs" in differ and "block 3" in differ


def test_a_stamped_meta_model_never_runs_whole() -> None:
    # Whole: for fx one propagation of the stamped graph's shapes (the check), nothing for
    # export. Cut to three blocks: the example batch (the output structure and the shape
    # check's reference, derived for the whole model from the stamped graph), its half (the
    # batch layout) and export's trace. In training mode, the half batch once more in that mode
    # (the eval-mode trials are not the shape check's reference there).
    with torch.device("meta"):
        llama = _llama()[0]
        model, inputs = gpt.build(n_layer=7, dropout=0.0, batch=4)
        trained = gpt.build(n_layer=7, dropout=0.1, batch=4)[0]
    ids = torch.zeros(4, 16, dtype=torch.long)
    cases = [(llama.eval(), (ids,), {"use_cache": False}, "export", 0, 3),
             (model.eval(), inputs, {}, "fx", 1, 2), (trained.train(), inputs, {}, "fx", 1, 4)]
    for net, inputs, kwargs, method, whole, cut in cases:
        full = capture(net, inputs, kwargs, check="shapes", inline_modules=True)
        stamped = capture(net, inputs, kwargs, check="shapes", inline_modules=True, stamp=True)
        info = stamped.meta[ir.CAPTURE]
        assert info.method == method and info.stamped == 4, info.stamp_note
        assert (info.fake_runs, info.cut_runs) == (whole, cut)
        assert "derived from the stamped graph" in info.checked
        assert "derived" not in full.meta[ir.CAPTURE].checked
        assert full.meta[ir.CAPTURE].cut_runs == 0
        assert full.meta[ir.CAPTURE].fake_runs > whole
        assert info.signature.input_batch_dims == full.meta[ir.CAPTURE].signature.input_batch_dims
        assert info.signature.out_batch_dims == \
            full.meta[ir.CAPTURE].signature.out_batch_dims
        assert canonical(stamped) == canonical(full)


def test_a_meta_model_whose_outputs_grow_with_its_blocks_is_laid_out_whole() -> None:
    # The cut model's outputs have other shapes than the whole's: the trials run whole.
    class Stacked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_Block(8, i) for i in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            states = []
            for block in self.blocks:
                x = block(x)
                states.append(x)
            return torch.stack(states, dim=1)

    with torch.device("meta"):
        net = Stacked().eval()
    x = torch.zeros(4, 8)
    gm = capture(net, (x,), check="shapes", inline_modules=True, stamp=True)
    info = gm.meta[ir.CAPTURE]
    assert info.stamped == 0, info.stamp_note
    # the cut model stood for the whole one only if stamped: here it ran whole after all
    assert "derived" not in info.checked and info.fake_runs >= 1
    output = next(n for n in gm.graph.nodes if n.op == "output")
    stacked = fx.node.map_aggregate(output.args[0], lambda a: a)[0]
    assert stacked.meta[ir.TENSOR].concrete_shape(4) == (4, 6, 8)  # all six blocks' states
    assert info.signature.out_batch_dims == (0,)
    assert tuple(info.signature.out_is_tensor) == (True,)


def test_shape_propagation_runs_two_blocks_and_copies_the_rest() -> None:
    # The bundled GPT's blocks map a (b, t, d) stream to one like it: blocks 3..N-1 take block
    # 2's fake values (the same objects), and the shapes are those of every block run.
    from fxpipe.frontend import shapes
    from fxpipe.frontend.stamp import BLOCKS

    model, inputs = gpt.build(n_layer=7, dropout=0.0, batch=4)
    gm = capture(model, inputs, inline_modules=True, stamp=True)
    run = gm.meta[BLOCKS][0]
    dims = gm.meta[ir.CAPTURE].signature.input_batch_dims
    values = shapes.propagate_shapes(gm, list(inputs), dims)
    copied = [(c, t) for block in run.blocks[2:] for c, t in zip(block, run.blocks[1])
              if c.op.startswith("call_")]
    assert copied and all(values[c] is values[t] for c, t in copied)
    stamped = canonical(gm)
    gm.meta[BLOCKS] = ()  # every block run
    values = shapes.propagate_shapes(gm, list(inputs), dims)
    assert not any(values[c] is values[t] for c, t in copied
                   if isinstance(values[t], torch.Tensor))
    assert canonical(gm) == stamped


def test_blocks_that_grow_their_input_are_all_run_by_shape_propagation() -> None:
    class Growing(nn.Module):  # each block appends a token: block 2 sees a longer input than 1
        def __init__(self, width: int) -> None:
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, torch.tanh(self.fc(x[:, -1:]))], dim=1)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Growing(8) for _ in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(4, 3, 8)
    stamped = capture(net, (x,), inline_modules=True, stamp=True)
    assert stamped.meta[ir.CAPTURE].stamped == 3, stamped.meta[ir.CAPTURE].stamp_note
    full = capture(net, (x,), inline_modules=True)
    assert canonical(stamped) == canonical(full)
    output = next(n for n in stamped.graph.nodes if n.op == "output")
    last = fx.node.map_aggregate(output.args[0], lambda a: a)
    last = last[0] if isinstance(last, (tuple, list)) else last
    assert last.meta[ir.TENSOR].concrete_shape(4) == (4, 9, 8)
    torch.testing.assert_close(stamped(x), net(x))
