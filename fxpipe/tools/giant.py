"""Compiles models of billions of parameters on the meta device, as a user with too little
memory for the weights would: the compile time, the peak host memory of the compiling process,
each stage's parameter memory, the predicted step time and the bubble.

Run as `python -m fxpipe.tools.giant --preset 8b --stages 8` (needs transformers). Presets:
Llama 3 shapes ("1b", "8b", "70b") and GPipe's largest Transformer ("gpipe": 1663 layers, d_model
2048, feed-forward 8192, 32 heads, vocabulary 32k, sequence 1024, batch 32, 83.9e9 parameters;
run it as `--preset gpipe --stages 128 --remat auto --memory-gb 16`). Each phase of the compile,
and the report and write() after it, is shown in wall and CPU seconds, and per layer: the phase
divided by the layers, or with `--layers 8 16` the marginal cost of a layer between two
compiles; and whether the layers were stamped from the graph of one (fxpipe.frontend.stamp).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from typing import Any

import torch

import fxpipe

__all__ = ["PRESETS", "GPIPE", "llama_on_meta", "model_on_meta", "compile_on_meta", "main"]

# Llama 3 shapes: 8B and 70B as published; "1b" has the 1B model's width with 8 layers and
# untied embeddings, about 1.0e9 parameters, for a quick run.
PRESETS: dict[str, dict[str, int]] = {
    "1b": {"num_hidden_layers": 8, "hidden_size": 2048, "intermediate_size": 8192,
           "num_attention_heads": 32, "num_key_value_heads": 8},
    "8b": {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8},
    "70b": {"num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672,
            "num_attention_heads": 64, "num_key_value_heads": 8},
}
# GPipe's Transformer-L at 128 partitions (its Table 1): a pre-norm decoder with a two-matrix
# feed-forward, which GPT-2's blocks are; 83.9e9 parameters, as the paper counts.
GPIPE: dict[str, int] = {"n_layer": 1663, "n_embd": 2048, "n_inner": 8192, "n_head": 32,
                         "vocab_size": 32000, "n_positions": 1024}
# the paper's batch and sequence for "gpipe": 32 sequences of 1024 tokens
GPIPE_BATCH = {"seq": 1024, "batch": 32}


def llama_on_meta(preset: str, dtype: torch.dtype = torch.bfloat16,
                  layers: int | None = None) -> torch.nn.Module:
    """A LlamaForCausalLM of the preset's shape (optionally with another number of layers),
    built on the meta device: no weights."""
    import transformers

    shape: dict[str, Any] = {**PRESETS[preset], **({"num_hidden_layers": layers} if layers else {})}
    config = transformers.LlamaConfig(**shape, vocab_size=128256,
                                      max_position_embeddings=8192, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model: torch.nn.Module = transformers.LlamaForCausalLM(config)
    return model.to(dtype).eval()


def model_on_meta(preset: str, dtype: torch.dtype = torch.bfloat16,
                  layers: int | None = None) -> torch.nn.Module:
    """The preset's model on the meta device (optionally with another number of layers)."""
    if preset != "gpipe":
        return llama_on_meta(preset, dtype, layers)
    import transformers

    shape: dict[str, Any] = {**GPIPE, **({"n_layer": layers} if layers else {})}
    config = transformers.GPT2Config(**shape, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.device("meta"):
        model: torch.nn.Module = transformers.GPT2LMHeadModel(config)
    return model.to(dtype).eval()


def _resident() -> tuple[int, int]:
    """(current, peak since _restart_peak) resident memory of this process in bytes (Linux
    /proc; elsewhere both are the whole process's peak)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, peak


def _restart_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        pass


def compile_on_meta(model: torch.nn.Module, *, stages: int, chunks: int, seq: int = 2048,
                    microbatch: int = 2, profile: str = "h100", stamp: bool = True,
                    remat: str = "except_last", memory_limit: int | None = None,
                    write: bool = False) -> dict[str, Any]:
    """Compiles `model` (on meta) and returns the figures of the run and of the plan; the
    report and, when `write`, the program's folder (to a temporary directory) are timed too."""
    ids = torch.zeros(chunks * microbatch, seq, dtype=torch.long)
    params = {id(p): p for p in model.parameters()}.values()
    process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _restart_peak()
    before, _ = _resident()
    start, cpu = time.perf_counter(), time.process_time()
    program = fxpipe.compile(model, (ids,), example_kwargs={"use_cache": False}, stages=stages,
                             chunks=chunks, profile=profile, check="shapes", stamp=stamp,
                             remat=remat, memory_limit=memory_limit)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    after: dict[str, tuple[float, float]] = {}
    clock = (time.perf_counter(), time.process_time())
    report = program.report()
    summary = report.summary()
    after["report"] = (time.perf_counter() - clock[0], time.process_time() - clock[1])
    if write:
        clock = (time.perf_counter(), time.process_time())
        with tempfile.TemporaryDirectory() as folder:
            program.write(folder)
        after["write"] = (time.perf_counter() - clock[0], time.process_time() - clock[1])
    _, peak = _resident()
    return {
        "parameters": sum(p.numel() for p in params),
        "model_bytes": sum(p.numel() * p.element_size() for p in params),
        "stages": stages, "chunks": chunks, "microbatch": microbatch, "seq": seq,
        "profile": report.profile, "compile_s": seconds, "compile_cpu_s": cpu,
        "process_peak_bytes": max(peak, process_peak), "rss_before_compile_bytes": before,
        "compile_peak_growth_bytes": peak - before,
        "layers": sum(1 for _ in _decoder_layers(model)),
        "timings_s": {**program.built.timings, **{k: w for k, (w, _) in after.items()}},
        "cpu_timings_s": {**program.built.cpu_timings, **{k: c for k, (_, c) in after.items()}},
        "capture_timings_s": dict(program.built.capture_info.timings),
        "capture_cpu_timings_s": dict(program.built.capture_info.cpu_timings),
        "fake_runs": program.built.capture_info.fake_runs,
        "cut_runs": program.built.capture_info.cut_runs,
        "stamped": program.built.capture_info.stamped,
        "nodes": len(program.built.captured.graph.nodes),
        "stamping": program.built.capture_info.stamp_note,
        "stage_params_bytes": [s["params_bytes"] for s in report.stages],
        "stage_memory_model_bytes": [s["memory_model_bytes"] for s in report.stages],
        "stage_first_last": [(s["first_module"], s["last_module"]) for s in report.stages],
        "predicted_step_time_s": summary["predicted_step_time_s"],
        "bubble": summary["bubble"], "imbalance": summary["imbalance"],
    }


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    transformer = getattr(model, "transformer", None)
    if isinstance(transformer, torch.nn.Module):  # GPT-2
        return list(getattr(transformer, "h", []))
    layers: list[torch.nn.Module] = list(getattr(getattr(model, "model", model), "layers", []))
    return layers


def phases(figures: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """(wall, CPU) seconds of each pass and, within capture, of its phases."""
    rows = {name: (wall, figures["cpu_timings_s"].get(name, 0.0))
            for name, wall in figures["timings_s"].items()}
    rows.update({f"capture: {name}": (wall, figures["capture_cpu_timings_s"].get(name, 0.0))
                 for name, wall in figures["capture_timings_s"].items()})
    rows["compile total"] = (figures["compile_s"], figures["compile_cpu_s"])
    return rows


def per_layer(runs: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Seconds (wall, CPU) a decoder layer adds to each phase: between the first and the last
    compile when their layer counts differ, else the phase divided by the layers."""
    first, last = runs[0], runs[-1]
    a, b = phases(first), phases(last)
    if last["layers"] != first["layers"]:
        span = last["layers"] - first["layers"]
        return {k: ((w - a.get(k, (0.0, 0.0))[0]) / span, (c - a.get(k, (0.0, 0.0))[1]) / span)
                for k, (w, c) in b.items()}
    return {k: (w / last["layers"], c / last["layers"]) for k, (w, c) in b.items()}


def _print_phases(runs: list[dict[str, Any]]) -> None:
    layers = [r["layers"] for r in runs]
    marginal = layers[0] != layers[-1]
    each = per_layer(runs)
    head = "".join(f"  {n:>3d} layers wall/CPU" for n in layers)
    what = f"per layer {layers[0]}->{layers[-1]}" if marginal else "per layer (phase / layers)"
    print(f"{'phase':28s}{head}  {what} wall/CPU")
    for name in phases(runs[-1]):
        cells = "".join(f"  {phases(r).get(name, (0.0, 0.0))[0]:8.2f} "
                        f"{phases(r).get(name, (0.0, 0.0))[1]:8.2f} s" for r in runs)
        wall, cpu = each[name]
        print(f"{name:28s}{cells}  {wall:9.3f} {cpu:9.3f} s")
    print("runs on fake tensors while capturing, of the whole model (and of it cut to three "
          "blocks a list): " + ", ".join(f"{r['fake_runs']} ({r['cut_runs']}) at {r['layers']} "
                                         f"layers" for r in runs))
    for r in runs:
        print(f"repeated blocks ({r['layers']} layers, {r['nodes']} nodes): "
              f"{r['stamping'] or 'off (--no-stamp)'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxpipe.tools.giant", description=__doc__)
    parser.add_argument("--preset", choices=[*sorted(PRESETS), "gpipe"], default="8b")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--chunks", type=int, help="micro-batches (default 4 x stages)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 2048; gpipe 1024)")
    parser.add_argument("--microbatch", type=int,
                        help="sequences per micro-batch (default 2; gpipe: 32 / chunks)")
    parser.add_argument("--remat", default="except_last",
                        help="except_last, always, never or auto (with --memory-gb)")
    parser.add_argument("--memory-gb", type=float, help="memory limit per device, GB (1e9 B)")
    parser.add_argument("--write", action="store_true",
                        help="also time write() of the program's folder (to a temporary one)")
    parser.add_argument("--profile", default="h100")
    parser.add_argument("--layers", type=int, nargs="+", metavar="N",
                        help="decoder layers instead of the preset's; two counts (8 16) show "
                             "what one more layer costs in each phase")
    parser.add_argument("--no-stamp", dest="stamp", action="store_false",
                        help="trace every decoder layer instead of stamping copies of one")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    gpipe = args.preset == "gpipe"
    seq = args.seq or (GPIPE_BATCH["seq"] if gpipe else 2048)
    chunks = args.chunks or (min(GPIPE_BATCH["batch"], 4 * args.stages) if gpipe
                             else 4 * args.stages)
    microbatch = args.microbatch or (max(1, GPIPE_BATCH["batch"] // chunks) if gpipe else 2)
    limit = int(args.memory_gb * 1e9) if args.memory_gb else None
    runs = []
    counts: list[int | None] = list(args.layers or [None])
    if len(counts) > 1:  # a first compile pays once for imports and caches: not a layer's cost
        compile_on_meta(model_on_meta(args.preset, layers=4), stages=1, chunks=2, seq=seq,
                        profile=args.profile, stamp=args.stamp)
    for layers in counts:
        model = model_on_meta(args.preset, layers=layers)
        runs.append(compile_on_meta(model, stages=args.stages, chunks=chunks, seq=seq,
                                    microbatch=microbatch, profile=args.profile,
                                    stamp=args.stamp, remat=args.remat, memory_limit=limit,
                                    write=args.write))
        del model
    figures = runs[-1]
    if args.json:
        figures["per_layer_s"] = per_layer(runs)
        print(json.dumps(figures, indent=1))
        return 0
    gib = 2**30
    print(f"{'GPipe Transformer' if gpipe else 'Llama ' + args.preset} "
          f"({figures['layers']} layers): "
          f"{figures['parameters'] / 1e9:.2f}e9 parameters, "
          f"{figures['model_bytes'] / gib:.1f} GiB in bf16, on the meta device")
    print(f"compile: {figures['compile_s']:.1f} s wall, {figures['compile_cpu_s']:.1f} s CPU")
    _print_phases(runs)
    print(f"peak host memory of this process: {figures['process_peak_bytes'] / gib:.2f} GiB; "
          f"{figures['rss_before_compile_bytes'] / gib:.2f} GiB before compiling, at most "
          f"{figures['compile_peak_growth_bytes'] / gib:.3f} GiB more while compiling")
    print(f"{args.stages} stages x {figures['chunks']} micro-batches of {figures['microbatch']}"
          f" x {seq} tokens, {figures['profile']}, remat {args.remat}"
          + (f", {args.memory_gb:g} GB per device" if limit else ""))
    for i, (params, memory, (first, last)) in enumerate(zip(
            figures["stage_params_bytes"], figures["stage_memory_model_bytes"],
            figures["stage_first_last"])):
        print(f"  stage {i:2d}: parameters {params / gib:6.2f} GiB, predicted memory "
              f"{memory / gib:6.2f} GiB  ({first} .. {last})")
    print(f"predicted step time {figures['predicted_step_time_s']:.3f} s, bubble "
          f"{figures['bubble']:.1%}, imbalance {figures['imbalance']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
