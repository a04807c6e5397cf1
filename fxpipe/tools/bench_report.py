"""What `fxpipe bench` reports: step times side by side, fxpipe's stages measured against their
prediction, the race against torch.distributed.pipelining; bench.json, bench.md, a trace."""
from __future__ import annotations

import json
import os
import statistics
from typing import Any

from tabulate import tabulate

from fxpipe import figures
from fxpipe.runtime.planning.schedule import DEFAULT_SCHEDULE, default_stages_per_rank
from fxpipe.runtime.planning.timeline import Event, write_chrome_trace
from fxpipe.tools.bench_stats import paired_ratio, schedule_bound
from fxpipe.tools.bench_worker import REMAT_COMPARED
from fxpipe.tools.core_speed import imbalance_at_equal_speed, speed_spread
from fxpipe.units import human_bytes

__all__ = ["summarise", "write"]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _fastest(step: dict[str, float], prefix: str, exclude: tuple[str, ...] = ()) -> str | None:
    names = [n for n in step if n.startswith(prefix) and not n.startswith(exclude)]
    return min(names, key=lambda n: step[n]) if names else None


def _off(kept: dict[str, float]) -> str:
    """A measurement's distance from its prediction, in percent."""
    predicted = kept["predicted_bytes"]
    return f"{kept['measured_bytes'] / predicted - 1:+.0%}" if predicted > 0 else "none predicted"


def summarise(results: dict[int, dict[str, Any]], memory: dict[str, list[dict[str, float]]],
              options: dict[str, Any]) -> dict[str, Any]:
    ranks = sorted(results)
    first = results[ranks[0]]
    step, spread, steps, cpu = {}, {}, {}, {}
    for name, samples in first["times"].items():
        per_step = [max(results[r]["times"][name][i] for r in ranks if results[r]["times"][name])
                    for i in range(len(samples))]
        steps[name] = per_step  # the step's time: its slowest rank's
        step[name] = _median(per_step)
        spread[name] = [min(per_step), max(per_step)] if per_step else [0.0, 0.0]
        cpu[name] = _median([sum(results[r]["cpu_times"][name][i] for r in ranks
                                 if results[r]["cpu_times"][name]) for i in range(len(samples))])
    measured = step["fxpipe"]
    pipelines = {name: _median([max(results[r]["pipeline"][name][i] for r in ranks)
                                for i in range(len(first["pipeline"][name]))])
                 for name in first["pipeline"]}
    pipeline = pipelines["fxpipe"]
    best_schedule = _fastest(step, "fxpipe", exclude=("fxpipe_remat_",)) or "fxpipe"
    torch_best = _fastest(step, "torch_")
    versus_torch = paired_ratio(steps[best_schedule], steps[torch_best]) if torch_best else None
    # the best schedule's speedup over one process at full batch, paired step by step
    best_speedup = paired_ratio(steps["single_process_full_batch"], steps[best_schedule])
    ranks_count, chunks = options["stages"], options["chunks"]
    bounds = {name: schedule_bound(_schedule(name), chunks, ranks_count,
                                   default_stages_per_rank(_schedule(name)))
              for name in first["predicted"] if not name.startswith("fxpipe_remat_")}

    micro_cost = step["single_process_full_batch"] / step["single_process"]

    def per_rank(name: str, part: int) -> list[float]:
        return [_median([t[part] for t in results[r]["stage_times"][name]]) for r in ranks]

    def imbalance(name: str) -> float | None:
        busy = per_rank(name, 0)
        return figures.imbalance(busy) if min(busy) > 0 else None

    def by_step(name: str, key: str) -> list[list[float]]:
        """[step][rank]: each rank's compute, or its reference-work seconds, per step."""
        rows = zip(*[results[r][key][name] for r in ranks])
        return [[t[0] if key == "stage_times" else t for t in row] for row in rows]

    def at_equal_speed(name: str) -> float | None:
        busy, probes = by_step(name, "stage_times"), by_step(name, "probes")
        return imbalance_at_equal_speed(busy, probes) if busy and probes else None

    every_probe = [p for name in first["probes"] for p in by_step(name, "probes")]
    compute, waits = per_rank("fxpipe", 0), per_rank("fxpipe", 1)
    by_mode = {m: step["fxpipe" if m == options["remat"] else f"fxpipe_remat_{m}"]
               for m in REMAT_COMPARED}
    predicted = first["predicted"]["fxpipe"]
    single_predicted = sum(st["predicted_s"] for st in first["stages"])
    summary: dict[str, Any] = {
        **{k: options[k] for k in ("model", "stages", "chunks", "remat", "batch", "balance")},
        "load_average": options["load_average"],
        "process_groups_while_timing": max(results[r]["process_groups"] for r in ranks),
        "steps_measured": len(steps["fxpipe"]),
        "load_average_while_timing": _median([x for r in ranks for x in results[r]["load"]]),
        "step_time_s": step, "step_time_min_max_s": spread, "cpu_time_s": cpu,
        "samples_per_s": {k: options["batch"] / v for k, v in step.items()},
        # against the plain model at full batch, its fastest step; the accumulating one beside
        "speedup_vs_single_process": step["single_process_full_batch"] / measured,
        "speedups_vs_single_process": {k: step["single_process_full_batch"] / v
                                       for k, v in step.items()},
        "speedups_vs_accumulating_process": {k: step["single_process"] / v
                                             for k, v in step.items()},
        "best_speedup_vs_single_process_paired": best_speedup.median,
        "best_speedup_vs_single_process_ci": [best_speedup.low, best_speedup.high],
        # each schedule's bound at equal stage costs and free messages (bench_stats): over one
        # process running the same micro-batches
        "ideal_speedup": bounds,
        # what micro-batching costs one process (the full batch's step over the accumulating
        # one's), and so each bound over the full batch, the baseline the speedups are taken on
        "full_batch_over_accumulating": micro_cost,
        "ideal_speedup_vs_full_batch": {name: b * micro_cost for name, b in bounds.items()},
        "measured_over_simulated_at_measured_compute": {
            name: t / first["predicted_at_measured_compute"][name]
            for name, t in pipelines.items()},
        "best_schedule": _schedule(best_schedule),
        # what schedule="auto" would pick: the fastest predicted of the variants raced
        "predicted_best_schedule": _schedule(min(
            (n for n in first["predicted"] if not n.startswith("fxpipe_remat_")),
            key=lambda n: first["predicted"][n])),
        "torch_pipelining_best": torch_best,
        "step_time_ratio_vs_torch_pipelining_best":
            step[best_schedule] / step[torch_best] if torch_best else None,
        # the same, paired step by step: the median ratio and its bootstrap 95% interval
        "step_time_ratio_vs_torch_pipelining_best_paired":
            versus_torch.median if versus_torch else None,
        "step_time_ratio_vs_torch_pipelining_best_ci":
            [versus_torch.low, versus_torch.high] if versus_torch else None,
        "versus_torch_pipelining_best": versus_torch.verdict if versus_torch else None,
        # fxpipe's schedule against torch's same schedule at fxpipe's cut (its faster frontend)
        "same_schedule_vs_torch": _same_schedule(steps, step),
        # how many variants each "best" is the fastest of (a minimum over more noisy variants
        # is biased low: the paired interval above is the figure to read)
        "variants_compared": {"fxpipe": len(bounds),
                              "torch": sum(1 for n in step if n.startswith("torch_"))},
        # the old comparison: torch's traced GPipe at fxpipe's cut
        "step_time_ratio_vs_torch_pipelining":
            measured / step["torch_traced_fxpipe_gpipe"]
            if "torch_traced_fxpipe_gpipe" in step else None,
        "stage_imbalance": imbalance("fxpipe"),
        "best_schedule_stage_imbalance": imbalance(best_schedule),
        "stage_imbalance_by_variant": {name: imbalance(name) for name in first["stage_times"]},
        # the machine's noise floor: identical work timed on every rank at once, around each
        # fxpipe step; and the imbalance left once each rank's compute is divided by its core's
        # relative slowness at that step
        "core_speed_spread": speed_spread(every_probe) if every_probe else None,
        "stage_imbalance_at_equal_speed": at_equal_speed("fxpipe"),
        "stage_imbalance_at_equal_speed_by_variant": {
            name: at_equal_speed(name) for name in first["stage_times"]},
        "predicted_step_time_s": predicted,
        "pipeline_step_time_s": pipeline,  # program.step alone, what the prediction covers
        "predicted_over_measured": predicted / pipeline,
        "predicted_over_measured_by_variant": {
            name: first["predicted"][name] / t for name, t in pipelines.items()},
        # the same, divided by the one-process step predicted (every stage's compute, one
        # after the other) over measured in this run: how well the pipeline is predicted at
        # the machine's speed of the moment, which drifts between runs on a shared machine
        "single_process_predicted_s": single_predicted,
        "machine_speed_factor": single_predicted / step["single_process"],
        "predicted_over_measured_at_run_speed": {
            name: first["predicted"][name] / t / (single_predicted / step["single_process"])
            for name, t in pipelines.items()},
        # the schedule's model alone: each variant simulated with each stage's forward,
        # backward and W as its rank measured them in this run, over the step measured
        "predicted_over_measured_at_measured_compute": {
            name: first["predicted_at_measured_compute"][name] / t
            for name, t in pipelines.items()},
        "remat_step_time_ratio": by_mode["except_last"] / by_mode["never"],
        "remat_step_time_ratios": {m: by_mode[m] / by_mode["never"] for m in REMAT_COMPARED[1:]},
        "stages_detail": [],
        "kept_activations": memory,
        # every fxpipe schedule's ranks at the peak of a step, against the memory model
        "kept_activations_by_schedule": {
            name: [{"rank": r, "measured_bytes": results[r]["kept"][name]["measured_bytes"],
                    "predicted_bytes": results[r]["kept"][name]["predicted_bytes"]}
                   for r in ranks]
            for name in first["kept"]},
        "losses_first_step": first["losses"],
        "split_points": first["split_points"],
        "balance_rounds": first["balance_rounds"], "balance_source": first["balance"],
        "balance_rounds_by_variant": first["balance_rounds_by_variant"],
        "profile": first["profile"],
        "torch_variants": first["variants"],
        "skipped": sorted({note for r in ranks for note in results[r]["skipped"]}),
    }
    for r, busy, wait in zip(ranks, compute, waits):
        kept = {m: memory[m][r]["measured_bytes"] for m in REMAT_COMPARED}
        summary["stages_detail"].append({
            "stage": r, **first["stages"][r], "busy_s": busy, "recv_wait_s": wait,
            "idle_s": max(0.0, pipeline - busy), "bubble": figures.idle_share(busy, 1, pipeline),
            **{f"kept_bytes_remat_{m}": kept[m] for m in REMAT_COMPARED},
            "kept_reduction": _ratio(kept["never"], kept["except_last"]),
            "kept_reductions": {m: _ratio(kept["never"], kept[m]) for m in REMAT_COMPARED[1:]}})
    summary["events"] = {r: results[r]["events"] for r in ranks}
    summary["predicted_events"] = first["predicted_events"]
    return summary


def _same_schedule(steps: dict[str, list[float]],
                   step: dict[str, float]) -> dict[str, dict[str, Any]]:
    """fxpipe's GPipe and 1F1B against torch's same schedule at fxpipe's cut, paired."""
    out = {}
    for schedule, ours in (("gpipe", "fxpipe"), ("1f1b", "fxpipe_1f1b")):
        theirs = [n for n in (f"torch_traced_fxpipe_{schedule}", f"torch_manual_fxpipe_{schedule}")
                  if n in step]
        if ours in steps and theirs:
            torch_name = min(theirs, key=lambda n: step[n])
            ratio = paired_ratio(steps[ours], steps[torch_name])
            out[schedule] = {"torch": torch_name, "ratio": ratio.median,
                             "ci": [ratio.low, ratio.high], "verdict": ratio.verdict}
    return out


def _schedule(variant: str) -> str:
    """The schedule of an fxpipe variant's name ("fxpipe" runs the default, GPipe)."""
    return DEFAULT_SCHEDULE.name if variant == "fxpipe" else variant.removeprefix("fxpipe_")


def _percent(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "-"


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _lines(summary: dict[str, Any]) -> list[str]:
    spread, step = summary["step_time_min_max_s"], summary["step_time_s"]
    bounds, at_full = summary["ideal_speedup"], summary["ideal_speedup_vs_full_batch"]
    best = next(name for name in bounds if _schedule(name) == summary["best_schedule"])
    low, high = summary["best_speedup_vs_single_process_ci"]
    rows = [[name, f"{t:.3f}", f"{spread[name][0]:.3f}-{spread[name][1]:.3f}",
             f"{summary['cpu_time_s'][name]:.3f}", f"{summary['samples_per_s'][name]:.1f}",
             f"{summary['speedups_vs_single_process'][name]:.2f}x",
             f"{bounds[name]:.2f}x ({at_full[name]:.2f}x)" if name in bounds else "",
             f"{summary['measured_over_simulated_at_measured_compute'][name]:.3f}"
             if name in summary["measured_over_simulated_at_measured_compute"] else ""]
            for name, t in sorted(step.items(), key=lambda kv: kv[1])]
    lines = [f"# fxpipe bench: {summary['model']}, {summary['stages']} stages x "
             f"{summary['chunks']} micro-batches, remat={summary['remat']}, "
             f"balance={summary['balance']}", "",
             f"machine load average (1 min) before / after: "
             f"{summary['load_average'][0]:.2f} / {summary['load_average'][1]:.2f}; process "
             f"groups per rank while timing: {summary['process_groups_while_timing']}; "
             f"{summary['steps_measured']} measured steps, each running every variant once in "
             f"an order rotated step by step (load average while timing, median: "
             f"{summary['load_average_while_timing']:.2f})", "",
             tabulate(rows, headers=["variant", "median step (s)", "min-max (s)",
                                     "CPU s (all ranks)", "samples/s",
                                     "speedup vs 1 process (full batch)",
                                     "schedule's bound (at full batch)",
                                     "measured / simulated at measured compute"],
                      tablefmt="github"), "",
             f"- speedup over one process at full batch (fxpipe GPipe): "
             f"**{summary['speedup_vs_single_process']:.2f}x** "
             f"(its bound {bounds['fxpipe']:.2f}x); over one process accumulating the same "
             f"micro-batches: {summary['speedups_vs_accumulating_process']['fxpipe']:.2f}x",
             f"- fxpipe's best schedule: {summary['best_schedule']} (the fastest predicted, "
             f"which schedule='auto' picks: {summary['predicted_best_schedule']}); its speedup "
             f"over one process at full batch, paired step by step: **"
             f"{summary['best_speedup_vs_single_process_paired']:.2f}x** (95% interval "
             f"{low:.2f}-{high:.2f}; its bound {bounds[best]:.2f}x)",
             f"- what micro-batches cost one process: it runs the full batch in "
             f"{summary['full_batch_over_accumulating']:.3f}x the time of its "
             f"{summary['chunks']} micro-batches one by one, so a schedule's bound over the "
             f"full batch is that times its bound ({best}: {at_full[best]:.2f}x)"]
    if step["single_process_full_batch"] > step["single_process"]:
        lines.append(f"- one process ran slower at full batch than accumulating the "
                     f"micro-batches in this run ({step['single_process_full_batch']:.3f} s "
                     f"against {step['single_process']:.3f} s): the full-batch baseline ran "
                     f"slow here, and speedups over it are flattered")
    if summary["torch_pipelining_best"]:
        lines.append(f"- fastest torch.distributed.pipelining variant (of "
                     f"{summary['variants_compared']['torch']}): "
                     f"{summary['torch_pipelining_best']}; fxpipe best (of "
                     f"{summary['variants_compared']['fxpipe']}) / it, paired step by step: **"
                     f"{summary['step_time_ratio_vs_torch_pipelining_best_paired']:.3f}** (95% "
                     "interval {:.3f}-{:.3f}: {})".format(
                         *summary["step_time_ratio_vs_torch_pipelining_best_ci"],
                         summary["versus_torch_pipelining_best"]))
    for schedule, same in summary["same_schedule_vs_torch"].items():
        lines.append(f"- fxpipe {schedule} / {same['torch']} (the same schedule at the same "
                     f"cut), paired: {same['ratio']:.3f} (95% interval {same['ci'][0]:.3f}-"
                     f"{same['ci'][1]:.3f}: {same['verdict']})")
    lines += ["- measured imbalance of the ranks' compute (slowest / mean): "
              + ", ".join(f"{name} " + (f"**{v:.3f}**" if v is not None else "-")
                          for name, v in summary["stage_imbalance_by_variant"].items()),
              f"- the ranks' cores ran identical work {_percent(summary['core_speed_spread'])} "
              "apart (median over fxpipe's steps: the machine's own drift); the imbalance "
              "left at equal core speed: " + ", ".join(
                  f"{name} " + (f"{v:.3f}" if v is not None else "-")
                  for name, v in summary["stage_imbalance_at_equal_speed_by_variant"].items()),
              f"- predicted step time {summary['predicted_step_time_s']:.3f} s vs measured "
              f"program.step {summary['pipeline_step_time_s']:.3f} s "
              f"(predicted/measured {summary['predicted_over_measured']:.3f}); by schedule: "
              + ", ".join(f"{name} {v:.3f}" for name, v in
                          summary["predicted_over_measured_by_variant"].items()),
              f"- the machine ran at {summary['machine_speed_factor']:.2f}x the predicted speed "
              f"(one process: predicted {summary['single_process_predicted_s']:.3f} s, measured "
              f"{summary['step_time_s']['single_process']:.3f} s); predicted/measured at that "
              "speed: " + ", ".join(f"{name} {v:.3f}" for name, v in
                                    summary["predicted_over_measured_at_run_speed"].items()),
              "- predicted/measured with each stage's compute as its rank measured it in this "
              "run (the schedule's model alone): " + ", ".join(
                  f"{name} {v:.3f}" for name, v in
                  summary["predicted_over_measured_at_measured_compute"].items()),
              "- activations kept at the peak of a step, by rank (measured, and how far from "
              "the prediction): " + "; ".join(f"{name} " + ", ".join(
                  f"{human_bytes(k['measured_bytes'])} ({_off(k)})" for k in ranks_kept)
                  for name, ranks_kept in summary["kept_activations_by_schedule"].items()),
              "- step time with remat on / off: " + ", ".join(
                  f"{m} {r:.3f}" for m, r in summary["remat_step_time_ratios"].items()),
              f"- fxpipe's cut (stages 1.. begin at): {summary['split_points']}; "
              f"{summary['balance_source']}", f"- profile: {summary['profile']}", ""]
    for i, r in enumerate(summary["balance_rounds"]):
        lines.append(f"- balance round {i + 1}: stages at {r['modules']}, predicted "
                     f"{[round(t * 1e3, 2) for t in r['predicted_s']]} ms, measured "
                     f"{[round(t * 1e3, 2) for t in r['measured_s']]} ms per micro-batch "
                     f"({r['spread']:.1%} apart)")
    for name, rounds in summary["balance_rounds_by_variant"].items():
        kept = [r for r in rounds if r.get("kept")]
        if name != "fxpipe" and kept:
            r = kept[0]
            lines.append(f"- {name}'s cut, kept of {len(rounds)} balance round(s): stages at "
                         f"{r['modules']}, measured {[round(t * 1e3, 2) for t in r['measured_s']]}"
                         f" ms per micro-batch on ranks {r['ranks']} ({r['rank_spread']:.1%} "
                         "apart by rank)")
    lines += ["", tabulate(
        [[d["stage"], d["first"], d["last"], d["ops"], f"{d['predicted_s']:.3f}",
          f"{d['busy_s']:.3f}", f"{d['recv_wait_s']:.3f}", f"{d['idle_s']:.3f}",
          f"{d['bubble']:.1%}",
          *[human_bytes(d[f"kept_bytes_remat_{m}"]) for m in REMAT_COMPARED]]
         for d in summary["stages_detail"]],
        headers=["stage", "first", "last", "ops", "predicted compute (s)", "compute (s)",
                 "recv waits (s)", "not computing (s)", "bubble",
                 *[f"kept ({m})" for m in REMAT_COMPARED]], tablefmt="github")]
    if summary["skipped"]:
        lines += ["", "not run:"] + [f"- {s}" for s in summary["skipped"]]
    return lines


def write(summary: dict[str, Any], out: str, plot: bool = False) -> None:
    os.makedirs(out, exist_ok=True)
    events = summary.pop("events")
    predicted_events = summary.pop("predicted_events")
    text = "\n".join(_lines(summary)) + "\n"
    print("\n" + text)
    with open(os.path.join(out, "bench.md"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(out, "bench.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True, default=str)
    measured = [Event(**e) for evs in events.values() for e in evs]
    predicted = [Event(**e) for e in predicted_events]
    write_chrome_trace(os.path.join(out, "bench_trace.json"),
                       {"fxpipe measured": measured, "fxpipe predicted": predicted})
    print(f"wrote {out}/bench.json, {out}/bench.md, {out}/bench_trace.json")
    if plot:
        _plot(measured, os.path.join(out, "bench_timeline.png"))


def _plot(events: list[Event], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); skipped")
        return
    colors = {"forward": "tab:blue", "backward": "tab:orange", "recv": "tab:gray",
              "send": "tab:green", "recv_grad": "tab:gray", "send_grad": "tab:green"}
    stages = sorted({e.stage for e in events if e.stage >= 0})
    fig, ax = plt.subplots(figsize=(12, 1 + len(stages)))
    for e in events:
        if e.kind in colors and e.stage >= 0:
            ax.barh(e.stage, e.end - e.start, left=e.start, color=colors[e.kind],
                    edgecolor="black", linewidth=0.3)
            if e.kind in ("forward", "backward"):
                ax.text(e.start + (e.end - e.start) / 2, e.stage,
                        f"{'F' if e.kind == 'forward' else 'B'}{e.microbatch}", ha="center",
                        va="center", fontsize=7)
    ax.set_yticks(stages)
    ax.set_yticklabels([f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
