"""Host <-> device transfers and stage timing for one worker's device.

On CPU this is a pass-through and ``perf_counter`` timing. On CUDA, received
tensors are staged through pinned host memory and copied with
``non_blocking=True``; outgoing ones come back into pinned buffers; stage
times come from CUDA events, so they measure the kernels, not the launch, and
the host does not wait for a stage to end to learn its time: the worker asks
when the event has completed, or when the chunk leaves it (see
runtime/tasks.py, ``TaskRunner._settle``).
"""

from __future__ import annotations

import time

import torch


class DeviceIO:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def to_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if not self.cuda or t.device == self.device:  # (a hop over NCCL lands on the device already)
            return t if dtype is None else t.to(dtype=dtype)
        return t.pin_memory().to(self.device, dtype=dtype, non_blocking=True)

    def to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` in host memory (pinned, asynchronous, then one sync on CUDA)."""
        if not self.cuda:
            return tensors
        out = {}
        for k, t in tensors.items():
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out[k] = host
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def timer(self) -> StageTimer:
        return StageTimer(self)


class StageTimer:
    """``with io.timer() as t: ...`` then ``t.ms``: CUDA-event time on GPU, wall time on CPU."""

    def __init__(self, io: DeviceIO):
        self.io = io
        self._ms: float | None = None

    def __enter__(self) -> StageTimer:
        self.wall_start = time.perf_counter()
        if self.io.cuda:
            self.start_evt = torch.cuda.Event(enable_timing=True)
            self.end_evt = torch.cuda.Event(enable_timing=True)
            self.start_evt.record()
        return self

    def __exit__(self, *exc) -> None:
        if self.io.cuda:
            self.end_evt.record()  # no wait here: the kernels may still be running
        else:
            self._ms = (time.perf_counter() - self.wall_start) * 1e3
        self.wall_end = time.perf_counter()

    def done(self) -> bool:
        """Whether :attr:`ms` is known without waiting."""
        return self._ms is not None or self.end_evt.query()

    @property
    def ms(self) -> float:
        """The stage's time; on CUDA, waits for its end event if it has not completed yet."""
        if self._ms is None:
            self.end_evt.synchronize()
            self._ms = self.start_evt.elapsed_time(self.end_evt)
        return self._ms
