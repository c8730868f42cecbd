"""Continual reinforcement learning: PPO (CleanRL style), CKA-RL and its baselines on gymnasium task streams.

* :mod:`algorithms.ckarl.ppo` -- PPO's pieces (rollouts, GAE, the clipped loss, one iteration's update);
* :mod:`algorithms.ckarl.agent` -- the actor-critic layout and the continual-method contract;
* :mod:`algorithms.ckarl.ckarl` -- CKA-RL (knowledge-vector pool, mixing, Adaptive Knowledge Merging);
* :mod:`algorithms.ckarl.baselines` -- from scratch, FT-1, FT-N;
* :mod:`algorithms.ckarl.config` -- the run's typed settings; :mod:`algorithms.ckarl.node` -- a node's round,
  the server's step, the centralised loop and the cached from-scratch reference;
* :mod:`algorithms.ckarl.evaluation`, :mod:`algorithms.ckarl.report` -- evaluation, metrics and plots.

The fedsim learner is :mod:`clients.rl_learner` (``client.learner: ckarl``), its strategy
:mod:`strategies.ckarl`.
"""
