"""Device profiles: a rate per op class, GPU presets by compute precision, measured profiles cached
per machine, and the cost model timing each class of work at its own rate."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe import ir
from fxpipe.cli import main
from fxpipe.models import gpt, load_factory
from fxpipe.passes.cost import annotate_costs
from fxpipe.passes.estimate import estimate_time
from fxpipe.profile import (
    OP_CLASSES,
    ClassRate,
    Curve,
    DeviceProfile,
    cache,
    compute_precision,
    get_profile,
    preset,
    select_profile,
)
from fxpipe.profile.checks import disagreeing, implausible
from fxpipe.profile.device import MEASUREMENT
from fxpipe.profile.kernels import KernelCounter
from fxpipe.tools.bench import BENCH_GPT


@pytest.fixture
def cache_folder(tmp_path, monkeypatch):
    """A fresh cache folder and no profile remembered in this process."""
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path / "cache"))
    cache.clear_memory()
    yield tmp_path / "cache"
    cache.clear_memory()


@pytest.fixture
def counted_measure(monkeypatch):
    """Counts measurements; each one is a short real measurement without the link and the
    overheads of a step."""
    calls = []
    real = cache.measure

    def measure(device, **kwargs):
        calls.append(str(device))
        return real(device, **{**kwargs, "budget": 0.1, "link": False, "overheads": False})

    monkeypatch.setattr(cache, "measure", measure)
    return calls


def uniform(matmul: float, other: float) -> DeviceProfile:
    """A device whose matmuls run at `matmul` FLOP/s and everything else at `other`."""
    memory = Curve.flat(1e12)
    rates = tuple((c, ClassRate(memory, Curve.flat(matmul if c == "matmul" else other)))
                  for c in OP_CLASSES)
    return DeviceProfile("test", rates, 0.0, Curve.flat(1e9), 0.0, "test")


def test_a_rate_curve_interpolates_log_log_between_points_and_is_flat_beyond_them():
    curve = Curve(((10.0, 1.0), (1000.0, 100.0)))
    assert curve.at(1.0) == 1.0 and curve.at(1e6) == 100.0
    assert curve.at(100.0) == pytest.approx(10.0)
    assert curve.peak == 100.0


def test_each_op_class_is_timed_at_its_own_rate():
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU())
    gm = fxpipe.capture(model, (torch.randn(8, 64),), inline_modules=True)
    annotate_costs(gm)
    linear, gelu = ir.compute_nodes(gm.graph)
    fast_matmul, slow_matmul = uniform(1e12, 1e9), uniform(1e9, 1e9)
    assert estimate_time(ir.cost(linear), slow_matmul, 8)[0] == pytest.approx(
        1000 * estimate_time(ir.cost(linear), fast_matmul, 8)[0], rel=0.05)
    # the element-wise GELU does not get faster with faster matmuls
    assert estimate_time(ir.cost(gelu), slow_matmul, 8) == estimate_time(ir.cost(gelu),
                                                                         fast_matmul, 8)


def test_class_work_adds_up_to_the_node_totals():
    model, inputs = gpt.build(dropout=0.0)
    gm = fxpipe.capture(model, inputs, inline_modules=True)
    annotate_costs(gm)
    for node in ir.compute_nodes(gm.graph):
        cost = ir.cost(node)
        for backward, flops, kernels in ((False, cost.fwd_flops, cost.fwd_kernels),
                                         (True, cost.bwd_flops, cost.bwd_kernels)):
            parts = [w for w in cost.work if w.backward == backward]
            assert sum(ir.evaluate(w.flops, 3) for w in parts) == ir.evaluate(flops, 3), node
            assert sum(w.kernels for w in parts) == kernels, node
    classes = {w.op_class for n in ir.compute_nodes(gm.graph) for w in ir.cost(n).work}
    assert {"matmul", "attention", "embedding", "reduction", "elementwise"} <= classes


def test_the_profile_counts_work_as_the_cost_pass_does():
    """A rate measured on F.linear applies to a model's linear layers: same FLOPs and bytes."""
    model = nn.Linear(32, 128, bias=False)
    x = torch.randn(16, 32)
    gm = fxpipe.capture(model, (x,), inline_modules=True)
    annotate_costs(gm)
    (node,) = ir.compute_nodes(gm.graph)
    counter = KernelCounter()
    with counter:
        F.linear(x, model.weight)
    matmul = [w for w in ir.cost(node).work if w.op_class == "matmul" and not w.backward]
    assert [ir.evaluate(matmul[0].flops, 16), ir.evaluate(matmul[0].bytes, 16)] == \
        list(counter.totals("matmul")[:2])


def test_presets_use_the_peak_of_the_compute_precision():
    assert preset("h100", "bf16").peak_flops == 989e12
    assert preset("h200", "fp16").peak_flops == 989e12
    assert preset("a100", "bf16").peak_flops == 312e12
    assert preset("a100").peak_flops == 19.5e12  # fp32 without TF32: torch's default
    assert preset("a100", "tf32").peak_flops == 156e12
    assert get_profile("h100:bf16").peak_flops == 989e12
    assert preset("h100").link_bandwidth == 450e9 and preset("l4").link_bandwidth == 25e9
    with pytest.raises(fxpipe.FxPipeError, match="h100:bf16"):
        get_profile("h100:int3")


def test_the_precision_follows_the_dtype_autocast_and_allow_tf32():
    assert compute_precision(torch.float32, allow_tf32=False) == "fp32"
    assert compute_precision(torch.float32, allow_tf32=True) == "tf32"
    assert compute_precision(torch.bfloat16) == "bf16"
    assert compute_precision(torch.float32, autocast=torch.float16) == "fp16"
    model = nn.Linear(4, 4)
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert select_profile("a100", model, "cpu").precision == "fp32"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert select_profile("a100", model, "cpu").precision == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert select_profile("h100", model, "cpu").peak_flops == 989e12
    assert select_profile("h100", model.to(torch.bfloat16), "cpu").precision == "bf16"


def test_a_profile_survives_its_json_form():
    profile = preset("h100", "bf16")
    assert DeviceProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile


def test_a_profile_says_whether_the_ranks_own_cores_move_the_links_bytes():
    host = dataclasses.replace(measured_like(FRESH_LINK), host_link=True)
    assert DeviceProfile.from_json(json.loads(json.dumps(host.to_json()))) == host
    old = host.to_json()
    del old["host_link"]  # cached before the field: its gloo loopback link is the host's
    assert DeviceProfile.from_json(old).host_link
    datasheet = preset("h100", "bf16").to_json()
    del datasheet["host_link"]
    assert not DeviceProfile.from_json(datasheet).host_link


def test_a_measured_profile_is_cached_per_machine_and_read_back(cache_folder, counted_measure):
    first = cache.cached_profile("cpu")
    assert len(counted_measure) == 1 and first.key and first.precision == "fp32"
    assert cache.profile_path(first.key).exists()
    assert str(cache.profile_path(first.key)).startswith(str(cache_folder))
    cache.clear_memory()  # as a new process: read from the folder, not measured
    assert cache.cached_profile("cpu") == first
    assert len(counted_measure) == 1
    cache.cached_profile("cpu", torch.bfloat16)  # another dtype is another profile
    assert len(counted_measure) == 2
    assert cache.cached_profile("cpu", refresh=True) != first or len(counted_measure) == 3


def measured_like(link: Curve) -> DeviceProfile:
    """A profile as measured on a CPU (elementwise memory at 5-53 GB/s, 5.8 us per kernel) with
    the given loopback link."""
    memory = Curve(((12288.0, 5.3e9), (196608.0, 53e9), (50331648.0, 15.9e9)))
    rates = tuple((c, ClassRate(memory, Curve.flat(50e9))) for c in OP_CLASSES)
    return DeviceProfile("measured cpu", rates, 5.8e-6, link, 0.0,
                         "measured on cpu: ...; link: gloo loopback ping-pong, 4 KiB .. 16 MiB",
                         key="cpu-test")


# a link measured while the machine was busy, and measured again on an idle one (GB/s)
BUSY_LINK = Curve(((4096.0, 0.00158e9), (65536.0, 0.02e9), (16777216.0, 0.994e9)))
FRESH_LINK = Curve(((4096.0, 0.0295e9), (65536.0, 0.4e9), (16777216.0, 4.3e9)))


def test_a_profile_measured_under_load_contradicts_itself_and_says_with_which_values():
    assert implausible(measured_like(FRESH_LINK)) == []
    problems = implausible(measured_like(BUSY_LINK))
    assert any("a 4 KiB loopback message takes 2592 us" in p and "5.80 us" in p
               for p in problems), problems
    dipped = Curve(((4096.0, 0.1e9), (65536.0, 1.3e9), (262144.0, 0.1e9), (16777216.0, 1.7e9)))
    assert disagreeing(dipped.points) == [262144.0]
    assert any("fewer bytes/s at 256 KiB" in p for p in implausible(measured_like(dipped)))
    assert implausible(dataclasses.replace(measured_like(BUSY_LINK), source="datasheet")) == []


def test_a_cached_profile_that_contradicts_itself_is_measured_again(cache_folder,
                                                                   counted_measure):
    key = cache.profile_key("cpu", torch.float32)
    path = cache.profile_path(key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(dataclasses.replace(measured_like(BUSY_LINK), key=key).to_json()))
    with pytest.warns(UserWarning, match="contradicts itself: a 4 KiB loopback message"):
        fresh = cache.cached_profile("cpu")
    assert len(counted_measure) == 1 and fresh.link != BUSY_LINK
    assert json.loads(path.read_text())["link"] != [list(p) for p in BUSY_LINK.points]


def test_a_run_measuring_far_from_the_profile_drops_the_cached_one(cache_folder,
                                                                  counted_measure):
    profile = cache.cached_profile("cpu")
    assert not cache.check_against_run(profile, [1e-3, 1e-3], [4e-3, 5e-3])  # within 5x
    assert not cache.check_against_run(preset("a100"), [1e-3], [1.0])  # a preset stays
    with pytest.warns(UserWarning, match=r"predicts 2 ms of stage compute where a run "
                                         r"measured 20 ms \(10.00x\)"):
        assert cache.check_against_run(profile, [1e-3, 1e-3], [9e-3, 11e-3])
    assert not cache.profile_path(profile.key).exists()
    cache.cached_profile("cpu")
    assert len(counted_measure) == 2  # measured again by the next use


def test_what_a_step_pays_beyond_kernels_is_part_of_the_cached_profile(cache_folder,
                                                                       counted_measure):
    paid = dataclasses.replace(preset("a100"), op_overhead=1e-5, region_overhead=2e-5,
                               microbatch_overhead=3e-4, step_overhead=4e-4,
                               op_overheads=(("matmul", 5e-5), ("view", 1e-6)),
                               op_forward_overheads=(("matmul", 1e-5),),
                               region_overheads=(("reduction", 3e-5),), checkpoint_overhead=1e-4,
                               matmul_in_model=1.25)
    assert DeviceProfile.from_json(json.loads(json.dumps(paid.to_json()))) == paid
    assert paid.scaled(2.0).microbatch_overhead == pytest.approx(6e-4)
    assert paid.scaled(2.0).operation_overhead("matmul") == pytest.approx(1e-4)
    assert paid.scaled(2.0).operation_forward_overhead("matmul") == pytest.approx(2e-5)
    assert paid.scaled(2.0).operation_region_overhead("reduction") == pytest.approx(6e-5)
    assert paid.scaled(2.0).checkpoint_overhead == pytest.approx(2e-4)
    assert paid.scaled(2.0).matmul_in_model == 1.25  # a ratio, whatever the machine's speed
    assert paid.operation_region_overhead("matmul") == 2e-5  # region_overhead where unmeasured
    # a kind without a figure of its own pays op_overhead, half of it in the forward
    assert paid.operation_overhead("convolution") == 1e-5
    assert paid.operation_forward_overhead("view") == 5e-7
    # a profile cached before the overheads were measured is measured again, and one cached
    # before they were measured per kind of operation
    path = _cache_old_profile(lambda old: old.pop("overheads"))
    cache.cached_profile("cpu")
    assert len(counted_measure) == 1 and "overheads" in json.loads(path.read_text())
    path.unlink()
    path = _cache_old_profile(lambda old: (old.pop("op_forward_overheads"),
                                           old.pop("region_overheads")), fresh=True)
    cache.cached_profile("cpu")
    assert len(counted_measure) == 2 and "region_overheads" in json.loads(path.read_text())
    # and one measured another way (its convolutions timed inside a backward pass)
    path.unlink()
    path = _cache_old_profile(lambda old: old.pop("measurement"), fresh=True)
    cache.cached_profile("cpu")
    assert len(counted_measure) == 3 and json.loads(path.read_text())["measurement"] == \
        MEASUREMENT


def _cache_old_profile(edit: Any, fresh: bool = False) -> Path:
    """Caches this machine's profile as an earlier version wrote it: `edit` changes its JSON
    (`fresh`: forgetting the profile this process measured before)."""
    key = cache.profile_key("cpu", torch.float32)
    path = cache.profile_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fresh:
        cache._MEMORY.pop(key, None)
    old = dataclasses.replace(measured_like(FRESH_LINK), key=key).to_json()
    edit(old)
    path.write_text(json.dumps(old))
    return path


def test_a_cached_profile_without_what_ranks_pay_is_measured_again(cache_folder, counted_measure):
    ranked = dataclasses.replace(preset("a100"), action_overhead=1e-4, message_overhead=2e-5)
    assert DeviceProfile.from_json(json.loads(json.dumps(ranked.to_json()))) == ranked
    assert ranked.scaled(2.0).message_overhead == pytest.approx(4e-5)

    def drop_ranks(old: dict[str, Any]) -> None:
        for name in ("action_overhead", "message_overhead"):
            del old["overheads"][name]

    path = _cache_old_profile(drop_ranks)
    cache.cached_profile("cpu")
    assert len(counted_measure) == 1
    assert "message_overhead" in json.loads(path.read_text())["overheads"]


def test_rank_overheads_are_fitted_from_how_steps_grow_with_micro_batches():
    from fxpipe.profile.ranks import CHUNKS, VALUES, fit_rank_overheads

    # predicted steps as the simulator gives them: linear in the two overheads, each probe's
    # growth from 1 to 8 micro-batches paying actions and messages in its own proportion
    def steps(action: float, message: float) -> dict[tuple[int, int], float]:
        return {(v, c): 1e-3 * c + (c + 1) * 2 * (action + v * message)
                for v in VALUES for c in CHUNKS}

    predicted = {(0.0, 0.0): steps(0, 0), (1.0, 0.0): steps(1, 0), (0.0, 1.0): steps(0, 1)}
    action, message = fit_rank_overheads(steps(2e-4, 5e-5), predicted)
    assert (action, message) == (pytest.approx(2e-4), pytest.approx(5e-5))
    # a machine running faster than the rest of its profile says pays nothing more
    assert fit_rank_overheads(steps(0, 0), predicted) == (0.0, 0.0)
    assert fit_rank_overheads({k: t - 1e-4 * k[1] for k, t in steps(0, 0).items()},
                              predicted) == (0.0, 0.0)
    # all of it per message
    action, message = fit_rank_overheads(steps(0, 1e-4), predicted)
    assert action == pytest.approx(0.0, abs=1e-12) and message == pytest.approx(1e-4)


def test_two_processes_measure_what_a_rank_pays():
    import warnings

    from fxpipe.profile.ranks import measure_rank_overheads

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the probe's processes ran and reported
        action, message = measure_rank_overheads(preset("a100"))
    assert 0 <= action < 0.1 and 0 <= message < 0.1


def test_a_rank_probe_that_cannot_start_says_so_and_leaves_ranks_out(monkeypatch):
    import sys

    from fxpipe.profile.ranks import measure_rank_overheads

    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.warns(UserWarning, match="what a pipeline rank pays"):
        assert measure_rank_overheads(preset("a100")) == (0.0, 0.0)


def test_the_second_compile_uses_the_cached_profile_and_cuts_alike(cache_folder,
                                                                   counted_measure):
    model, inputs = gpt.build(dropout=0.0)
    first = fxpipe.compile(model, inputs, stages=2, chunks=4)
    cache.clear_memory()
    second = fxpipe.compile(model, inputs, stages=2, chunks=4)
    assert len(counted_measure) == 1
    assert [s.nodes for s in first.plan.stages] == [s.nodes for s in second.plan.stages]


def test_the_report_names_the_profile_and_the_stage_files_do_not(cache_folder):
    model, inputs = gpt.build(dropout=0.0)
    program = fxpipe.compile(model, inputs, stages=2, chunks=4, profile="h100:bf16")
    assert "H100" not in program.stages[0].source.replace("profile='h100:bf16'", "")
    assert ("times predicted with device profile: NVIDIA H100 SXM5 (bf16) [h100:bf16]"
            in program.report().text())


def test_fxpipe_profile_shows_a_preset_and_measures_once(cache_folder, counted_measure, capsys):
    assert main(["profile", "--preset", "a100:bf16"]) == 0
    assert "312" in capsys.readouterr().out
    assert main(["profile"]) == 0
    out = capsys.readouterr().out
    assert "matmul" in out and "elementwise" in out and str(cache_folder) in out
    assert "us per operation" in out and "us per stage and micro-batch" in out
    assert main(["profile"]) == 0  # cached now
    assert len(counted_measure) == 1
    assert main(["profile", "--refresh"]) == 0
    assert len(counted_measure) == 2


@pytest.mark.slow
def test_the_bundled_gpt_gets_one_cut_in_repeated_compiles_also_beside_a_busy_loop(
        cache_folder, counted_measure):
    settings = [f"{k}={json.dumps(v)}" for k, v in BENCH_GPT.items()]
    model, inputs, _, _ = load_factory("fxpipe.models.gpt:build", settings)
    cuts = []
    for i in range(5):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if i % 2 == 0 \
            else None
        try:
            cache.clear_memory()  # as a new process would: the profile comes from the folder
            program = fxpipe.compile(model, inputs, stages=2, chunks=8, remat="never")
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        cuts.append([s.nodes for s in program.plan.stages])
    assert len(counted_measure) == 1  # measured once, beside the busy loop, then read back
    assert all(cut == cuts[0] for cut in cuts)


def test_direct_kernels_count_what_a_backward_pass_counts():
    """Convolutions and a CPU's attention are timed by calling their kernels directly (no
    backward pass around them); their counted work must be what a model's forward and
    backward count, so that the rates apply to a model's costs."""
    from fxpipe.profile.measure import _attention_products, _conv_products

    def counted(fn: Any, op_class: str) -> tuple[float, float, int]:
        counter = KernelCounter()
        with counter:
            fn()
        return counter.totals(op_class)

    x, w, g = torch.randn(2, 4, 8, 8), torch.randn(4, 4, 3, 3), torch.randn(2, 4, 8, 8)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    through = counted(lambda: F.conv2d(xg, wg, padding=1).backward(g), "convolution")
    assert counted(lambda: _conv_products(x, w, g), "convolution") == through
    assert through[2] == 2  # the forward and one backward kernel
    q, k, v, go = (torch.randn(1, 2, 8, 16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    through = counted(lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
                      .backward(go), "attention")
    assert counted(lambda: _attention_products(q, k, v, go), "attention") == through
    assert through[2] == 2 and through[0] > 0


def test_remat_bookkeeping_is_measured_under_the_checkpoint_stage_code_runs(monkeypatch) -> None:
    """The profile's region overheads and stage code checkpoint with the same options, so a
    change to how stage code checkpoints (its determinism check, its RNG state) changes what
    the profile measures."""
    from collections import Counter

    import torch.utils.checkpoint

    from fxpipe.profile.overheads import _Chained
    from fxpipe.remat_policy import CHECKPOINT_OPTIONS
    from fxpipe.runtime import stage

    called: list[dict[str, Any]] = []
    torch_checkpoint = torch.utils.checkpoint.checkpoint

    def recording(region: Any, *args: Any, **kwargs: Any) -> Any:
        called.append(kwargs)
        return torch_checkpoint(region, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", recording)
    monkeypatch.setattr(stage, "_torch_checkpoint", recording)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    _Chained(model, x, Counter(), (0.0, 0.0)).remat()  # as the profile times it
    stage.checkpoint(model, x, enabled=True).sum().backward()  # as stage code runs a region
    assert called == [CHECKPOINT_OPTIONS, CHECKPOINT_OPTIONS]
    assert CHECKPOINT_OPTIONS["determinism_check"] == "none"
    assert all(p.grad is not None for p in model.parameters())


def test_matrix_products_take_their_in_model_factor_and_nothing_else_does():
    alone = preset("a100")
    inside = dataclasses.replace(alone, matmul_in_model=1.3)
    work = (3e12, 4e9, 5)
    assert inside.class_time("matmul", *work) == pytest.approx(1.3 * alone.class_time("matmul",
                                                                                      *work))
    for op_class in ("convolution", "attention", "elementwise", "reduction"):
        assert inside.class_time(op_class, *work) == alone.class_time(op_class, *work)
    # a profile cached before the factor was measured reads as 1 (and is measured again,
    # being of an earlier MEASUREMENT)
    old = inside.to_json()
    old.pop("matmul_in_model")
    assert DeviceProfile.from_json(old).matmul_in_model == 1.0


def test_the_in_model_figures_come_from_chains_of_mlp_blocks(monkeypatch):
    """The factor is measured steps over predicted products (within LIMITS), and the
    checkpoint call what a chain of one block pays under the checkpoint beyond the
    per-block slope; both from the chains' fastest steps."""
    from fxpipe.profile import in_model

    profile = measured_like(FRESH_LINK)
    seen: dict[tuple[int, str], float] = {}

    def fastest(runs: Any, **_: Any) -> dict[tuple[int, str], float]:
        # products take the step's time, so the factor is what the steps say; the checkpoint
        # adds 300 us per call and 100 us per block
        products = {}
        for count in (1, 4):
            torch.manual_seed(0)
            model = nn.Sequential(*(in_model.MlpBlock() for _ in range(count)))
            program = fxpipe.compile(model, (torch.randn(2, 32, 64),), stages=1, chunks=1,
                                     remat="never", profile=profile)
            total = sum(s.compute_time for s in program.plan.stages)
            products[count] = (total, in_model.matmul_time(program.graph_module, profile, 2))
        for count, (total, matmul) in products.items():
            seen[count, "step"] = total + 0.5 * matmul  # products 1.5x what the rates say
            seen[count, "remat"] = seen[count, "step"] + 300e-6 + 100e-6 * count
        assert set(runs) == set(seen)
        return seen

    monkeypatch.setattr(in_model, "interleaved", fastest)
    matmul, call = in_model.measure_in_model(profile)
    assert matmul == pytest.approx(1.5)
    assert call == pytest.approx(300e-6)
    # a noisy measurement cannot make products faster than alone, nor absurdly slower
    monkeypatch.setattr(in_model, "interleaved", lambda runs, **_: {k: 1e-6 * k[0] for k in runs})
    assert in_model.measure_in_model(profile)[0] == in_model.LIMITS[0]


def test_interleaved_runs_take_turns_and_a_burst_leaves_its_cold_first_run_untimed():
    """A run after another one's is cold (here it sleeps 5 ms), after its own warm: taking
    turns one at a time times only cold runs; in bursts of 2 the warm second run is timed."""
    import time

    from fxpipe.profile.timing import interleaved

    last: list[str] = []

    def run(key: str) -> None:
        if last[-1:] != [key]:
            time.sleep(0.005)
        last.append(key)

    runs = {key: (lambda key=key: run(key)) for key in "ab"}
    one = interleaved(runs, rounds=3, least=3)
    assert min(one.values()) >= 0.005
    assert last[:2] == ["a", "b"] and len(last) == 2 + 3 * 2  # one untimed run each first
    assert max(interleaved(runs, rounds=3, least=3, burst=2).values()) < 0.005


class _NoKernel(nn.Module):
    """A unit whose operation has no kernel at the precision measured (as an LSTM has none in
    fp16 on many CPUs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("could not create a primitive descriptor")


def test_a_kind_without_a_kernel_at_the_precision_gets_the_median_overhead(monkeypatch):
    from fxpipe.profile import overheads
    monkeypatch.setattr(overheads, "_UNITS", (
        ("elementwise", overheads._Pointwise, (4, 16)),
        ("recurrent", _NoKernel, (2, 4, 8)),
        ("matmul", lambda: nn.Linear(16, 16), (4, 16))))
    found = overheads._op_overheads(uniform(1e10, 1e9), budget=0.05)
    assert set(found) == {"elementwise", "matmul"}  # measured, and the compile went on
