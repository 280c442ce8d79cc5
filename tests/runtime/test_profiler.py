"""Profile measurements that feed the planner: a real worker's own overhead, the co-run loop."""

import dataclasses

from physis_ros.model import load_model_config
from physis_ros.runtime.profiler import measure_worker_overhead, pipeline_pass_ms


def small():
    return dataclasses.replace(load_model_config("tiny-wam"), blocks=2, steps=2)


def test_worker_overhead_is_what_a_real_worker_spends_beyond_the_model():
    ms = measure_worker_overhead(small(), chunks=5)
    # decode, noise, pick, trace, encode: tens of microseconds per forward, never the model's milliseconds
    assert 0.0 < ms < 2.0


def test_pipeline_pass_times_the_whole_model_without_the_waits():
    busy = pipeline_pass_ms(small(), seconds=0.2)
    waiting = pipeline_pass_ms(small(), seconds=0.2, wait_ms=20.0)  # 2 steps: 40 ms asleep per pass
    assert 0.0 < busy < 40.0 and 0.0 < waiting < 40.0
