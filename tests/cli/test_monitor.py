"""The demo's per-stream window over the server's ChunkTelemetry: the summary it prints and writes."""

import math

from physis_ros.cli.monitor import SEAM_EVENTS_KEPT, StreamWindow


def test_seam_jumps_are_listed_chunk_by_chunk_with_where_the_robot_switched():
    """Was: the demo's summary gave only a seam p99, which over 100 chunks is one chunk's jump; which chunk, and
    whether it came later than its frozen rows, was lost (a 0.21-0.33 rad p99 in make demo, not traceable)."""
    w = StreamWindow()
    for c in range(10):
        jump = 0.213 if c == 7 else (math.nan if c == 0 else 0.0)
        w.add(c, 0.12 * c, 120.0, 71.0 if c == 7 else 40.0, False, delay_steps=2, seam_jump=jump,
              late_points=2 if c == 7 else 1, blended_rows=4 if c == 7 else 0)
    assert w.seam_events == 1 and w.blended_chunks == 1
    assert w.seam_event_rows == [{"chunk": 7, "seam_jump": 0.213, "delay_steps": 2, "late_points": 2,
                                  "latency_ms": 71.0, "blended_rows": 4}]   # switched at row 2 of d = 2: past the
                                                                             # frozen rows, and sent eased
    for c in range(10, 10 + 2 * SEAM_EVENTS_KEPT):
        w.add(c, 0.12 * c, 120.0, 40.0, False, seam_jump=0.05)
    # every jump is counted; the list is bounded
    assert w.seam_events == 1 + 2 * SEAM_EVENTS_KEPT and len(w.seam_event_rows) == SEAM_EVENTS_KEPT
