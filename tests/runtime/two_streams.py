"""A real engine serving tiny-wam streams ``a`` and ``b`` (each on its own plan), for the liveness and
hop-transport tests: what each stream delivered, every stream event, and waiting on conditions."""

from __future__ import annotations

import asyncio
import time

from physis_ros.model import load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.runtime.engine import Engine, Observation, ServedModel
from physis_ros.runtime.plans import Plan, pipeline_order
from physis_ros.runtime.settings import EngineConfig

CFG = load_model_config("tiny-wam")
SCENE = SyntheticScene(CFG.observation_shapes)
ON_W0 = Plan("sequential", CFG.steps, CFG.blocks, {s: 0 for s in pipeline_order(CFG.steps, CFG.blocks)})
ON_W1 = Plan("sequential", CFG.steps, CFG.blocks, {s: 1 for s in pipeline_order(CFG.steps, CFG.blocks)})


class TwoStreams:
    """An engine with streams ``a`` and ``b`` (each on its own worker unless plans are given)."""

    def __init__(self, engine_cfg: EngineConfig, plans=(ON_W0, ON_W1), observe=None):
        self.engine = Engine(engine_cfg, on_event=self.on_event)
        self.plans = plans
        self.observe = observe or (lambda name, c: SCENE.observation(name, c))
        self.events = []
        self.got = {"a": [], "b": []}

    def on_event(self, e):
        self.events.append(e)

    async def __aenter__(self) -> TwoStreams:
        await self.engine.start()
        for name, plan in zip(("a", "b"), self.plans):
            await self.engine.add_stream(
                name, lambda c, n=name: Observation(self.observe(n, c), self.engine.clock()),
                self.got[name].append, model=ServedModel(CFG), plan=plan, slo_interval_ms=100.0)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.engine.stop()

    async def until(self, cond, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, \
                f"timed out; events: {[(e.stream, e.kind, e.cause) for e in self.events]}"
            await asyncio.sleep(0.01)

    async def more(self, n: int = 3) -> None:
        """Both streams deliver ``n`` more chunks."""
        have = {k: len(v) for k, v in self.got.items()}
        await self.until(lambda: all(len(self.got[k]) >= have[k] + n for k in self.got))

    def chunks(self, name: str) -> list[int]:
        return [o.chunk for o in self.got[name]]
