"""passes.remat: GPipe recompute regions, the memory-budget knapsack, and deferred BatchNorm."""
from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch

import fxpipe
from fxpipe import ir
from fxpipe.models import gpt, resnet
from fxpipe.passes.remat import is_mutating, select_regions


def _brute_force(items, required):
    best = None
    for r in range(len(items) + 1):
        for combo in itertools.combinations(range(len(items)), r):
            if sum(items[i][0] for i in combo) >= required:
                cost = sum(items[i][1] for i in combo)
                if best is None or cost < best:
                    best = cost
    return best


def test_select_regions_literal_cases():
    assert select_regions([(10, 1), (10, 5), (30, 2)], 25) == [2]
    assert select_regions([(10, 1), (10, 5), (30, 2)], 35) == [0, 2]
    assert select_regions([(10, 1)], 0) == []
    assert select_regions([(10, 1), (5, 1)], 100) == [0, 1]  # falls short: everything


def test_select_regions_is_near_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        items = [(rng.uniform(1, 100), rng.uniform(1, 100)) for _ in range(rng.randint(1, 8))]
        required = rng.uniform(1, sum(s for s, _ in items))
        chosen = select_regions(items, required)
        assert sum(items[i][0] for i in chosen) >= required  # always enough
        optimum = _brute_force(items, required)
        # savings are rounded down to 1/2000 of the requirement: never short, at most slightly
        # more recompute than the exact optimum
        assert sum(items[i][1] for i in chosen) <= optimum * 1.0 + 1e-9 or \
            _brute_force(items, required * 1.001) >= sum(items[i][1] for i in chosen) - 1e-9


def _compile(model, x, **options):
    return fxpipe.compile(model, (x,), stages=2, chunks=4, profile="a100", **options)


def test_never_marks_nothing_and_always_covers_every_pure_operation():
    model, (x,) = gpt.build(dropout=0.0)
    assert all(not st.regions for st in _compile(model, x, remat="never").stages)
    for st in _compile(model, x, remat="always").stages:
        marked = {n.name for n in st.graph_module.graph.nodes if ir.REMAT in n.meta}
        compute = [n for n in ir.compute_nodes(st.graph_module.graph)]
        assert marked == {n.name for n in compute}  # GPT has no state-mutating operation


def test_batchnorm_updates_are_never_recomputed():
    model, (x,) = resnet.build()
    program = _compile(model, x, remat="always")
    for st in program.stages:
        for node in st.graph_module.graph.nodes:
            if is_mutating(node):
                assert ir.REMAT not in node.meta, node.name
        assert st.regions
    before = {k: v.clone() for k, v in model.state_dict().items()}
    program(x).sum().backward()
    counts = [v for k, v in model.state_dict().items() if k.endswith("num_batches_tracked")]
    # once per micro-batch (not per micro-batch twice, as a recomputation would)
    assert all(int(c) == int(before[k]) + 4 for k, c in zip(
        [k for k in model.state_dict() if k.endswith("num_batches_tracked")], counts))


def test_auto_recomputes_just_enough_to_fit_the_memory_limit():
    model, (x,) = gpt.build(dropout=0.0, batch=16, n_layer=4)
    never = _compile(model, x, remat="never")
    peak = max(s.memory for s in never.plan.stages if s.memory is not None) if any(
        s.memory for s in never.plan.stages) else None
    always = _compile(model, x, remat="always")
    kept_never = [d["measured_bytes"] for d in never.measure_activations(x)]
    kept_always = [d["measured_bytes"] for d in always.measure_activations(x)]
    # a limit between the two: auto must recompute some blocks but not all
    params = max(sum(p.numel() * p.element_size() for p in st.graph_module.parameters())
                 for st in never.stages)
    limit = params * 4 + (max(kept_never) + max(kept_always)) / 2
    auto = _compile(model, x, remat="auto", memory_limit=limit)
    regions = [len(st.regions) for st in auto.stages]
    assert sum(regions) > 0
    kept_auto = [d["measured_bytes"] for d in auto.measure_activations(x)]
    assert max(kept_auto) < max(kept_never)
    assert sum(len(r.nodes) for st in auto.stages for r in st.regions) < sum(
        len(r.nodes) for st in always.stages for r in st.regions)
    # and it still computes what the model computes
    torch.testing.assert_close(auto(x), model(x))
    del peak


def test_deferred_batch_norm_gives_the_plain_models_running_statistics():
    torch.manual_seed(0)
    model, (x,) = resnet.build()
    plain = copy.deepcopy(model)
    program = _compile(model, x, remat="always", deferred_batch_norm=True)
    program(x).sum().backward()
    plain(x)
    first = "stem.1"  # the first BatchNorm sees the same inputs in both
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(model.state_dict()[f"{first}.{name}"],
                                   plain.state_dict()[f"{first}.{name}"], rtol=1e-6, atol=1e-7)
    assert all(int(v) == 1 for k, v in model.state_dict().items()
               if k.endswith("num_batches_tracked"))  # committed once per batch


def test_without_deferral_statistics_follow_each_micro_batch():
    torch.manual_seed(0)
    model, (x,) = resnet.build()
    plain = copy.deepcopy(model)
    program = _compile(model, x, remat="never")
    program(x)
    plain(x)
    assert not torch.allclose(model.state_dict()["stem.1.running_var"],
                              plain.state_dict()["stem.1.running_var"])
    assert int(model.state_dict()["stem.1.num_batches_tracked"]) == 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stages_on_two_cuda_devices_are_transparent():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    model, (x,) = gpt.build(dropout=0.0)
    plain = copy.deepcopy(model).cuda()
    program = fxpipe.compile(model, (x,), stages=2, chunks=4, devices=["cuda:0", "cuda:1"])
    torch.testing.assert_close(program(x).cuda(0), plain(x.cuda()))


def test_auto_fits_each_stage_of_a_rank_to_its_share_of_the_rank_memory_limit(monkeypatch):
    """memory_limit is per rank: under a looped schedule (two stages per rank) remat fits each
    stage to half of it, as the partition does."""
    import fxpipe.pipeline

    limits = []
    real = fxpipe.pipeline.mark_remat

    def recording(*args, **kwargs):
        limits.append(kwargs["memory_limit"])
        return real(*args, **kwargs)

    monkeypatch.setattr(fxpipe.pipeline, "mark_remat", recording)
    model, (x,) = gpt.build(dropout=0.0, n_layer=4)
    fxpipe.compile(model, (x,), stages=4, chunks=4, profile="a100", remat="auto",
                   schedule="interleaved-1f1b", memory_limit=2**30)
    assert limits == [2**29] * 4


def test_auto_is_charged_a_tied_weight_in_every_stage_that_holds_it(monkeypatch):
    """remat="auto" fits what a stage holds: a weight tied across stages is held (with its
    gradient and Adam's two moments) by each of them, while the partition's held_bytes
    counts it once, in the stage that first uses it."""
    from fxpipe import pipeline

    charged: dict[int, float] = {}
    mark = pipeline.mark_remat

    def spy(gm, *args, fixed_bytes, **kwargs):
        charged[len(charged)] = fixed_bytes
        return mark(gm, *args, fixed_bytes=fixed_bytes, **kwargs)

    monkeypatch.setattr(pipeline, "mark_remat", spy)
    torch.manual_seed(0)
    model = gpt.GPT(100, 16, 32, 2, 2, 0.0)
    x = torch.randint(0, 100, (8, 16))
    program = fxpipe.compile(model, (x,), stages=3, chunks=2, remat="auto", memory_limit=2**40,
                             profile="a100")  # a cut that does not follow this machine
    tied = model.wte.weight
    assert program.built.spec.shared == {"wte.weight": [0, 2]}
    extra = [charged[s] - program.plan.stages[s].held_bytes for s in range(3)]
    assert extra == [0.0, 0.0, 4.0 * tied.numel() * tied.element_size()]
