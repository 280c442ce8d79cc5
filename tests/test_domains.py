"""The tests' ROS domains (tests/domains.py): disjoint between concurrent test processes, valid for DDS."""

from domains import BLOCKS, KINDS, domain


def test_concurrent_processes_and_kinds_never_share_a_domain():
    pids = range(40_000, 40_000 + BLOCKS)            # xdist workers and parallel runs get consecutive pids
    used = [domain(kind, pid) for pid in pids for kind in KINDS]
    assert len(set(used)) == len(used)
    assert 1 <= min(used) and max(used) <= 232       # Fast DDS's port mapping ends at domain 232
