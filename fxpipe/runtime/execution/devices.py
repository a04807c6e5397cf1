"""Where a stage's tensors live: host-to-device copies, the devices a stage draws random numbers
on, and timelines that measure device time on CUDA.

CUDA details follow what torch itself does: a copy from pinned host memory with
non_blocking=True is asynchronous and the caching host allocator keeps the pinned block until the
copy has run (so the host tensor may be dropped at once); a copy from pageable memory would block
the host. Timing on CUDA reads events recorded on the stream that runs the work (host clocks
would measure only how long the launches took).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import torch

from fxpipe.runtime.planning.timeline import Event, RawEvent, Timeline

__all__ = ["pin_for", "to_device", "pinned_to", "stage_devices", "WallTimeline", "CudaTimeline",
           "make_timeline"]


Pending = tuple[str, int, int, Any, Any, str]  # kind, stage, micro-batch, start, end, detail


def pin_for(tensors: Sequence[Any], device: torch.device) -> list[Any]:
    """The host tensors of a batch in pinned memory when they go to a CUDA device (once per
    step, so every micro-batch slice copies asynchronously); otherwise as they are."""
    if device.type != "cuda":
        return list(tensors)
    return [t.pin_memory() if isinstance(t, torch.Tensor) and t.device.type == "cpu"
            and not t.requires_grad and not t.is_pinned() else t for t in tensors]


def to_device(t: Any, device: torch.device) -> Any:
    """`t` on `device`; from pinned host memory without blocking the host."""
    if not isinstance(t, torch.Tensor) or t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.to(device, non_blocking=t.is_pinned())
    return t.to(device)


def pinned_to(t: Any, device: torch.device) -> Any:
    """A host tensor of a batch on `device`, through pinned memory where that is a CUDA one
    (pin_for, then to_device)."""
    return to_device(pin_for([t], device)[0], device)


def stage_devices(device: torch.device, tensors: Iterable[torch.Tensor] = ()) -> list[torch.device]:
    """The CUDA devices a stage uses: its own and those of its parameters and buffers."""
    found = {device} if device.type == "cuda" else set()
    found.update(t.device for t in tensors if t.device.type == "cuda")
    return sorted((torch.device("cuda", d.index if d.index is not None
                                else torch.cuda.current_device()) for d in found),
                  key=lambda d: d.index)


class WallTimeline(Timeline):
    """Host wall-clock spans (CPU stages), plus `mark` for a span that started earlier."""

    def mark(self, kind: str, stage: int, microbatch: int, start: float, detail: str = "") -> None:
        self.raw.append((kind, stage, microbatch, start - self.origin,
                         time.perf_counter() - self.origin, detail))

    def resolve(self) -> list[Event]:
        """The events of the step (after the step's work has finished)."""
        return self.events

    def take(self) -> Sequence[Event]:
        """The step's events, leaving the timeline to the next step without waiting for the
        device: a CUDA timeline's are read when first asked for, a wall one's made then."""
        return ReadLater(None, [], list(self.raw))


class CudaTimeline(WallTimeline):
    """Spans in device time: CUDA events on the current stream around each span, read once
    the step is done and someone asks (`take`), relative to an event recorded when the timeline
    was reset."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: list[Pending] = []
        super().__init__()
        self._start()

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch's stub
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _start(self) -> None:
        self.origin_event = self._event()

    def reset(self) -> None:
        super().reset()
        self.pending.clear()
        self._start()

    @contextlib.contextmanager
    def span(self, kind: str, stage: int, microbatch: int, detail: str = "") -> Iterator[None]:
        start = self._event()
        try:
            yield
        finally:
            self.pending.append((kind, stage, microbatch, start, self._event(), detail))

    def mark(self, kind: str, stage: int, microbatch: int, start: float, detail: str = "") -> None:
        event = self._event()
        self.pending.append((kind, stage, microbatch, event, event, detail))

    def resolve(self) -> list[Event]:
        self.raw.extend(_read(self.origin_event, self.pending))
        self.pending.clear()
        return self.events

    def take(self) -> Sequence[Event]:
        taken = ReadLater(self.origin_event, list(self.pending), list(self.raw))
        self.pending.clear()
        return taken


def _read(origin: Any, pending: Sequence[Pending]) -> list[RawEvent]:
    """Spans from their CUDA events, waiting for each to have run."""
    out = []
    for kind, stage, mb, start, end, detail in pending:
        end.synchronize()
        out.append((kind, stage, mb, origin.elapsed_time(start) / 1e3,
                    origin.elapsed_time(end) / 1e3, detail))
    return out


class ReadLater(Sequence[Event]):
    """A step's spans, made Events when first looked at: a CUDA timeline's read from their
    events then (reading waits for the device, which a step that nobody inspects need not
    do)."""

    def __init__(self, origin: Any, pending: list[Pending], read: list[RawEvent]) -> None:
        self._origin, self._pending, self._raw = origin, pending, read
        self._events: list[Event] | None = None

    def _all(self) -> list[Event]:
        if self._events is None:
            self._events = [Event(*r) for r in [*self._raw, *_read(self._origin,
                                                                     self._pending)]]
            self._raw, self._pending = [], []
        return self._events

    @overload
    def __getitem__(self, index: int) -> Event: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Event]: ...

    def __getitem__(self, index: int | slice) -> Event | Sequence[Event]:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())


def make_timeline(device: torch.device) -> WallTimeline:
    """Device time for a CUDA stage, wall time for a CPU one."""
    return CudaTimeline(device) if device.type == "cuda" else WallTimeline()
