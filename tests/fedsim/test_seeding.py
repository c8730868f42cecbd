from fedsim.seeding import derive_seed


def test_derive_seed_is_stable_and_separates_streams() -> None:
    assert derive_seed(0, "batches", 1, 2) == derive_seed(0, "batches", 1, 2)
    seeds = {derive_seed(0, "batches", r, p) for r in range(5) for p in range(5)}
    assert len(seeds) == 25
    assert derive_seed(0, "a") != derive_seed(1, "a") != derive_seed(0, "b")
    assert 0 <= derive_seed(123, "x") < 2**63
