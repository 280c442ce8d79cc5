"""Profile measurements that feed the planner: a real worker's own overhead, the co-run loop."""

import dataclasses

from physis_ros.model import load_model_config
from physis_ros.runtime.profiler import measure_worker_overhead, pipeline_pass_ms


def small():
    return dataclasses.replace(load_model_config("tiny-wam"), blocks=2, steps=2)


def test_worker_overhead_is_what_a_real_worker_spends_beyond_the_model():
    ms = measure_worker_overhead(small(), chunks=5)
    # decode, noise, pick, trace, encode: tens of microseconds per forward on a quiet host; the bound only
    # tells overhead from a model forward counted in it (its size is bench/RESULTS.md's)
    assert 0.0 < ms < 10.0


def test_pipeline_pass_times_the_whole_model_without_the_waits():
    busy = pipeline_pass_ms(small(), seconds=0.2)
    waiting = pipeline_pass_ms(small(), seconds=0.2, wait_ms=20.0)  # 2 steps: 40 ms asleep per pass
    assert 0.0 < busy < 40.0 and 0.0 < waiting < 40.0


def test_each_timed_pass_follows_an_idle_gap_as_a_paced_worker_does(monkeypatch):
    """Stage times are measured as served: each pass over the pipeline after a sleep (back-to-back passes
    read a chunk 30-50 % cheaper than paced workers then spent on it, and admission over-filled them)."""
    from physis_ros.runtime import profiler
    passes = []
    real_run = profiler.StageBench.run

    def run(self, stage, n):
        if stage == self.order[0]:
            passes.append(slept[:])
            slept.clear()
        return real_run(self, stage, n)

    slept: list[float] = []
    monkeypatch.setattr(profiler.StageBench, "run", run)
    monkeypatch.setattr(profiler.time, "sleep", lambda s: slept.append(s))
    monkeypatch.setattr(profiler, "measure_hop", lambda *a, **k: 0.1)
    monkeypatch.setattr(profiler, "measure_worker_overhead", lambda *a, **k: 0.01)
    prof = profiler.measure_profile(small(), batch_sizes=(1, 2), repeats=1, idle_ms=25.0)
    assert len(passes) == 3 * 2 and all(p == [0.025] for p in passes)     # (repeats + 2 warm-up) x sizes
    assert set(prof.stage_ms) == set(profiler.StageBench(small()).order)
