"""Training a demo policy: tiny-wam imitating the scripted expert on the synthetic scene (``physis-train``).

- :mod:`~physis_ros.train.noisy_kv`: the server's noisy-KV computation, differentiable (and a rollout
  with it that equals the sequential reference);
- :mod:`~physis_ros.train.dataset`: expert demonstrations and the chunk sequences cut from them;
- :mod:`~physis_ros.train.trainer`: the flow-matching training loop;
- :mod:`~physis_ros.train.evaluate`: tracking error against the expert, through the sequential reference.
"""
