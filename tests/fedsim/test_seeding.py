from fedsim.seeding import derive_seed


def test_derive_seed_is_stable_and_separates_streams() -> None:
    assert derive_seed(0, "batches", 1, 2) == derive_seed(0, "batches", 1, 2)
    seeds = {derive_seed(0, "batches", r, p) for r in range(5) for p in range(5)}
    assert len(seeds) == 25
    assert derive_seed(0, "a") != derive_seed(1, "a") != derive_seed(0, "b")
    assert 0 <= derive_seed(123, "x") < 2**63


def test_primed_seeds_are_numpys_seed_sequence_word_for_word() -> None:
    """prime_seeds derives a batch of seeds in one vectorised pass: the same integers as SeedSequence,
    for roots and parts of one or several 32-bit words; a value past 2**32 is left to derive_seed."""
    import random

    import numpy as np

    from fedsim import seeding

    def reference(*parts) -> int:
        seq = np.random.SeedSequence([seeding._key(p) for p in parts])
        return int(seq.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))

    rng = random.Random(3)
    for _ in range(60):
        root = rng.choice([0, 7, 2**32 - 1, 2**32, 2**45 + 9, rng.getrandbits(64)])
        parts = [rng.choice(["batches", "torch", 0, rng.getrandbits(8), rng.getrandbits(40)]) for _ in range(rng.randint(0, 3))]
        last = [rng.choice([0, 1, 2**32 - 1, rng.getrandbits(20), 2**32 + 5]) for _ in range(12)]
        seeding.prime_seeds(root, *parts, last=last)
        for x in last:
            primed = seeding._primed.get((root, *parts, x))
            assert primed is None or primed == reference(root, *parts, x)
            assert (primed is None) == (x >= 2**32)
            assert seeding.derive_seed(root, *parts, x) == reference(root, *parts, x)


def test_the_supervised_learner_primes_every_seed_its_round_derives(monkeypatch) -> None:
    """seed_streams names every stream a training round derives, with and without DP-SGD."""
    from fedsim import config as C
    from fedsim.contracts import learner as contract
    from fedsim.engine.runtime import RunSpec, get_learner

    for overrides in ([], ["privacy.enabled=true", "privacy.epsilon=3.0"]):
        cfg = C.load_config("fedavg_digits", overrides, {"rounds": 1})
        cfg.tracking.enabled = False
        learner = get_learner(RunSpec.from_config(cfg))
        asked: list[str] = []
        original = contract.NodeContext.seed
        monkeypatch.setattr(contract.NodeContext, "seed", lambda self, stream: asked.append(stream) or original(self, stream))
        learner.train(learner.init_arrays(), contract.NodeContext(0, cfg.num_clients, 1, cfg.seed, config={"server-round": 1}))
        monkeypatch.undo()
        assert asked and set(asked) <= set(learner.seed_streams()), (overrides, asked)
