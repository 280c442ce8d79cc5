"""Run a fixed number of chunks through a real engine and its worker processes.

For tests, benchmarks and the deterministic replay harness: each stream's
chunk ``c`` uses ``source(stream, c)``, so the result can be compared with the
sequential reference fed the same observations.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import uvloop

from physis_ros.model.spec import ModelConfig
from physis_ros.runtime.engine import ChunkOutput, Engine, Observation, ServedModel
from physis_ros.runtime.planner import resolve_plan
from physis_ros.runtime.plans import Plan
from physis_ros.runtime.costs import CostProfile
from physis_ros.runtime.settings import EngineConfig
from physis_ros.timeline import ControlTimeline

Source = Callable[[str, int], dict[str, np.ndarray]]


async def run_chunks_async(model: ModelConfig, config: EngineConfig, streams: list[str], chunks: int,
                           source: Source, plan: Plan | None = None, profile: CostProfile | None = None,
                           timeline: ControlTimeline | None = None, release_interval_ms: float | None = None
                           ) -> dict[str, list[ChunkOutput]]:
    if plan is None:
        resolved = resolve_plan(model, config, profile)
        plan, profile = resolved.plan, resolved.profile
    served = ServedModel(model, config.checkpoint, profile)
    async with Engine(config) as engine:
        for s in streams:
            def observe(c: int, s: str = s) -> Observation:
                return Observation(source(s, c), engine.clock())
            await engine.add_stream(s, observe, model=served, plan=plan, chunks=chunks, keep_outputs=True,
                                    timeline=timeline, release_interval_ms=release_interval_ms)
        return {s: await engine.wait_stream(s) for s in streams}


def run_chunks(model: ModelConfig, config: EngineConfig, streams: list[str], chunks: int, source: Source,
               plan: Plan | None = None, profile: CostProfile | None = None, timeline: ControlTimeline | None = None,
               release_interval_ms: float | None = None) -> dict[str, list[ChunkOutput]]:
    return uvloop.run(run_chunks_async(model, config, streams, chunks, source, plan, profile, timeline,
                                       release_interval_ms))


