"""Runs a function on several ranks on 127.0.0.1 (gloo, or nccl with one GPU per rank) and
brings back what each returned.

A test module defines the function at module level; the ranks are spawned processes that import
the module and call it as fn(rank, world, *args) once the process group is up.
"""
from __future__ import annotations

import importlib
import io
import os
import queue as queue_module
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fxpipe.runtime.program.torchrun import free_port

__all__ = ["spawn"]


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # plain bytes: the sender may exit before the parent reads them
    return buffer.getvalue()


def _entry(rank: int, world: int, port: int, module: str, fn: str, args: tuple, env: dict,
           timeout: float, backend: str, results: Any) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(env)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        device = None
        if backend == "nccl":  # the device first, then the group (DESIGN.md, sharp edges)
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device,
                                timeout=timedelta(seconds=timeout))
        out = getattr(importlib.import_module(module), fn)(rank, world, *args)
    except BaseException:  # noqa: BLE001 - report anything; the parent stops the others
        results.put((rank, "error", traceback.format_exc().encode()))
        return
    results.put((rank, "ok", _dumps(out)))
    try:  # a test that provoked a hang leaves the group broken: the result is in already
        dist.barrier()
        dist.destroy_process_group()
    except RuntimeError:
        pass


def spawn(world: int, module: str, fn: str, *args: Any, env: dict | None = None,
          timeout: float = 60, bound: float = 240, backend: str = "gloo") -> list[Any]:
    """Runs module.fn(rank, world, *args) on `world` gloo ranks; returns each rank's result.

    env: environment variables set in every rank before it starts; timeout: the process
    group's timeout.

    Raises AssertionError with every rank's traceback if one fails, or if they take longer
    than `bound` seconds together."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(r, world, port, module, fn, args, env or {}, timeout, backend,
                               results))
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + bound
    try:
        while len(out) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=1)
            except queue_module.Empty:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            if status == "ok":
                out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload.decode()}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors or len(out) < world:
        raise AssertionError("\n".join(errors) or f"ranks {sorted(set(range(world)) - set(out))} "
                             f"did not finish within {bound} s")
    return [out[r] for r in range(world)]
