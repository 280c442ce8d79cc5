"""A stage that raises, over and over (a poisoned model, a bad batch): the first failure is logged with
its traceback, a storm of them is held back (physis_ros.logs.Throttle), and every one is still reported."""

import logging

from physis_ros.runtime import protocol as p
from physis_ros.runtime import tasks as tasks_module

from test_worker import EngineEnd, make_worker, task


def test_a_storm_of_failing_stages_logs_the_first_with_its_traceback_and_holds_back_the_rest(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(tasks_module, "run_stage", broken)
    end = EngineEnd()
    worker = make_worker(end)
    try:
        with caplog.at_level(logging.ERROR, logger="physis.worker"):
            for c in range(30):
                worker.tasks.accept_task(task(chunk=c))
                worker.tasks.run_next()
        failed = [r for r in caplog.records if "failed" in r.getMessage() and r.levelno == logging.ERROR]
        assert len(failed) == 1, [r.getMessage() for r in failed]
        assert failed[0].exc_info is not None and "illegal memory access" in failed[0].getMessage()
        assert worker.stats.errors == 30
        lost = [m for m in end.received() if isinstance(m, p.TaskLost)]
        assert len(lost) == 30 and {m.reason for m in lost} == {"task_failed"}   # each one reported all the same
    finally:
        worker.close()
        end.close()
