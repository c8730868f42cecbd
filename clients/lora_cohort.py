"""LoRA cohorts: a round's adapter clients trained together on one shared frozen base (issue #29, part 3).

:func:`train_lora_cohort` returns, for every ``(arrays, ctx)`` of a cohort, what
``SupervisedLearner.train(arrays, ctx)`` returns for an adapter model (``federated_keys``:
``minilm_lora``, ``hf_lora``) without DP-SGD: the trained LoRA factors and head, ``num_examples``,
``train_loss`` and ``local_steps``.  It runs the cohort's local steps with **one forward and one
backward of the frozen base per step**: the clients' batches are stacked along the batch axis, every
base layer (embeddings, attention, feed-forward, LayerNorm) runs once over all of them, and only the
layers whose weights are a client's own (every LoRA factor and the classification head: the
per-client parameters of :func:`own_keys`) are computed per client, on that client's rows, with that
client's weights.  A ``TorchFunctionMode`` (:class:`_CohortMode`) does the swapping: an ``F.linear``
whose weight is one of the model's per-client parameters runs once per client on its rows.

Why it is exact (to the float rounding of the stacked base kernels; the tests compare with the
sequential path at ``atol=1e-5``):

* the encoders treat rows independently (attention within one sequence, LayerNorm per token, mean
  pooling per row), so a client's rows get the activations they get alone;
* **dropout**: the sequential round seeds the global generator with ``ctx.seed("torch")`` and the
  backbone's dropout (0.1 in MiniLM's checkpoint) draws its masks from it.  Here each client has a
  ``torch.Generator`` with that seed, and every random op of the forward pass draws, for each client's
  rows, from that client's generator, with the shape its sequential call has: ``F.dropout`` is
  ``input * bernoulli(1 - p) / (1 - p)``, and ``scaled_dot_product_attention`` with dropout runs, on
  CPU, PyTorch's math path (one ``bernoulli`` draw of the attention weights' shape), reproduced here
  per client.  Draws come in the sequential order (every dropout site of a step in forward order,
  step after step), so every mask is the sequential mask bit for bit (tested);
* each client's batches come from ``iterate_batches`` with its own ``ctx.seed("batches")`` generator;
* the loss is the sum of the clients' mean cross-entropies, so a client's gradient is its own;
* each client has its own optimiser (:func:`clients.supervised.optimizer_for` over its own parameter
  copies: a fresh one, as the sequential round's is), ``grad_clip`` is ``clip_grad_norm_`` per client;
* afterwards the learner is left as the sequential round leaves it: the model holds the last client's
  arrays and trained weights, and the global generator the state the last client's draws left.

Under sample-level DP-SGD each client's round is the one Opacus runs for it
(:func:`privacy.dp_sgd.private_local_training`), from the same seeds (:mod:`privacy.cohort`): its Poisson
logical batches (:func:`~privacy.cohort.poisson_masks`), each split into physical batches as Opacus'
``BatchSplittingSampler`` splits it (``np.array_split`` of the ascending indices into
``ceil(m / privacy.max_physical_batch_size)`` near-equal pieces, one forward each, so each client's
dropout generator sees the sequential pieces in order), per-example gradients of the trained adapters
and head, clipped to ``privacy.max_grad_norm`` over all of them, summed, noised with the client's own
σ from its own noise stream (:func:`~privacy.cohort.noise_draws`, in the optimiser's parameter order),
divided by the expected batch size (:func:`~privacy.cohort.privatise`), then the client's optimiser
step; the budget check and the ledger metrics are :class:`privacy.facade.PrivateTrainer`'s own.  Piece
``j`` of every client's logical step is stacked in one forward.  Per-example gradients: each trained
factor a client's rows go through is an expanded per-example copy of that client's weight (a leaf
``[rows, *shape]``), so backward leaves every example's gradient of its own loss in it (Opacus' hooks
compute the same from the activations and backprops).  A logical batch that is empty runs no forward
(Opacus runs one on zero rows) and steps on noise alone.

On a GPU PyTorch's fused dropout kernels draw masks no per-client op can reproduce, so there an
adapter model's *sequential* round draws its masks through the same mode, one client at a time
(:func:`client_draws`, used by ``SupervisedLearner.train``): the masks differ from the fused kernels'
(same distribution, other draws) and a cohort is again exactly the sequential round.  On CPU the mode
draws what PyTorch draws (tested), so CPU results are unchanged.

Valid where :func:`lora_cohort_refusal` gives no reason: a ``SupervisedLearner`` keeping
:data:`LORA_KEPT_METHODS`, an adapter model whose rows are computed independently (the LoRA text
encoders are; a user's adapter model must be, which ``engine.vectorise=true`` takes on trust beyond the
refusal of batch-statistics normalisation), no ghost clipping (``privacy.grad_sample_mode=ghost``), no
FedProx term and no model transforms in the round config, no client past its privacy budget, the same
trainable factors for every client, and every client with a training example. :func:`train_lora_cohort`
also raises ``ValueError`` when the clients' shared (base) weights differ, or when a client's arrays
lack a weight it trains (the sequential round would carry the previous client's value over); the local
engine then trains the clients one by one. A random op the mode does not reproduce (causal or GQA
attention with dropout, an in-place dropout on a non-contiguous input) raises the same way.

``engine.vectorise=true`` uses it wherever it is valid; ``engine.vectorise=auto`` only where it was
measured faster (``benchmarks/bench_lora_cohort.py``): on CPU, for client steps of at most
:data:`AUTO_MAX_STEP_TOKENS` token positions.  With larger steps (FedSVD's 64 x 32) a client's matmuls
are already large and stacking them gains nothing on 2 cores; on a GPU it has not been measured.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from clients.supervised import SupervisedLearner, iterate_batches, num_local_steps, optimizer_for
from clients.vectorised import (KEPT_METHODS, PrivateRound, client_refusal, overridden_method, private_round,
                                uses_batch_statistics)
from fedsim.contracts.learner import Learner, NodeContext, StateDict, TrainResult
from fedsim.contracts.wire import PROXIMAL_MU, TRANSFORM_KEY
from fedsim.device import to_host
from privacy.cohort import privatise

#: Methods a learner must inherit unchanged from SupervisedLearner for the cohort to be its sequential round.
LORA_KEPT_METHODS = (*KEPT_METHODS, "_load", "_set_trainable", "_trainable_flags", "_client_draws")

#: The largest client step (token positions: batch x sequence length) at which ``engine.vectorise=auto``
#: trains a LoRA cohort together.  ``benchmarks/bench_lora_cohort.py`` on 2 CPU cores, MiniLM, 4 clients,
#: 2 steps, 1 thread, sequential / cohort: 1.11-1.16x at 8 x 16 positions (1.18x with 8 clients), 1.10x
#: at 16 x 16, 1.03x at 16 x 32, 1.00x at 32 x 32 and 0.89-0.96x at FedSVD's 64 x 32 (the stacked base
#: saves per-op dispatch, which only matters while a client's matmuls are small).  Under DP-SGD (``--dp``, Opacus
#: client by client against the DP cohort, 4 clients, 1 thread): 1.23x at 8 x 16, 1.10x at 16 x 16, 1.05x at
#: 16 x 32, 0.99x at 32 x 32, 0.92x at 64 x 32.
AUTO_MAX_STEP_TOKENS = 256

#: Most token positions one stacked forward holds (clients are trained in chunks within it); a chunk
#: always holds at least one client.  MiniLM keeps ~200 KB of activations per position for backward:
#: peak RSS measured 1.3 GB training one 64 x 32 client, 2.7 GB for 4 stacked (8,192 positions), 4.3 GB
#: for 8 (16,384).  Small steps, where a cohort is faster, fit 32+ clients in a chunk.
LORA_CHUNK_TOKENS = 8192


# -- validity -------------------------------------------------------------------------------------

def lora_cohort_refusal(learner: Learner, ctxs: list[NodeContext], auto: bool) -> str | None:
    """Why this cohort of adapter clients is trained one by one (None: :func:`train_lora_cohort` trains it).

    With ``auto`` (``engine.vectorise=auto``) also where the cohort was not measured faster: models other
    than the LoRA text encoders, off the CPU (not measured yet) and past :data:`AUTO_MAX_STEP_TOKENS` token
    positions per client step.
    """
    reason = _unsupported(learner, ctxs)
    if reason is not None or not auto:
        return reason
    assert isinstance(learner, SupervisedLearner)
    from fedsim.models.minilm import MiniLMLoRAClassifier

    if not isinstance(learner.model, MiniLMLoRAClassifier):
        return "only the LoRA text encoders (minilm_lora, hf_lora) were measured (engine.vectorise=true forces it)"
    if learner.device.type != "cpu":
        return f"LoRA cohorts on {learner.device.type} are not measured yet (engine.vectorise=true uses them)"
    tokens = _step_tokens(learner, ctxs)
    if tokens > AUTO_MAX_STEP_TOKENS:
        return (f"a client step of {tokens} token positions is past the {AUTO_MAX_STEP_TOKENS} up to which a LoRA "
                "cohort was measured faster (engine.vectorise=true forces it)")
    return None


def _step_tokens(learner: SupervisedLearner, ctxs: list[NodeContext], most: bool = False) -> int:
    """Token positions of the largest client step: min(batch size, examples) x sequence length.

    Under DP-SGD a forward holds one physical batch: about the batch size (capped by
    ``privacy.max_physical_batch_size``), or with ``most`` the most a Poisson batch can put in one."""
    width = int(learner.data.input_shape[0]) if learner.data.input_shape else 1
    largest = max(len(learner.data.client_train(c.partition_id, c.server_round).y) for c in ctxs)
    rows = learner.cfg.client.batch_size
    if learner.sample_level_dp:
        cap = learner.cfg.privacy.max_physical_batch_size
        rows = cap if most else min(rows, cap)
    return min(rows, max(1, largest)) * width


def _unsupported(learner: Learner, ctxs: list[NodeContext]) -> str | None:
    if len(ctxs) < 2:
        return "a cohort of one client"
    if not isinstance(learner, SupervisedLearner):
        return f"learner {type(learner).__name__} is not a SupervisedLearner"
    reason = overridden_method(learner, LORA_KEPT_METHODS)
    if reason is not None:
        return reason
    model = learner.model
    if not hasattr(model, "federated_keys"):
        return "not an adapter model (federated_keys)"
    if learner.sample_level_dp and learner.cfg.privacy.grad_sample_mode == "ghost":
        return "DP-SGD with privacy.grad_sample_mode=ghost (ghost clipping) is not built for LoRA cohorts"
    for name, m in model.named_modules():
        if uses_batch_statistics(m):
            return f"module {name!r} ({type(m).__name__}) uses batch statistics: rows are not independent"
    if any(PROXIMAL_MU in c.config for c in ctxs):
        return "the FedProx term is not built for LoRA cohorts"
    if any(c.config.get(TRANSFORM_KEY) for c in ctxs):
        return "model transforms are not built for LoRA cohorts"
    if len({learner._trainable_flags(model, c) for c in ctxs}) != 1:
        return "the clients train different LoRA factors"
    return client_refusal(learner, ctxs)


def own_keys(model: nn.Module) -> list[str]:
    """The model's per-client parameters: every LoRA factor and the head (``federated_keys`` without the base)."""
    params = dict(model.named_parameters())
    return [k for k in model.federated_keys() if k in params]  # type: ignore[operator]


# -- the forward pass with per-client weights and random draws ----------------------------------------

class _CohortMode(TorchFunctionMode):
    """Per-client ``F.linear`` for the model's own parameters; per-client random draws for dropout and
    attention dropout.  ``sizes``: each client's rows, in stacking order.

    With ``per_example`` (a dict, filled here) a client weight that requires grad enters its ``F.linear``
    as a per-example copy, a leaf ``[rows, *shape]`` recorded under ``id(weight)``: after backward its
    ``grad`` holds every row's gradient of that row's own loss (DP-SGD's per-sample gradients)."""

    def __init__(self, own: dict[int, list[torch.Tensor]], sizes: list[int] | None,
                 generators: list[torch.Generator],
                 per_example: dict[int, list[torch.Tensor]] | None = None) -> None:
        super().__init__()
        self.own, self.sizes, self.generators = own, sizes, generators  # sizes None: one client, every row
        self.rows = sum(sizes) if sizes is not None else None
        self.per_example = per_example

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            return self._linear(*args, **kwargs)
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.sizes is None:
            return (t,)
        if t.shape[0] != self.rows:
            raise ValueError(f"a per-client op got {t.shape[0]} rows for a cohort of {self.rows}")
        return t.split(self.sizes)

    def _value(self, t: torch.Tensor | None, c: int) -> torch.Tensor | None:
        values = self.own.get(id(t)) if t is not None else None
        return values[c] if values is not None else t

    def _linear(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if id(weight) not in self.own and id(bias) not in self.own:
            return F.linear(input, weight, bias)  # a shared base layer: once over every row
        return torch.cat([self._client_linear(x, self._value(weight, c), self._value(bias, c))  # type: ignore[arg-type]
                          for c, x in enumerate(self._split(input))])

    def _client_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.per_example is None or not (weight.requires_grad or (bias is not None and bias.requires_grad)):
            return F.linear(x, weight, bias)
        w, b = self._per_row(weight, len(x)), self._per_row(bias, len(x))
        out = torch.einsum("n...i,noi->n...o", x, w) if w.dim() == 3 else F.linear(x, w)
        if b is None:
            return out
        return out + (b.view(len(x), *[1] * (x.dim() - 2), -1) if b.dim() == 2 else b)

    def _per_row(self, t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
        """``t`` as a per-example leaf ``[rows, *shape]`` if it trains (recorded), else ``t``."""
        if t is None or not t.requires_grad:
            return t
        assert self.per_example is not None
        copy = t.detach().unsqueeze(0).expand(rows, *t.shape).clone().requires_grad_(True)
        self.per_example.setdefault(id(t), []).append(copy)
        return copy

    def _mask(self, like: torch.Tensor, p: float, c: int) -> torch.Tensor:
        """``at::dropout``'s scaled noise for client ``c``: ``empty_like(x).bernoulli_(1 - p) / (1 - p)``."""
        if not like.is_contiguous():
            raise ValueError("a dropout input that is not contiguous: its sequential mask layout is not reproduced")
        noise = torch.empty_like(like).bernoulli_(1 - p, generator=self.generators[c])
        return noise.div_(1 - p)

    def _dropout(self, input: torch.Tensor, p: float = 0.5, training: bool = True,
                 inplace: bool = False) -> torch.Tensor:
        if not training or p == 0 or p == 1 or input.numel() == 0:  # no draw in these cases
            return F.dropout(input, p, training, inplace)
        return torch.cat([x * self._mask(x, p, c) for c, x in enumerate(self._split(input))])

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        if dropout_p == 0:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=0.0,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if is_causal or enable_gqa:
            raise ValueError("causal or GQA attention with dropout is not reproduced per client")
        # PyTorch's math path (what SDPA runs on CPU with dropout): a boolean mask becomes 0 / -inf, q and k are
        # scaled by sqrt(scale), the softmax is _safe_softmax, then one draw of the weights' shape
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask, 0.0, torch.scalar_tensor(-math.inf, dtype=query.dtype,
                                                                       device=attn_mask.device))
        clients = len(self.generators)
        if attn_mask is not None and attn_mask.dim() > 0 and attn_mask.shape[0] == (self.rows or query.shape[0]):
            masks: tuple[torch.Tensor | None, ...] = self._split(attn_mask)
        elif attn_mask is None or attn_mask.dim() < 4 or attn_mask.shape[0] == 1:
            masks = (attn_mask,) * clients  # broadcast over the batch
        else:
            raise ValueError(f"an attention mask of batch {attn_mask.shape[0]} for a cohort of {self.rows} rows")
        factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
        out = []
        for c, (q, k, v) in enumerate(zip(self._split(query), self._split(key), self._split(value))):
            attn = (q * factor) @ (k * factor).transpose(-2, -1)
            if masks[c] is not None:
                attn = attn + masks[c]
            attn = torch._safe_softmax(attn, -1)
            out.append((attn * self._mask(attn, dropout_p, c)) @ v)
        return torch.cat(out)


#: Devices on which PyTorch's own dropout and attention-dropout kernels draw what :class:`_CohortMode` draws
#: (``bernoulli_`` of the input's shape from the seeded generator; tested).  Elsewhere (CUDA's fused kernels)
#: they do not, so there an adapter model's sequential round draws its masks through the mode as well
#: (:func:`client_draws`), and a cohort stays exactly the sequential round.
NATIVE_DRAW_DEVICES: tuple[str, ...] = ("cpu",)


def client_draws(model: nn.Module, ctx: NodeContext) -> contextlib.AbstractContextManager[Any]:
    """The random draws of one adapter client's sequential round, as a cohort draws them.

    On :data:`NATIVE_DRAW_DEVICES` nothing changes (PyTorch's kernels draw the same masks from the global
    generator the learner seeds); on other devices the round's dropout masks come from a generator seeded
    with ``ctx.seed("torch")`` through :class:`_CohortMode`, the one way a cohort can reproduce them.
    """
    device = next(model.parameters()).device
    if not hasattr(model, "federated_keys") or device.type in NATIVE_DRAW_DEVICES:
        return contextlib.nullcontext()
    return _CohortMode({}, None, [torch.Generator(device=device).manual_seed(ctx.seed("torch"))])


# -- training -------------------------------------------------------------------------------------

@dataclass
class _Client:
    x: torch.Tensor
    y: torch.Tensor
    steps: int
    batches: Iterator[torch.Tensor]
    values: dict[str, torch.Tensor]  # the client's own value of every own_keys parameter
    trained: list[str]  # the keys it trains (their values are leaf tensors requiring grad)
    generator: torch.Generator
    optimizer: torch.optim.Optimizer | None = None
    loss_sum: float = 0.0
    done: int = 0
    dp: PrivateRound | None = None  # sample-level DP-SGD: the client's Opacus round (noise in ``trained`` order)
    seen: int = 0  # DP-SGD: examples in the round's batches (Opacus' mean loss divides by it)


def _shared_arrays_equal(arrays_list: list[StateDict], own: set[str]) -> None:
    """The clients' arrays share one base: the same keys, and every non-adapter value equal."""
    first = arrays_list[0]
    for arrays in arrays_list[1:]:
        if arrays is first:
            continue
        if arrays.keys() != first.keys():  # a key sent to some clients only: the sequential load order would matter
            raise ValueError("the clients' arrays carry different keys")
        for k, v in arrays.items():
            if k not in own and v is not first[k] and not torch.equal(v, first[k]):
                raise ValueError(f"the clients' shared weight {k!r} differs: no single base to share")


def _client(learner: SupervisedLearner, arrays: StateDict, ctx: NodeContext,
            model_values: dict[str, torch.Tensor], trained: list[str]) -> _Client:
    missing = [k for k in trained if k not in arrays]
    if missing:
        raise ValueError(f"client {ctx.partition_id}'s arrays lack trained weights ({missing[0]}, ...): the "
                         "sequential round would start it from the previous client's values")
    x, y = learner._tensors(learner.data.client_train(ctx.partition_id, ctx.server_round))
    values = {}
    for k, current in model_values.items():
        v = arrays[k].to(device=current.device, dtype=current.dtype) if k in arrays else current
        values[k] = v.detach().clone().requires_grad_(k in trained)
    generator = torch.Generator(device=x.device).manual_seed(ctx.seed("torch"))
    if learner.sample_level_dp:
        dp = private_round(learner, ctx, len(y), [values[k] for k in trained])
        c = _Client(x, y, dp.plan.steps_per_round, iter(()), values, trained, generator, dp=dp)
    else:
        steps = num_local_steps(len(y), learner.cfg)
        batches = iterate_batches(len(y), learner.cfg.client.batch_size,
                                  torch.Generator().manual_seed(ctx.seed("batches")))
        c = _Client(x, y, steps, batches, values, trained, generator)
    c.optimizer = optimizer_for([values[k] for k in trained], learner.cfg)
    return c


def physical_batches(mask: torch.Tensor, max_physical: int) -> list[torch.Tensor]:
    """A logical batch's physical batches, as Opacus' ``BatchSplittingSampler`` yields them: the ascending
    indices in ``ceil(m / max_physical)`` near-equal pieces, larger first (``np.array_split``); none if empty."""
    idx = mask.nonzero().view(-1)
    if len(idx) == 0:
        return []
    return list(torch.tensor_split(idx, math.ceil(len(idx) / max_physical)))


def _train_chunk(model: nn.Module, clients: list[_Client], params: dict[str, nn.Parameter],
                 grad_clip: float | None) -> None:
    """Every local step of ``clients``, one stacked forward and backward per step."""
    while True:
        active = [c for c in clients if c.done < c.steps]
        if not active:
            return
        rows = [next(c.batches) for c in active]  # this step's batch of each client
        sizes = [len(r) for r in rows]
        own = {id(p): [c.values[k] for c in active] for k, p in params.items()}
        xb = torch.cat([c.x[r] for c, r in zip(active, rows)])
        with _CohortMode(own, sizes, [c.generator for c in active]):
            logits = model(xb)
        losses = [F.cross_entropy(part, c.y[r]) for part, c, r in zip(logits.split(sizes), active, rows)]
        torch.stack(losses).sum().backward()
        for c, loss in zip(active, losses):
            trained = [c.values[k] for k in c.trained]
            if grad_clip is not None:
                nn.utils.clip_grad_norm_(trained, grad_clip)
            assert c.optimizer is not None
            c.optimizer.step()
            c.optimizer.zero_grad(set_to_none=True)
            c.loss_sum += float(loss.detach())
            c.done += 1


def _train_chunk_private(model: nn.Module, clients: list[_Client], params: dict[str, nn.Parameter],
                         max_grad_norm: float, max_physical: int) -> None:
    """Every DP-SGD step of ``clients``: per logical step, one stacked forward and backward per physical piece,
    then each client's privatised gradient (:func:`privacy.cohort.privatise`) and optimiser step."""
    while True:
        active = [c for c in clients if c.done < c.steps]
        if not active:
            return
        pieces = [physical_batches(c.dp.masks[c.done], max_physical) for c in active]  # type: ignore[union-attr]
        samples: dict[int, dict[str, list[torch.Tensor]]] = {id(c): {k: [] for k in c.trained} for c in active}
        for j in range(max(len(p) for p in pieces)):
            part = [(c, p[j]) for c, p in zip(active, pieces) if j < len(p)]
            sizes = [len(r) for _, r in part]
            own = {id(p): [c.values[k] for c, _ in part] for k, p in params.items()}
            record: dict[int, list[torch.Tensor]] = {}
            with _CohortMode(own, sizes, [c.generator for c, _ in part], per_example=record):
                logits = model(torch.cat([c.x[r] for c, r in part]))
            losses = F.cross_entropy(logits, torch.cat([c.y[r] for c, r in part]), reduction="none")
            losses.sum().backward()
            for (c, r), loss in zip(part, losses.detach().split(sizes)):
                for k in c.trained:
                    copies = record.get(id(c.values[k]), [])
                    grads = [e.grad for e in copies if e.grad is not None]
                    samples[id(c)][k].append(torch.stack(grads).sum(0) if grads else
                                             c.values[k].new_zeros((len(r), *c.values[k].shape)))
                c.loss_sum += float(loss.sum())
                c.seen += len(r)
        for c in active:
            _private_step(c, samples[id(c)], max_grad_norm)


def _private_step(c: _Client, samples: dict[str, list[torch.Tensor]], max_grad_norm: float) -> None:
    """Client ``c``'s step from its logical batch's per-example gradients: clip, sum, noise, scale, step."""
    dp = c.dp
    assert dp is not None and c.optimizer is not None
    noise = {k: dp.noise[i][c.done] for i, k in enumerate(c.trained)}
    if samples[c.trained[0]]:
        per_sample = {k: torch.cat(samples[k]).unsqueeze(0) for k in c.trained}
        real = torch.ones(per_sample[c.trained[0]].shape[:2], dtype=torch.bool, device=noise[c.trained[0]].device)
        size = torch.tensor([dp.batch_size], device=real.device)
        grads = {k: g[0] for k, g in privatise(per_sample, real, max_grad_norm,
                                               {k: v.unsqueeze(0) for k, v in noise.items()}, size).items()}
    else:  # an empty logical batch: the noise alone, as Opacus steps on it
        grads = {k: v / dp.batch_size for k, v in noise.items()}
    for k in c.trained:
        c.values[k].grad = grads[k]
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)
    c.done += 1


def train_lora_cohort(learner: SupervisedLearner, arrays_list: list[StateDict], ctxs: list[NodeContext],
                      chunk: int) -> list[TrainResult]:
    """``[learner.train(a, c) for a, c in zip(arrays_list, ctxs)]`` for an adapter model, on one shared base
    per stacked step, in chunks of at most ``chunk`` clients (and :data:`LORA_CHUNK_TOKENS` positions)."""
    if len(arrays_list) != len(ctxs):
        raise ValueError(f"{len(arrays_list)} arrays for {len(ctxs)} clients")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    reason = lora_cohort_refusal(learner, ctxs, auto=False)
    if reason is not None:
        raise ValueError(f"cannot train this LoRA cohort together: {reason}")
    model = learner.model
    keys = own_keys(model)
    _shared_arrays_equal(arrays_list, set(keys))
    learner._load(arrays_list[0])  # the shared base (and client 0's own weights, which the mode replaces)
    learner._set_trainable(model, ctxs[0])
    params = dict(model.named_parameters())
    if any(p.requires_grad for k, p in params.items() if k not in keys):
        raise ValueError("a trainable parameter outside the adapters and the head: no single base to share")
    own_params = {k: params[k] for k in keys}
    trained = [k for k in keys if own_params[k].requires_grad]
    if not trained:
        raise ValueError("the model trains no parameter")
    current = {k: p.detach() for k, p in own_params.items()}
    model.train()
    chunk = max(1, min(chunk, LORA_CHUNK_TOKENS // _step_tokens(learner, ctxs, most=True)))
    results: list[TrainResult] = []
    last: _Client | None = None
    for start in range(0, len(ctxs), chunk):
        clients = [_client(learner, arrays_list[i], ctxs[i], current, trained)
                   for i in range(start, min(start + chunk, len(ctxs)))]
        if learner.sample_level_dp:
            _train_chunk_private(model, clients, own_params, learner.cfg.privacy.max_grad_norm,
                                 learner.cfg.privacy.max_physical_batch_size)
        else:
            _train_chunk(model, clients, own_params, learner.params.grad_clip)
        for c, ctx in zip(clients, ctxs[start:]):
            if c.dp is None:
                metrics = {"train_loss": c.loss_sum / c.steps, "local_steps": float(c.steps)}
            else:  # Opacus' mean over the examples seen, and the ledger's metrics
                metrics = {"train_loss": c.loss_sum / max(c.seen, 1), "local_steps": float(c.steps),
                           **learner.dp.end_round(ctx, c.dp.plan, c.steps)}
            arrays = {k: to_host(c.values[k].detach()) for k in model.trainable_keys()}  # type: ignore[operator]
            results.append(TrainResult(arrays, num_examples=len(c.y), metrics=metrics, owned=True))
        last = clients[-1]
    assert last is not None
    # leave the learner as the sequential round does: the last client's arrays and trained weights, and the
    # global generator where the last client's draws left it
    learner._load(arrays_list[-1])
    with torch.no_grad():
        for k in trained:
            own_params[k].copy_(last.values[k])
    if last.generator.device.type in NATIVE_DRAW_DEVICES:  # elsewhere the sequential round uses its own generator
        torch.default_generator.set_state(last.generator.get_state())
    return results
