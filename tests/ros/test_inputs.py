"""The per-stream observation buffer: latest slot, deterministic pairing, bounded queue."""

import time

import numpy as np
from builtin_interfaces.msg import Time

from physis_ros.serving.intake import Sample, StreamInput, pair_observations, pick_joint


def sample(ns: int, value: float = 0.0) -> Sample:
    return Sample(np.full(2, value, np.float32), Time(sec=ns // 10**9, nanosec=ns % 10**9), ns)


S = 10**9


def test_latest_mode_takes_the_newest_and_reuses_it():
    now = [100.0]
    inp = StreamInput(deterministic=False, max_age_s=1.0, now=lambda: now[0])
    assert inp.take() is None
    inp.put_image(sample(99 * S, 1.0))
    assert inp.take() is None  # no joint state yet
    inp.put_joints(sample(99 * S, 2.0))
    inp.put_image(sample(int(99.5 * S), 3.0))
    t = inp.take()
    assert t.data["image"][0] == 3.0 and t.data["state"][0] == 2.0 and t.sec == 99.5
    assert inp.take().sec == 99.5  # depth-1 slot: the latest again
    now[0] = 101.0
    assert inp.take() is None  # stale camera: no chunk on an old view
    assert inp.snapshot()["used"] == 2 and inp.snapshot()["waiting_since"] is not None


def test_pick_joint_rules():
    assert pick_joint(5, [3, 5, 7], complete=False) == ("pair", 1)      # exact match wins
    assert pick_joint(5, [3, 4], complete=False) == ("wait", -1)        # an exact match may still come
    assert pick_joint(5, [3, 4, 6], complete=True) == ("pair", 1)       # latest at or before
    assert pick_joint(5, [6, 7], complete=True) == ("drop", -1)         # nothing at or before


def test_deterministic_mode_consumes_every_observation_in_order():
    inp = StreamInput(deterministic=True, queue_limit=100, pair_timeout_s=60.0)
    for i in range(5):
        inp.put_image(sample(i * S, float(i)))
    assert inp.take() is None  # images wait for their joint states
    for i in range(5):
        inp.put_joints(sample(i * S, 10.0 + i))
    got = [inp.take() for _ in range(4)]
    assert [t.data["image"][0] for t in got] == [0, 1, 2, 3]
    assert [t.data["state"][0] for t in got] == [10, 11, 12, 13]
    assert [t.sec for t in got] == [0, 1, 2, 3]
    t = inp.take()  # the last exact match is there already
    assert t.data["state"][0] == 14.0
    assert inp.take() is None


def test_deterministic_fallback_when_stamps_never_match():
    inp = StreamInput(deterministic=True, pair_timeout_s=60.0)
    inp.put_joints(sample(int(0.9 * S), 1.0))
    inp.put_image(sample(1 * S, 0.0))
    assert inp.take() is None             # a joint state stamped 1 s might still come
    inp.put_joints(sample(int(1.1 * S), 2.0))
    assert inp.take().data["state"][0] == 1.0  # a later one arrived: latest at or before


def test_deterministic_timeout_drop_and_queue_limit():
    inp = StreamInput(deterministic=True, queue_limit=3, pair_timeout_s=0.05)
    inp.put_joints(sample(5 * S, 1.0))
    inp.put_image(sample(2 * S))          # before every joint state: can never pair
    inp.put_image(sample(6 * S))
    inp.put_image(sample(7 * S))
    inp.put_image(sample(8 * S))          # over the queue limit: dropped, counted
    assert inp.snapshot()["rejected"] == {"queue_full": 1}
    assert inp.take() is None             # waiting for a joint state at 6 s
    time.sleep(0.06)                      # ... until the pairing timeout
    t = inp.take()
    assert t.sec == 6 and t.data["state"][0] == 1.0
    assert inp.snapshot()["rejected"] == {"queue_full": 1, "unpaired": 1}


def test_offline_pairing_matches_online():
    rng = np.random.default_rng(1)
    image_ns = sorted(rng.choice(np.arange(0, 100), 30, replace=False).tolist())
    joint_ns = sorted(rng.choice(np.arange(0, 100), 40, replace=False).tolist())
    offline = pair_observations([(n, n) for n in image_ns], [(n, n) for n in joint_ns])
    inp = StreamInput(deterministic=True, pair_timeout_s=60.0)
    for n in image_ns:
        inp.put_image(sample(n, float(n)))
    for n in joint_ns:
        inp.put_joints(sample(n, float(n)))
    inp.put_joints(sample(10**6, -1.0))  # a final later joint state: nothing left undecided
    online = []
    while (t := inp.take()) is not None:
        online.append((int(t.data["image"][0]), int(t.data["state"][0])))
    assert online == offline
    for img, js in offline:
        assert js <= img
        assert js == img or js == max(j for j in joint_ns if j <= img)


def test_offline_pairing_of_several_inputs_matches_online():
    """A world model's stream pairs the joint state AND the actions to each image, each on its own by
    the same rule; the offline pairing (what physis-bag check predicts) equals StreamInput's online one,
    images that cannot pair (counted ``unpaired``) included, and also when image stamps go backwards
    (the server forgets entries older than what an image used)."""
    from physis_ros.serving.intake import match_observations

    rng = np.random.default_rng(7)
    for trial in range(20):
        image_ns = rng.choice(np.arange(0, 200), 40, replace=False).tolist()
        if trial % 2 == 0:
            image_ns.sort()                       # a camera's usual order; odd trials: out of order
        joint_ns = sorted(rng.choice(np.arange(0, 200), 60, replace=False).tolist())
        action_ns = sorted(rng.choice(np.arange(20, 200), 30, replace=False).tolist())  # none before 20
        images = [(n, n) for n in image_ns]
        offline = pair_observations(images, [(n, n) for n in joint_ns], [(n, -n) for n in action_ns])
        verdicts = match_observations(images, [(n, n) for n in joint_ns], [(n, -n) for n in action_ns])
        assert [(img, *items) for img, items, _ in verdicts if items is not None] == offline

        inp = StreamInput(deterministic=True, pair_timeout_s=60.0, paired=("state", "actions"))
        for n in joint_ns:
            inp.put("state", sample(n, float(n)))
        for n in action_ns:
            inp.put("actions", sample(n, float(-n)))
        inp.put_joints(sample(10**6, 0.5))         # final later messages: nothing left undecided
        inp.put("actions", sample(10**6, 0.5))
        for n in image_ns:
            inp.put_image(sample(n, float(n)))
        online = []
        while (t := inp.take()) is not None:
            online.append((int(t.data["image"][0]), int(t.data["state"][0]), int(t.data["actions"][0])))
        assert online == offline, trial
        unpaired = sum(items is None for _, items, _ in verdicts)
        assert inp.snapshot()["rejected"].get("unpaired", 0) == unpaired
        assert unpaired > 0                       # images before the first actions cannot pair
        for img, js, act in offline:
            assert js <= img and -act <= img
        if trial % 2 == 0:                        # in stamp order: exact, else the latest at or before
            for img, js, act in offline:
                assert js == max(j for j in joint_ns if j <= img)
                assert -act == max(a for a in action_ns if a <= img)
            # which input was missing: the first in the stream's order with nothing at or before the image
            for img, items, k in verdicts:
                if items is None:
                    assert k == (0 if not any(j <= img for j in joint_ns) else 1)


def test_offline_pairing_keeps_its_image_and_joints_form():
    """pair_observations(images, joints) still gives (image, joint) pairs; with no other input every image
    stands alone (a model that takes the camera only)."""
    images, joints = [(1, "i1"), (3, "i3"), (5, "i5")], [(2, "j2"), (3, "j3")]
    assert pair_observations(images, joints) == [("i3", "j3"), ("i5", "j3")]
    assert pair_observations(images) == [("i1",), ("i3",), ("i5",)]
