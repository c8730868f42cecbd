"""Continual reinforcement learning: PPO (CleanRL style), CKA-RL and its baselines on gymnasium task streams.

* :mod:`clients.rl.ppo` -- PPO's pieces (rollouts, GAE, the clipped loss, one iteration's update);
* :mod:`clients.rl.agent` -- the actor-critic layout and the continual-method contract;
* :mod:`clients.rl.ckarl` -- CKA-RL (knowledge-vector pool, mixing, Adaptive Knowledge Merging);
* :mod:`clients.rl.baselines` -- from scratch, FT-1, FT-N;
* :mod:`clients.rl.config` -- the run's typed settings; :mod:`clients.rl.node` -- a node's round,
  the server's step, the centralised loop and the cached from-scratch reference;
* :mod:`clients.rl.evaluation`, :mod:`clients.rl.report` -- evaluation, metrics and plots.

The fedsim learner is :mod:`clients.rl_learner` (``client.learner: ckarl``), its strategy
:mod:`strategies.ckarl`.
"""
