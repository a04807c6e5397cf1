"""Tests for fxpipe.report: the partition report (text, markdown, JSON), cost tables, and the
measured-versus-predicted activation memory of a compiled program.

The report is checked on gpt at 3 stages x 4 micro-batches: its tied embedding / LM-head weight
lives in the first and the last stage. Programs use the deterministic "a100" preset and dropout=0.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

import pytest

import fxpipe
from fxpipe import ir
from fxpipe.costs import cost_table
from fxpipe.errors import ConfigError
from fxpipe.figures import remat_saving, stage_load
from fxpipe.models import gpt, mlp
from fxpipe.profile import get_profile
from fxpipe.remat_policy import remat_policy
from fxpipe.report import SCHEDULE_TITLES
from fxpipe.runtime.planning.schedule import SCHEDULES
from fxpipe.runtime.planning.timeline import chrome_trace, predicted_events, predicted_step
from fxpipe.units import human_bytes, human_flops, human_time

STAGES, CHUNKS = 3, 4


@functools.cache
def compiled() -> tuple[Any, Any]:
    """(model, program) for gpt at 3 stages x 4 micro-batches (shared: do not modify)."""
    model, inputs = gpt.build(dropout=0.0)
    program = fxpipe.compile(model, inputs, stages=STAGES, chunks=CHUNKS, profile="a100")
    return model, program


def table_rows(text: str) -> list[str]:
    """The stage rows of the text report's table (between the dashes and the blank line)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if set(line.strip()) <= {"-", " "}
                 and line.strip()) + 1
    end = lines.index("", start)
    return lines[start:end]


def stage_params(stage: Any) -> int:
    return sum(p.numel() for p in stage.graph_module.parameters())  # unique Parameter objects


# --- the text report ---------------------------------------------------------------------------


def test_report_text_lists_every_stage_with_modules_nodes_params_flops_time_and_memory():
    _, program = compiled()
    plan = program.plan
    b = plan.microbatch_size
    rows = table_rows(program.report().text())
    assert len(rows) == STAGES

    for row, st, sp in zip(rows, program.stages, plan.stages):
        nodes = ir.compute_nodes(program.graph_module.graph)
        flops = sum(float(ir.evaluate(ir.cost(n).fwd_flops, b))
                    for n in nodes if ir.stage(n) == st.index)
        params = stage_params(st)
        cells = [str(st.index), sp.first_module, sp.last_module, str(len(sp.nodes)),
                 f"{params:,}", human_flops(flops),
                 human_time(stage_load(sp.compute_time, sp.comm_time)), human_bytes(4 * params)]
        for cell in cells:
            assert cell in row, f"stage {st.index}: {cell!r} not in {row!r}"
        assert row.split()[0] == str(st.index)
        assert len(re.findall(r"\d+(?:\.\d+)? (?:B|KiB|MiB|GiB)\b", row)) == 5  # memory columns


def test_print_of_a_program_shows_its_plan_and_each_stage_s_modules_and_parameters():
    model, inputs = gpt.build()
    program = fxpipe.compile(model, stages=2, chunks=2)
    assert "GPT: 2 stages x 2 micro-batches, schedule gpipe, remat except_last (built on its " \
           "first call)" in str(program)
    program(*inputs)
    text = str(program.eval())
    assert "GPT: 2 stages x 2 micro-batches, schedule gpipe, remat except_last, eval mode" in text
    for stage, module in enumerate(program.stage_modules):
        count = sum(p.numel() for p in module.parameters())
        assert f"(Stage {stage} of 2 of GPT: " in text
        assert f"ops), {count:,} parameters)" in text
    assert "wte -> " in text and "-> lm_head" in text


def test_report_text_states_imbalance_bubble_step_time_and_the_schedule_grid():
    _, program = compiled()
    plan = program.plan
    text = program.report().text()
    loads = [s.compute_time + s.comm_time / 2 for s in plan.stages]
    simulated, bubble = predicted_step(plan, "gpipe", STAGES)

    assert plan.imbalance == pytest.approx(max(loads) / (sum(loads) / len(loads)))
    assert (f"imbalance (slowest / mean stage, compute + half its traffic): "
            f"{plan.imbalance:.3f}") in text
    assert f"bubble (idle share of the ranks): {bubble:.1%}" in text
    assert plan.predicted_step_time == pytest.approx(simulated)
    assert f"predicted step time: {human_time(simulated)} (gpipe played with the stage costs)" \
        in text

    grid = text[text.index("\nclock"):]
    assert all(f"stage {s}" in grid.splitlines()[1] for s in range(STAGES))
    for action in ("F", "B"):
        tokens = re.findall(rf"\b{action}(\d+)\b", grid)
        assert sorted(map(int, tokens)) == sorted(list(range(CHUNKS)) * STAGES)


@pytest.mark.parametrize("options", ({}, {"split_points": ["blocks.1"], "chunks": 8},
                                     {"schedule": "zb-h1"}))
def test_one_bubble_one_imbalance_and_one_step_in_the_report_the_grid_and_the_headers(options):
    model, inputs = gpt.build(dropout=0.0)
    program = fxpipe.compile(model, inputs, **{"stages": 2, "chunks": 4, "profile": "a100",
                                               **options})
    plan, report = program.plan, program.report()
    summary, text = report.summary(), report.text()
    schedule = program.built.config.schedule
    step, bubble = predicted_step(plan, schedule, 2)
    # one bubble: the ranks' idle share of the simulated step, wherever it is printed
    assert summary["bubble"] == pytest.approx(bubble)
    assert re.findall(r"bubble[^%]*?(\d+\.\d)%", text.split("simulated step time by")[0]) \
        == [f"{bubble:.1%}"[:-1]]
    assert f"bubble = {bubble:.1%} (idle share" in text  # the grid's note
    assert "(S-1)/(M+S-1)" not in text and "idle/total" not in text
    by_schedule = {c["schedule"]: c["bubble"] for c in summary["schedules"]}
    assert by_schedule[schedule] == pytest.approx(bubble)
    # one figure per schedule, named once: each schedule's own simulated idle share, never the
    # unit-cost (S-1)/(M+S-1) beside it
    for c in summary["schedules"]:
        assert c["bubble"] == pytest.approx(predicted_step(plan, c["schedule"], c["ranks"])[1])
        assert f"{c['schedule']} {human_time(c['step_time_s'])} (bubble {c['bubble']:.1%}," \
            in text
    printed = re.findall(r"bubble[^%\n]*?(\d+\.\d)%", text)
    assert sorted(set(printed)) == sorted({f"{c['bubble']:.1%}"[:-1]
                                           for c in summary["schedules"]})
    # one kept-bytes figure per schedule: GPipe's is the peak measure_activations compares with
    # (the stages' forwards), with what the loss keeps for each micro-batch on the last stage
    kept = {c["schedule"]: c["kept_bytes"] for c in summary["schedules"]}
    m = plan.chunks
    assert report.stages[-1]["loss_bytes"] > 0
    assert kept["gpipe"] == pytest.approx(max(s["kept_predicted_bytes"] + m * s["loss_bytes"]
                                              for s in report.stages))
    assert kept["1f1b"] <= kept["gpipe"]
    assert f"(bubble {bubble:.1%}, keeps {human_bytes(kept[schedule])})" in text
    # one step: the simulated one, also what chunks="auto" compares
    assert plan.predicted_step_time == pytest.approx(step)
    assert summary["predicted_step_time_s"] == summary["simulated_step_time_s"]
    assert "slowest stage:" not in text
    # one imbalance: the stages' loads; the stage files print no time (the same on any machine)
    loads = [stage_load(s.compute_time, s.comm_time) for s in plan.stages]
    assert plan.imbalance == pytest.approx(max(loads) / (sum(loads) / len(loads)))
    for st in program.stages:
        assert "of all stages' time" not in st.source and "bubble" not in st.source


def test_kept_bytes_at_the_peak_count_the_micro_batches_in_flight():
    def kept_at_peak(saved, kept, remat, inflight, chunks):
        return remat_policy(remat).kept_at_peak(saved, kept, inflight, chunks)

    assert kept_at_peak(100, 10, "never", 3, 4) == 300
    assert kept_at_peak(100, 10, "always", 3, 4) == 30
    # except_last: the last micro-batch whole, beside the others the stage has in flight
    assert kept_at_peak(100, 10, "except_last", 4, 4) == 130  # GPipe: all four
    assert kept_at_peak(100, 10, "except_last", 1, 4) == 100  # 1F1B's last stage: one


def test_remat_that_saves_nothing_is_reported_as_such():
    assert remat_saving(3174.4, 3174.4, human_bytes) == \
        "saves nothing: keeps 3.1 KiB (its inputs) where running it whole keeps 3.1 KiB"
    assert remat_saving(153600, 0, human_bytes).startswith("saves nothing: keeps 150.0 KiB")
    assert remat_saving(512, 4096, human_bytes) == "keeps 512 B instead of 4.0 KiB"
    # BatchNorm in train mode: the convolutions between the norms keep their inputs either way
    from fxpipe.models import resnet

    model, inputs = resnet.build()
    program = fxpipe.compile(model.train(), inputs, stages=2, chunks=4, remat="always",
                             profile="a100")
    lines = [line for st in program.stages for line in st.source.splitlines()
             if line.startswith("#   remat ")]
    regions = [r for st in program.built.stages for r in st.regions]
    assert len(lines) == len(regions) > 0
    for line, region in zip(lines, regions):
        assert ("saves nothing" in line) == (region.kept_bytes >= region.saved_bytes), line
        assert not re.search(r"keeps (\S+ \S+) instead of \1", line), line


def test_report_markdown_is_a_github_table():
    _, program = compiled()
    lines = program.report().markdown().splitlines()
    table = [line for line in lines if line.startswith("|")]

    assert len(table) == 2 + STAGES
    assert re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", table[1]), table[1]
    widths = {line.count("|") for line in table}
    assert len(widths) == 1
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header[:4] == ["stage", "first", "last", "ops"]
    for s, row in enumerate(table[2:]):
        assert row.strip("|").split("|")[0].strip() == str(s)


def test_report_json_is_data_with_the_summary_and_per_stage_numbers():
    _, program = compiled()
    plan = program.plan
    data = program.report().json()
    assert json.loads(program.report().json_text()) == data  # the text report.json holds
    summary = data["summary"]

    assert summary["stages"] == STAGES and summary["chunks"] == CHUNKS
    assert summary["bubble"] == pytest.approx(predicted_step(plan, "gpipe", STAGES)[1])
    assert summary["predicted_step_time_s"] == pytest.approx(plan.predicted_step_time)
    assert summary["imbalance"] == pytest.approx(plan.imbalance)
    assert [s["stage"] for s in data["stages"]] == list(range(STAGES))
    for entry, sp, st in zip(data["stages"], plan.stages, program.stages):
        assert entry["nodes"] == len(sp.nodes)
        assert entry["time_s"] == pytest.approx(stage_load(sp.compute_time, sp.comm_time))
        assert entry["first_module"] == sp.first_module and entry["last_module"] == sp.last_module
        assert entry["param_count"] == stage_params(st)
        assert entry["params_bytes"] == 4 * stage_params(st)
        assert entry["memory_model_bytes"] == pytest.approx(sp.memory)
        for key in ("fwd_flops", "activations_bytes", "kept_with_remat_bytes", "recv_bytes",
                    "send_bytes", "compute_s", "comm_s"):
            assert isinstance(entry[key], (int, float)) and entry[key] >= 0, key
    assert data["stages"][0]["recv_bytes"] == 0 and data["stages"][-1]["send_bytes"] == 0


def test_reports_of_one_compile_simulate_each_schedule_once_and_agree(monkeypatch):
    model, inputs = gpt.build(dropout=0.0)
    program = fxpipe.compile(model, inputs, stages=STAGES, chunks=CHUNKS, profile="a100")
    simulated = []

    def counted(plan, schedule, ranks):
        simulated.append((schedule.name, ranks))
        return predicted_step(plan, schedule, ranks)

    monkeypatch.setattr("fxpipe.report.predicted_step", counted)
    first = program.report()
    text = first.text()
    assert simulated and len(set(simulated)) == len(simulated)  # each layout once
    again = program.report()
    assert again.text() == text and again.json_text() == first.json_text()
    assert len(set(simulated)) == len(simulated)  # the second report simulated nothing again


def test_tied_weight_is_counted_in_both_stages_that_hold_it_and_the_report_says_so():
    model, program = compiled()
    report = program.report()
    data = report.json()
    model_count = sum(p.numel() for p in model.parameters())  # the tied weight once
    tied = model.wte.weight.numel()

    assert data["shared_parameters"] == {"wte.weight": [0, STAGES - 1]}
    assert "wte.weight in stages [0, 2]" in report.text()
    # each stage holds (and counts) its own reference to the tied weight
    assert sum(s["param_count"] for s in data["stages"]) == model_count + tied
    for s in (0, STAGES - 1):
        assert any(p is model.wte.weight for p in program.stages[s].graph_module.parameters())


# --- cost tables -------------------------------------------------------------------------------

_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def _columns(table: str) -> list[dict[str, str]]:
    """Parses a tabulate "simple" table into rows of {header: cell}."""
    lines = table.splitlines()
    spans = [m.span() for m in re.finditer(r"-+", lines[1])]
    header = [lines[0][a:b].strip() for a, b in spans]
    return [{h: line[a:b].strip() for h, (a, b) in zip(header, spans)} for line in lines[2:]]


def _seconds(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * _UNITS[unit]


def test_cost_table_by_module_sorted_by_time_shows_the_top_rows_in_descending_order():
    _, program = compiled()
    gm = program.graph_module
    profile = get_profile("a100")

    table = cost_table(gm, b=4, profile=profile, sort="time", by_module=True, top=5)
    everything = cost_table(gm, b=4, profile=profile, sort="time", by_module=True)

    rows = _columns(table)
    assert len(table.splitlines()) == 2 + len(rows) and len(rows) == 5  # header, dashes, rows
    times = [_seconds(r["est time"]) for r in rows]
    assert times == sorted(times, reverse=True)
    all_rows = _columns(everything)
    assert len(all_rows) > 5
    assert rows == all_rows[:5]
    assert max(_seconds(r["est time"]) for r in all_rows[5:]) <= times[-1]
    modules = [r["module"] for r in all_rows]
    assert len(set(modules)) == len(modules)  # one row per module


def test_cost_table_refuses_a_sort_key_it_has_not_and_names_those_it_has():
    _, program = compiled()
    with pytest.raises(ConfigError, match="cannot sort by 'flops'") as error:
        program.cost_table(sort="flops")
    assert "'fwd_flops'" in error.value.hint and "'saved'" in error.value.hint


def test_module_of_a_stage_the_program_has_not_is_an_error_not_none():
    _, program = compiled()
    assert program.module_of(STAGES - 1) is not None
    for stage in (STAGES, -1, "1"):
        with pytest.raises(ConfigError, match=f"has no stage {stage!r}: its stages are 0 to "
                                              f"{STAGES - 1}"):
            program.module_of(stage)


# --- measured activation memory ----------------------------------------------------------------


@functools.cache
def kept_activations(remat: str) -> list[dict[str, float]]:
    model, (idx,) = gpt.build(dropout=0.0, batch=16)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=8, remat=remat, profile="a100")
    result = program.measure_activations(idx)
    text = program.report().text()
    assert "kept/step predicted" in text and "kept/step measured" in text
    # the measurement says how it compares with the prediction
    line = next(x for x in text.splitlines()
                if x.startswith("activations the stages keep at the peak"))
    for r in result:
        assert (f"stage {r['stage']} {human_bytes(r['measured_bytes'])}, predicted "
                f"{human_bytes(r['predicted_bytes'])}: "
                f"{r['measured_bytes'] / r['predicted_bytes'] - 1:+.0%} against the prediction"
                ) in line
    return result


@pytest.mark.parametrize("remat", ("never", "always"))
def test_measured_kept_activations_are_within_ten_percent_of_the_prediction(remat):
    result = kept_activations(remat)
    assert [r["stage"] for r in result] == [0, 1]
    for r in result:
        print(f"\nremat={remat} stage {r['stage']}: measured {r['measured_bytes']:.0f} B, "
              f"predicted {r['predicted_bytes']:.0f} B")
        assert r["measured_bytes"] > 0
        assert abs(r["measured_bytes"] - r["predicted_bytes"]) <= 0.1 * r["predicted_bytes"]


def test_remat_always_keeps_at_least_three_times_less_than_never_in_every_stage():
    never, always = kept_activations("never"), kept_activations("always")
    for n, a in zip(never, always):
        ratio = n["measured_bytes"] / a["measured_bytes"]
        print(f"\nstage {n['stage']}: never {n['measured_bytes']:.0f} B, "
              f"always {a['measured_bytes']:.0f} B ({ratio:.1f}x)")
        assert 3 * a["measured_bytes"] <= n["measured_bytes"]


# -- schedule="auto" ----------------------------------------------------------------------------


def _auto(memory_limit: float | None = None) -> Any:
    model, inputs = gpt.build(dropout=0.0)
    return fxpipe.compile(model, inputs, stages=2, chunks=8, profile="a100", schedule="auto",
                          remat="never", memory_limit=memory_limit)


def test_auto_schedule_picks_the_fastest_simulated_step_and_the_report_lists_each_one():
    program = _auto()
    times = dict(program.plan.schedules)
    assert set(times) == set(SCHEDULES) and None not in times.values()
    chosen = program.built.config.schedule
    assert chosen == min(times, key=lambda name: times[name])
    text = program.report().text()
    assert f"schedule={chosen})" in text.splitlines()[0]
    assert (f"schedule='auto' chose {chosen}: the fastest simulated step that fits the memory "
            "limit (" + ", ".join(f"{n} {human_time(t)}" for n, t in times.items()) + ")") in text
    stages = program.built.config.stages
    on = " on 2 ranks" if stages == 4 else ""
    assert f"{SCHEDULE_TITLES[chosen]}, {stages} stages x 8 microbatches{on}" in text
    assert program.built.config.ranks == 2  # auto keeps the number of ranks


def test_auto_cuts_a_looped_candidate_into_twice_the_stages_on_the_same_ranks():
    program = _auto()
    times = dict(program.plan.schedules)
    assert set(times) == set(SCHEDULES)
    looped = fxpipe.compile(*gpt.build(dropout=0.0), stages=4, chunks=8, profile="a100",
                            schedule="zb-v", remat="never")
    assert looped.built.config.ranks == 2 and len(looped.stages) == 4
    assert predicted_step(looped.plan, "zb-v", 2)[0] == pytest.approx(times["zb-v"])
    text = looped.report().text()
    assert "fxpipe partition of GPT: 4 stages on 2 ranks (2 per rank) x 8 micro-batches" in text
    assert "simulated step time by schedule (stage costs, bubble, most activations a stage " \
           "keeps at the peak): interleaved-1f1b " in text \
           and " zb-h1 " not in text
    assert "ZB-V, 4 stages x 8 microbatches on 2 ranks" in text


def test_auto_schedule_leaves_out_a_schedule_whose_activations_do_not_fit():
    plans = {name: _plan(name) for name in ("gpipe", "1f1b")}
    peak = {name: max(s.memory for s in plan.stages) for name, plan in plans.items()}
    assert peak["1f1b"] < peak["gpipe"]  # 1F1B keeps 2 of 8 micro-batches, GPipe all 8
    program = _auto(memory_limit=(peak["1f1b"] + peak["gpipe"]) / 2)
    times = dict(program.plan.schedules)
    assert times["gpipe"] is None and times["1f1b"] is not None
    assert program.built.config.schedule != "gpipe"
    assert "gpipe does not fit" in program.report().text()


def _plan(schedule: str) -> Any:
    model, inputs = gpt.build(dropout=0.0)
    return fxpipe.compile(model, inputs, stages=2, chunks=8, profile="a100", schedule=schedule,
                          remat="never").plan


def test_predicted_zb_h1_timeline_labels_the_split_backward_and_charges_w_its_weight_part():
    plan = _plan("zb-h1")
    events = predicted_events(plan, "zb-h1")
    split = [e for e in events if e.kind == "backward"]
    assert sorted((e.detail, e.stage, e.microbatch) for e in split) == sorted(
        (d, s, m) for d in ("I", "W") for s in range(2) for m in range(8))
    for e in split:  # W: the weight gradients; I the rest of the backward
        st = plan.stages[e.stage]
        backward = st.compute_time - st.forward_time
        assert st.recompute_time == 0  # remat never
        if e.stage == 0:  # no input gradient to send: W is the whole backward
            assert st.weight_time == pytest.approx(backward)
            expected = backward if e.detail == "W" else 0.0
        else:
            assert 0 < st.weight_time < backward
            expected = st.weight_time if e.detail == "W" else backward - st.weight_time
        assert e.end - e.start == pytest.approx(expected)
    assert max(e.end for e in events) == pytest.approx(predicted_step(plan, "zb-h1")[0])
    names = {t["name"] for t in chrome_trace(events) if t["ph"] == "X"}
    assert {"F0", "I0", "W7"} <= names and "B0" not in names
def test_a_measured_profile_is_described_once_in_the_report():
    measured = dataclasses.replace(
        get_profile("a100"), name="measured cpu, 1 thread(s) (float32)", key="cpu-t1",
        source="measured on cpu, 1 thread(s) in float32: each op class at 3-7 sizes")
    model, inputs = mlp.build()
    text = fxpipe.compile(model, inputs, stages=2, chunks=4, profile=measured).report().text()
    assert ("device profile: measured cpu, 1 thread(s) (float32) [cpu-t1] (each op class at "
            "3-7 sizes)") in text
    assert text.count("1 thread(s)") == 1
