"""PEFT-based meta-learning, linear setting: LoRA-ML (Block, Srinivasan, Collins, Mokhtari, Shakkottai; NeurIPS 2025).

Paper: "Provable Meta-Learning with Low-Rank Adaptations", arXiv:2410.22264 (v1 "Meta-Learning
Adaptable Foundation Models"), https://openreview.net/forum?id=QUN6uidabr.  Code read:
``github.com/jacob-block/peft-ml`` ``linear/run.py``, ``linear/learners.py``, ``linear/utilities.py``
(and ``vision/train_utils.py`` for Reptile).  The real-data / federated half (MNIST binary tasks, an
MLP with LoRA on every linear layer, personalised FL) is the ``lora_meta`` learner in
:mod:`clients.lora_meta`.

**Setting and algorithm, as the authors coded it.**  Task t: ``y = (A* + U_t* U_t*ᵀ) x + ε`` with
A* = sym(Gaussian), U_t* ∈ R^{d×k} Gaussian, x ~ N(0, I_d), ε ~ N(0, (σ²)² I) (the code draws the noise
with *standard deviation* σ² = 0.01).  N = 5,000 samples per task.

* **LoRA-ML** (retraining): ``min_{A, {U_t}} (1/T) Σ_t L_t(A + U_t U_tᵀ)`` with
  ``L_t(M) = ‖Y_t − M X_t‖² / (2N)`` — a *joint* minimisation, no inner-loop differentiation.
  From A = 0 and U_t ~ N(0, 0.1²): 3,000 outer iterations, each 10 GD steps (0.003) on every U_t,
  then one GD step (0.03) on A with the task-averaged gradient.
* **Standard retraining (SR)**: GD (0.03, 3,000 steps) on A alone over the pooled data.
* **Adaptation**: a new task ``A* + U_new* U_new*ᵀ``; fit an asymmetric LoRA ``U Vᵀ`` of rank k
  (3k when T = 2) on n′ = 100 samples, base frozen, plain GD (0.005) from an N(0, 0.1²) start shared
  by every method, 1,000–10,000 steps.
* Sweeps in the authors' script: d ∈ {5, 10, 20}, T ∈ {2, 3, 5}, N, n′ ∈ {100, 1,000, 10,000},
  k ∈ {1, 2, 3}; 5 runs each.

**Claims checked here** (:mod:`central.peft_meta.run`): after SR (and Reptile) rank-k adaptation
plateaus far above the noise floor, after LoRA-ML it reaches it; the excess risk after adaptation
scales like kd/n′ (log–log fit); LoRA-ML recovers A* (and every U_t U_tᵀ) for T ≥ 3 but not for
T = 2 (a symmetry-invariant recovery error, :func:`linear.recovery_error`).

**Deliberate deviations and reconstructed pieces**

* Losses and gradients are computed from the sufficient statistics ``X Xᵀ/N, Y Xᵀ/N, ‖Y‖²/N``
  (exactly the same numbers as the sums over samples, O(d³) per step) and the gradients are torch
  autograd (float64) instead of the authors' hand-written numpy gradients (which are those of half
  the squared error — kept: our ``L_t`` carries the ½ so the step sizes mean the same).
* The authors' SR learner reuses the LoRA-ML class, so its base gradient also contains T untrained
  random ``U_t U_tᵀ`` (std 0.1) and is summed, not averaged, over them (an effective step T × 0.03);
  we run plain GD on the pooled least-squares objective.  Both converge to the pooled optimum up
  to a bias of order 0.01·k, far below the plateau being measured.
* **Reptile is reconstructed**: the linear code has no Reptile.  Ours follows the authors' vision
  Reptile in its textbook direction: per outer step, 10 GD steps (0.03) on each task from A, then
  ``A ← A + ε · mean_t(A_t − A)`` with ε = 1, 300 outer steps (converged long before: each
  contracts the error by ~0.26).  In the linear case its fixed point is the mean of the task
  optima, i.e. the SR solution, and our runs show the two bases coincide.  (The
  authors' vision code feeds ``θ_t − θ`` to Adam as a *gradient*, i.e. steps away from the adapted
  weights, with lr 1e-5 for 5 epochs; we do not copy that.)
* The reported loss is the population excess risk ``‖A_new* − Â − UVᵀ‖_F²`` (= E_x for x ~ N(0, I))
  and the test loss ``excess + d σ⁴`` against the noise floor ``d σ⁴``; the authors plot the
  noise-free loss on the n′ fine-tuning inputs, summed over samples.
* Each (method, n′) is fine-tuned on ``draws`` (default 3) independent new-task sets and averaged;
  the fine-tuning budget is 1,000 GD steps everywhere (the authors use 1,000–10,000 by sweep).
* Claim thresholds are ours: recovery counts when the symmetry-invariant error is < 1e-6 (T ≥ 3
  reaches ~1e-8, the statistical floor; T = 2 stops at 1e-4–1e-2 depending on the draw); "reaches
  the floor" means test loss ≤ 1.1 × floor; the kd/n′ slope must be within 0.3 of 1.
* The T = 2 check adapts with rank 3k like the authors; with that rank the SR base also reaches
  the floor, so the "SR plateaus" and "LoRA-ML reaches the floor" claims are only checked for T ≥ 3.
* Data, truth and starts come from named seeded streams (``ctx.rng``), so T-sweeps share their
  common tasks (T = 2 is a prefix of T = 3), as the authors' slicing of one max-size draw does.
"""

from central.peft_meta import run  # noqa: F401  (registers the "peft_meta_linear" method)
from central.peft_meta.run import PeftMetaLinearParams, check, run_peft_meta_linear

__all__ = ["PeftMetaLinearParams", "check", "run_peft_meta_linear"]
