"""`fxpipe bench`: the numbers it reports come from runs that compute the same thing."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from fxpipe.cli import main
from fxpipe.runtime.planning.timeline import Event, busy_time
from fxpipe.tools.bench_torch import error_line, failure_note
from fxpipe.tools.bench_worker import time_variants


def test_busy_time_excludes_receive_waits_inside_compute_spans():
    events = [
        Event("forward", 1, 0, 0.0, 3.0),
        Event("recv", 1, 0, 0.0, 2.0),  # waited 2 s for the input: idle
        Event("backward", 1, 0, 5.0, 9.0),
        Event("recv_grad", 1, 0, 5.0, 6.5),
        Event("send_grad", 1, 0, 8.9, 9.0),  # a send posted from inside is not a wait
        Event("reduce", 1, -1, 9.0, 12.0),  # not compute
        Event("forward", 0, 0, 0.0, 1.0),  # another stage
    ]
    assert busy_time(events, stage=1) == pytest.approx(1.0 + 2.5)
    assert busy_time(events, stage=0) == pytest.approx(1.0)


def test_bench_plot_without_matplotlib_is_refused_before_the_bench_runs(tmp_path, capsys,
                                                                         monkeypatch):
    import sys

    from fxpipe.tools import bench

    def no_bench(*args, **kwargs):
        raise AssertionError("the bench ran although its plot cannot be drawn")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setattr(bench, "_memory", no_bench)
    monkeypatch.setattr(bench, "_run_ranks", no_bench)
    assert main(["bench", "mlp", "--plot", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--plot draws the timeline with matplotlib, which is not installed" in err
    assert "pip install matplotlib" in err


def test_splitting_with_torch_pipelining_prints_none_of_torchs_future_warnings():
    import warnings

    from fxpipe.models import gpt
    from fxpipe.tools.bench_torch import TorchVariant, _traced

    model, (x,) = gpt.build(n_layer=2, dropout=0.0)
    variant = TorchVariant("traced", "natural", "gpipe", ("blocks.1",), ())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stages, _, _ = _traced(model, (x[:2],), variant, [], torch.device("cpu"), None)
    assert stages == []  # split only: building a stage needs a process group
    assert [str(w.message) for w in caught if w.category is FutureWarning] == []


@pytest.mark.slow
def test_bench_runs_every_variant_on_the_same_problem(tmp_path, capsys):
    rc = main(["bench", "mlp", "--set", "batch=8", "--stages", "2", "--chunks", "4",
               "--steps", "1", "--warmup", "0", "--port", "0", "--out", str(tmp_path),
               "--torch-schedules", "gpipe,interleaved_1f1b"])
    assert rc == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    variants = {"single_process", "fxpipe", "fxpipe_1f1b", "fxpipe_zb-h1",
                "fxpipe_interleaved-1f1b", "fxpipe_zb-v", "fxpipe_dualpipev",
                "fxpipe_remat_except_last", "fxpipe_remat_always"}
    torch_variants = {f"torch_{frontend}_{cut}_{schedule}" for frontend in ("traced", "manual")
                      for cut in ("natural", "fxpipe")
                      for schedule in ("gpipe", "interleaved_1f1b")}
    assert variants | torch_variants <= set(result["step_time_s"]), result["skipped"]
    # every variant runs on the default group: no other group's thread wakes while timing
    assert result["process_groups_while_timing"] == 1
    # same model, data and micro-batches: every variant's first loss is the plain model's
    losses = result["losses_first_step"]
    for name in variants | torch_variants:
        assert losses[name] == pytest.approx(losses["single_process"], rel=1e-5), name
    schedules = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "dualpipev")
    assert result["best_schedule"] in schedules
    assert result["predicted_best_schedule"] in schedules
    assert result["torch_pipelining_best"] in torch_variants
    best = result["step_time_s"]["fxpipe" if result["best_schedule"] == "gpipe"
                                 else "fxpipe_" + result["best_schedule"]]
    assert result["step_time_ratio_vs_torch_pipelining_best"] == pytest.approx(
        best / result["step_time_s"][result["torch_pipelining_best"]])
    # paired step by step (one measured step here: the interval is that step's ratio)
    low, high = result["step_time_ratio_vs_torch_pipelining_best_ci"]
    assert low <= result["step_time_ratio_vs_torch_pipelining_best_paired"] <= high
    assert result["versus_torch_pipelining_best"] in ("faster", "slower")
    assert set(result["same_schedule_vs_torch"]) == {"gpipe"}
    assert result["same_schedule_vs_torch"]["gpipe"]["torch"] in torch_variants
    # the plain model at full batch beside the accumulating one; CPU seconds of every variant
    assert {"single_process", "single_process_full_batch"} <= set(result["step_time_s"])
    assert result["speedup_vs_single_process"] == pytest.approx(
        result["step_time_s"]["single_process_full_batch"] / result["step_time_s"]["fxpipe"])
    # the best schedule's speedup over it, paired step by step (one step: that step's ratio)
    low, high = result["best_speedup_vs_single_process_ci"]
    assert 0 < low <= result["best_speedup_vs_single_process_paired"] <= high
    assert set(result["cpu_time_s"]) == set(result["step_time_s"])
    assert all(t > 0 for t in result["cpu_time_s"].values())
    # each schedule's own bound
    assert result["ideal_speedup"]["fxpipe"] == pytest.approx(2 * 4 / 5)
    assert result["ideal_speedup"]["fxpipe_zb-v"] > result["ideal_speedup"]["fxpipe_1f1b"]
    # and over the full batch: scaled by what micro-batching cost one process in this run
    micro_cost = result["step_time_s"]["single_process_full_batch"] / \
        result["step_time_s"]["single_process"]
    assert result["full_batch_over_accumulating"] == pytest.approx(micro_cost)
    for name, bound in result["ideal_speedup"].items():
        assert result["ideal_speedup_vs_full_batch"][name] == pytest.approx(bound * micro_cost)
    assert result["stage_imbalance"] >= 0 and result["balance_rounds"]
    fxpipe_variants = {v for v in variants if v.startswith("fxpipe")}
    assert set(result["predicted_over_measured_by_variant"]) == fxpipe_variants
    assert all(r > 0 for r in result["predicted_over_measured_by_variant"].values())
    assert set(result["stage_imbalance_by_variant"]) == fxpipe_variants
    # the cores' own drift, measured beside every fxpipe step, and the imbalance net of it
    assert result["core_speed_spread"] >= 0
    assert set(result["stage_imbalance_at_equal_speed_by_variant"]) == fxpipe_variants
    assert result["stage_imbalance_at_equal_speed"] == \
        result["stage_imbalance_at_equal_speed_by_variant"]["fxpipe"] >= 0
    speed = result["single_process_predicted_s"] / result["step_time_s"]["single_process"]
    assert result["machine_speed_factor"] == pytest.approx(speed)
    for name, ratio in result["predicted_over_measured_at_run_speed"].items():
        assert ratio == pytest.approx(result["predicted_over_measured_by_variant"][name] / speed)
    # the schedule simulated at the compute each stage measured: never shorter than the
    # busiest rank's compute (there the median of its step's compute, in the simulation the
    # sum of its parts' medians, which may differ a little)
    at_compute = result["predicted_over_measured_at_measured_compute"]
    assert set(at_compute) == fxpipe_variants
    busiest = max(stage["busy_s"] for stage in result["stages_detail"])
    assert at_compute["fxpipe"] * result["pipeline_step_time_s"] >= busiest * 0.97
    assert all(r > 0 for r in at_compute.values())
    assert result["speedup_vs_single_process"] > 0
    for name, (low, high) in result["step_time_min_max_s"].items():
        assert 0 < low <= result["step_time_s"][name] <= high, name
    assert set(result["remat_step_time_ratios"]) == {"except_last", "always"}
    for stage in result["stages_detail"]:
        assert 0 < stage["busy_s"] <= result["pipeline_step_time_s"] * 1.05
        assert 0 <= stage["recv_wait_s"] <= result["pipeline_step_time_s"]
        assert stage["kept_bytes_remat_always"] < stage["kept_bytes_remat_never"]
        assert stage["kept_reductions"]["always"] > 1
    # every fxpipe schedule's ranks keep for backward what the memory model predicts
    kept = result["kept_activations_by_schedule"]
    assert set(kept) == fxpipe_variants
    for name, by_rank in kept.items():
        assert [k["rank"] for k in by_rank] == [0, 1]
        for k in by_rank:
            assert k["measured_bytes"] > 0, name
            assert abs(k["measured_bytes"] - k["predicted_bytes"]) \
                <= 0.1 * k["predicted_bytes"] + 4096, (name, k)
    assert (tmp_path / "bench.md").exists() and (tmp_path / "bench_trace.json").exists()
    out = capsys.readouterr().out
    assert "activations kept at the peak of a step" in out
    assert "speedup over one process" in out and "ran identical work" in out
    steps = ["fxpipe bench: ", "measuring kept activations", "starting 2 processes",
             "writing the results"]  # a line before each step that takes more than a second
    assert [out.index(step) for step in steps] == sorted(out.index(step) for step in steps)


def test_a_plan_at_measured_compute_gives_each_stage_the_compute_it_measured():
    from types import SimpleNamespace

    from fxpipe.passes.partition import PartitionPlan, StagePlan
    from fxpipe.tools.bench_worker import _at_compute

    def stage(i: int, t: float) -> StagePlan:
        return StagePlan(i, (), t + 0.5, t, 0.5, None, "", "", forward_time=t / 3,
                         recompute_time=t / 10, weight_time=t / 4)

    # interleaved on 2 ranks: stages 0 and 2 on rank 0, 1 and 3 on rank 1
    plan = PartitionPlan(tuple(stage(i, t) for i, t in enumerate([1.0, 2.0, 3.0, 4.0])),
                         microbatch_size=1, chunks=4, balance="cost", bottleneck=4.5,
                         predicted_step_time=0.0)
    program = SimpleNamespace(plan=plan, built=SimpleNamespace(
        spec=SimpleNamespace(placement=[0, 1, 0, 1], chunks=4)))
    # seconds per step of each stage's forwards, backwards and W (none: no split backward)
    measured = {0: (4.0, 8.0, 0.0), 1: (2.0, 2.0, 0.0), 2: (8.0, 16.0, 2.0), 3: (1.0, 3.0, 0.0)}
    scaled = _at_compute(program, measured)
    assert scaled.chunks == 4
    assert [s.forward_time for s in scaled.stages] == [1.0, 0.5, 2.0, 0.25]
    assert [s.compute_time for s in scaled.stages] == [3.0, 1.0, 6.0, 1.0]
    assert scaled.stages[2].weight_time == 0.5  # its W as measured
    for before, after in zip(plan.stages, scaled.stages):
        factor = (after.compute_time - after.forward_time) / (
            before.compute_time - before.forward_time)  # the backward's
        assert after.recompute_time == pytest.approx(before.recompute_time * factor)
        if before.index != 2:
            assert after.weight_time == pytest.approx(before.weight_time * factor)
        assert after.comm_time == before.comm_time  # messages keep their predicted times
    assert _at_compute(program, {0: (4.0, 8.0, 0.0)}).stages[1:] == plan.stages[1:]


def test_stage_parts_splits_each_stage_busy_time_into_forward_backward_and_w():
    from fxpipe.runtime.planning.timeline import Event
    from fxpipe.tools.bench_worker import median_parts, stage_parts

    events = [Event("forward", 0, 0, 0.0, 1.0), Event("recv", 0, 0, 0.0, 0.25),
              Event("forward", 1, 0, 1.0, 2.0), Event("backward", 1, 0, 2.0, 4.0, "I"),
              Event("backward", 1, 0, 4.0, 5.5, "W"), Event("recv_grad", 0, 0, 5.5, 6.0),
              Event("backward", 0, 0, 5.5, 8.0), Event("reduce", 0, -1, 8.0, 9.0)]
    parts = stage_parts(events)
    assert parts == {0: (0.75, 2.0, 0.0), 1: (1.0, 3.5, 1.5)}
    assert median_parts([parts, {0: (1.75, 1.0, 0.0)}, {0: (0.25, 3.0, 0.0)}]) == {
        0: (0.75, 2.0, 0.0), 1: (1.0, 3.5, 1.5)}


def _fails_on_one_rank(rank: int, world: int) -> list[str]:
    """_try_torch with a step that raises on rank 1 while rank 0 waits on it in the trial group:
    rank 1 closing its connections must end rank 0's wait, not the trial group's timeout."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from fxpipe.tools import bench_worker
    from fxpipe.tools.bench_torch import TorchVariant

    bench_worker.TRY_TIMEOUT_S = 120  # longer than the test's bound: only closing can end it

    def build(variant, model, inputs, target, chunks, rank, world, group, ties):  # noqa: ARG001
        def step() -> float:
            if rank == 1:
                # what torch's schedule does before raising: a log of the whole schedule
                assert not schedules.logger.isEnabledFor(logging.ERROR)
                raise RuntimeError("torch cannot run this variant")
            dist.recv(torch.zeros(1), src=1, group=group)  # what rank 1 never sends
            return 0.0
        return step

    bench_worker.build_torch_step = build
    skipped: list[str] = []
    variant = TorchVariant("traced", "natural", "zbv", ("blocks.1",), ())
    step = bench_worker._try_torch(variant, None, (), None, 1, rank, world, skipped, {}, {})
    assert step is None
    return skipped


@pytest.mark.distributed
def test_a_torch_variant_failing_on_one_rank_releases_the_others_at_once():
    from tests.ranks import spawn

    notes = spawn(2, __name__, "_fails_on_one_rank", timeout=120, bound=60)
    assert notes[0] == notes[1]  # one line, the same on every rank
    note = notes[0][0]
    assert note.startswith("torch_traced_natural_zbv: rank 1: RuntimeError: torch cannot run")
    assert "stopped with it: rank 0" in note and "closed by peer" in note, note
    assert "Timed out" not in note


def test_a_trial_step_leaves_out_torch_pipelinings_log_and_restores_it(caplog):
    from torch.distributed.pipelining import schedules

    from fxpipe.tools.bench_worker import _torch_log_quiet

    schedules.logger.error("before: logged")
    with _torch_log_quiet():
        schedules.logger.error("Full Schedule: a line per action")
    schedules.logger.error("after: logged")
    assert [r.getMessage() for r in caplog.records] == ["before: logged", "after: logged"]


def test_a_failed_torch_variant_is_told_by_the_rank_that_failed_first():
    closed = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
              " Connection closed by peer [127.0.0.1]:10120. This is typically caused by a remote "
              "worker crashing.")
    to_itself = ("RuntimeError: [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/"
                 "transport/tcp/pair.cc:801] state_ >= CONNECTED. 1 vs 4. Pair is not connected "
                 "([127.0.0.1]:10120$1 <--> [none])")
    note = failure_note("torch_traced_natural_zbv", [closed, to_itself])
    assert note.startswith(f"torch_traced_natural_zbv: rank 1: {to_itself} (a send from rank 1 "
                           "to itself, which gloo refuses")
    assert note.endswith("stopped with it: rank 0 (Connection closed by peer)")
    # a pair to another rank is not a send to itself; two causes are both told
    note = failure_note("v", [to_itself, "RuntimeError: detached in-place"])  # on rank 0
    assert note == f"v: rank 0: {to_itself}; rank 1: RuntimeError: detached in-place"
    assert failure_note("v", ["", closed]) == f"v: rank 1: {closed}"  # only a consequence: told


def test_a_torch_variants_error_is_told_by_its_first_line_that_says_something_and_its_cause():
    def failed_stage() -> None:
        try:
            raise RuntimeError("Can't detach views in-place.\nUse detach() instead.")
        except RuntimeError as e:  # as torch's stage backward wraps its failures
            raise RuntimeError("\nFailed to run stage backward input:\nStage output: ...") from e
    with pytest.raises(RuntimeError) as caught:
        failed_stage()
    assert error_line(caught.value) == ("RuntimeError: Failed to run stage backward input: (from "
                                        "RuntimeError: Can't detach views in-place.)")
    assert error_line(ValueError()) == "ValueError: "


def test_the_rounds_measured_are_those_extend_asks_for_after_the_warm_up():
    ran: list[str] = []
    asked: list[float] = []

    def extend(round_seconds: float) -> int:
        asked.append(round_seconds)
        assert ran == ["a", "b", "b", "a"]  # after the two warm-up rounds, before any other
        return 5

    steps = {name: (lambda name=name: ran.append(name) or 1.0) for name in ("a", "b")}
    times, cpu, _, load = time_variants(["a", "b"], steps, 4, warmup=2, probe=lambda: 0.0,
                                        barrier=lambda: None, say=lambda _: None, extend=extend)
    assert len(asked) == 1 and asked[0] > 0
    assert len(times["a"]) == len(cpu["b"]) == len(load) == 2 + 5 and len(ran) == 14


def test_every_timed_step_follows_the_same_reference_work():
    # The reference work that times the cores leaves colder caches: run before fxpipe's steps
    # alone, it slowed them against torch's. Each step must follow it, whichever variant.
    log: list[str] = []

    def probe() -> float:
        log.append("probe")
        return 1.0 + 0.1 * log.count("probe")

    def step(name: str):
        def run() -> float:
            log.append(name)
            return float(len(name))
        return run

    names = ["single", "fxpipe", "torch"]
    steps = {name: step(name) for name in names}
    losses: dict[str, float] = {}
    times, cpu, around, load = time_variants(
        names, steps, 3, warmup=1, probe=probe, barrier=lambda: log.append("barrier"),
        alone=("single",), losses=losses, say=lambda _: None)
    ran = [i for i, entry in enumerate(log) if entry in names]
    assert len(ran) == 9 and all(len(times[n]) == len(cpu[n]) == 3 for n in names)
    for i in ran:  # the entry before each step's barrier is the reference work
        assert log[i - 1] == "barrier" and log[i - 2] == "probe", log[:i + 1]
        assert log[i + 1] == ("probe" if log[i] == "single" else "barrier")
    # each variant's reference seconds: the mean of the runs just before and after it
    assert around["fxpipe"][0] == pytest.approx((1.2 + 1.3) / 2)
    assert losses == {"single": 6.0, "fxpipe": 6.0, "torch": 5.0} and len(load) == 3
    # a rank that does not run a variant skips it, its barriers and its reference work alone
    log.clear()
    time_variants(names, {n: steps[n] for n in ("fxpipe", "torch")}, 1, warmup=0, probe=probe,
                  barrier=lambda: log.append("barrier"), alone=("single",), say=lambda _: None)
    assert log == ["probe", "barrier", "barrier", "fxpipe", "barrier", "probe",
                   "barrier", "torch", "barrier", "probe"]
