"""Domain streams (TTA settings, segments, seeding) and task streams (continual-learning builders)."""

from __future__ import annotations

import numpy as np
import pytest

from envs.corruptions import corrupt
from envs.datasets import ArrayDataset, load_mnist
from envs.streams import (
    MIXED,
    SETTINGS,
    DomainStream,
    DomainStreamConfig,
    StreamBatch,
    Task,
    TaskStream,
    corrupted_tasks,
    digits01,
    gradual_severities,
    mnist01,
    mnist_normalise,
    permute_pixels,
    permuted,
    split_classes,
)
from fedsim.errors import ConfigError

DOMAINS = ["gaussian_noise", "contrast", "fog", "pixelate", "shot_noise"]


@pytest.fixture(scope="module")
def pool() -> tuple[np.ndarray, np.ndarray]:
    return digits01()


def _stream(pool, setting="continual", seed=0, cycles=2, n=90, bs=32, severity=5, **kw) -> DomainStream:
    cfg = DomainStreamConfig(DOMAINS, cycles=cycles, severity=severity, batch_size=bs, setting=setting,
                             images_per_domain=n)
    return DomainStream(*pool, cfg, seed=seed, **kw)


def _cat(batches: list[StreamBatch]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.concatenate([b.x for b in batches]), np.concatenate([b.y for b in batches]),
            np.concatenate([b.index for b in batches]))


def _by_index(batches: list[StreamBatch]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x, y, idx = _cat(batches)
    o = np.argsort(idx)
    return x[o], y[o], idx[o]


# ------------------------------------------------------------------------------ domain streams


@pytest.mark.parametrize("setting", SETTINGS)
def test_reproducible_from_the_seed(pool, setting: str) -> None:
    a, b = list(_stream(pool, setting, seed=4, cycles=1)), list(_stream(pool, setting, seed=4, cycles=1))
    assert len(a) == len(b)
    for p, q in zip(a, b):
        np.testing.assert_array_equal(p.x, q.x)
        np.testing.assert_array_equal(p.y, q.y)
        for attr in ("domain", "domain_index", "cycle", "severity", "segment", "reset"):
            assert getattr(p, attr) == getattr(q, attr)
    c = list(_stream(pool, setting, seed=5, cycles=1))
    assert not np.array_equal(_cat(a)[0], _cat(c)[0])


def test_segment_k_is_the_kth_slice_of_the_whole_stream(pool) -> None:
    for setting in SETTINGS:
        s = _stream(pool, setting, cycles=2, n=40, bs=16, severity=2)
        whole = list(s)
        assert len(whole) == s.num_batches == len(s)
        per = s.batches_per_segment
        for k in range(s.num_segments):
            seg = s.segment(k)
            assert len(seg) == per and all(b.segment == k for b in seg)
            for p, q in zip(seg, whole[k * per:(k + 1) * per]):
                np.testing.assert_array_equal(p.x, q.x)
                np.testing.assert_array_equal(p.index, q.index)


def test_batches_labels_and_indices_line_up(pool) -> None:
    images, labels = pool
    s = _stream(pool, "continual", n=100, bs=32)
    for k in range(s.num_segments):
        seg = s.segment(k)
        assert [len(b.y) for b in seg] == [32, 32, 32, 4]
        x, y, idx = _cat(seg)
        assert sorted(idx) == sorted(s.rows) and len(set(idx)) == len(idx)  # a permutation of the pool
        np.testing.assert_array_equal(y, labels[idx])
        assert x.dtype == np.float32 and y.dtype == np.int64
        if seg[0].domain == "contrast":  # deterministic per image: the rows line up with the images
            np.testing.assert_allclose(x, corrupt(images[idx], "contrast", 5, np.random.default_rng(0)), atol=1e-6)


def test_image_order_is_shuffled_per_block(pool) -> None:
    s = _stream(pool, "continual", n=90)
    orders = [_cat(s.segment(k))[2] for k in range(s.num_segments)]
    assert len({tuple(o) for o in orders}) == len(orders)


def test_noise_is_redrawn_every_cycle(pool) -> None:
    s = _stream(pool, "continual", cycles=3)
    d = len(DOMAINS)
    k = s.domain_order.index("gaussian_noise")
    blocks = [_by_index(s.segment(k + c * d)) for c in range(3)]
    assert all(s.describe(k + c * d) == (c, "gaussian_noise", 5) for c in range(3))
    for (x0, y0, i0), (x1, y1, i1) in zip(blocks, blocks[1:]):
        np.testing.assert_array_equal(i0, i1)
        np.testing.assert_array_equal(y0, y1)  # same images and labels ...
        assert np.abs(x0 - x1).mean() > 0.01  # ... different noise


def test_order_seed_permutes_domains_fixed_across_cycles(pool) -> None:
    plain = _stream(pool, cycles=2)
    assert plain.domain_order == DOMAINS
    orders = {tuple(_stream(pool, cycles=2, order_seed=o).domain_order) for o in range(8)}
    assert len(orders) > 1 and all(sorted(o) == sorted(DOMAINS) for o in orders)
    s = _stream(pool, cycles=3, order_seed=3)
    assert s.domain_order != DOMAINS
    d = len(DOMAINS)
    names = [s.describe(k)[1] for k in range(s.num_segments)]
    assert names[:d] == names[d:2 * d] == names[2 * d:] == s.domain_order
    for k in range(s.num_segments):
        b = s.segment(k)[0]
        assert b.domain == names[k] and DOMAINS[b.domain_index] == b.domain
        assert (b.sample_domain == b.domain_index).all()
    # the same domain block has the same content whatever the order
    k_plain, k_perm = DOMAINS.index("fog"), s.domain_order.index("fog")
    np.testing.assert_array_equal(_by_index(plain.segment(k_plain))[0], _by_index(s.segment(k_perm))[0])


def test_reset_flags(pool) -> None:
    for setting in SETTINGS:
        s = _stream(pool, setting, n=70, bs=32, severity=3)
        flags = [[b.reset for b in s.segment(k)] for k in range(s.num_segments)]
        if setting == "reset_each_shift":
            assert all(f == [True, False, False] for f in flags)
        else:
            assert not any(any(f) for f in flags)


def test_gradual_schedule(pool) -> None:
    assert gradual_severities(5) == (1, 2, 3, 4, 5, 4, 3, 2, 1)  # the benchmark's schedule
    assert gradual_severities(3) == (1, 2, 3, 2, 1) and gradual_severities(1) == (1,)
    s = _stream(pool, "gradual", cycles=2, n=40, order_seed=1)
    assert s.num_segments == 2 * len(DOMAINS) * 9
    got = [s.describe(k) for k in range(s.num_segments)]
    want = [(c, d, sev) for c in range(2) for d in s.domain_order for sev in (1, 2, 3, 4, 5, 4, 3, 2, 1)]
    assert got == want
    for k in (0, 4, 13):
        assert all(b.severity == want[k][2] and b.domain == want[k][1] for b in s.segment(k))
    # the ramp is real: distortion peaks in the middle of a domain
    clean = pool[0][s.rows]
    dist = []
    for k in range(9):
        x, _, idx = _by_index(s.segment(k))
        dist.append(np.abs(x - clean[np.searchsorted(s.rows, idx)]).mean())
    assert dist[4] == max(dist) and dist[0] < dist[2] < dist[4] and dist[8] < dist[6] < dist[4]


def test_mixed_has_every_domain_image_pair_once_per_cycle(pool) -> None:
    s = _stream(pool, "mixed", cycles=2, n=60, bs=25, order_seed=2)
    d = len(DOMAINS)
    assert s.num_segments == 2 * d
    for cycle in range(2):
        segs = [s.segment(cycle * d + p) for p in range(d)]
        pairs = [(int(dom), int(i)) for seg in segs for b in seg for dom, i in zip(b.sample_domain, b.index)]
        assert len(pairs) == len(set(pairs)) == 60 * d  # each (domain, image) exactly once
        assert {p[0] for p in pairs} == set(range(d))
        for seg in segs:
            assert sum(len(b.y) for b in seg) == 60
            assert all(b.domain == MIXED and b.domain_index == -1 and b.cycle == cycle for b in seg)
            assert len(set(np.concatenate([b.sample_domain for b in seg]))) > 1  # really mixed
        assert s.describe(cycle * d) == (cycle, MIXED, 5)
    # per-sample domains are right: contrast images equal the deterministic contrast of their row
    images = pool[0]
    for b in s.segment(0):
        sel = b.sample_domain == DOMAINS.index("contrast")
        np.testing.assert_allclose(b.x[sel], corrupt(images[b.index[sel]], "contrast", 5, np.random.default_rng(0)),
                                   atol=1e-6)


def test_indices_and_images_per_domain(pool) -> None:
    rows = np.arange(100, 400)
    s = _stream(pool, n=50, indices=rows)
    assert s.pool_size == 50 and set(s.rows) <= set(rows)
    for k in range(s.num_segments):  # the same fixed subset in every block
        assert set(_cat(s.segment(k))[2]) == set(s.rows)
    full = DomainStream(*pool, DomainStreamConfig(["fog"], cycles=1, batch_size=64), seed=0, indices=rows)
    assert full.pool_size == 300 and sorted(_cat(full.segment(0))[2]) == list(rows)


def test_mnist_normalise_matches_load_mnist() -> None:
    x, y = mnist01()
    assert x.shape == (5000, 1, 28, 28) and x.dtype == np.float32 and x.min() == 0.0 and x.max() == 1.0
    ds = load_mnist(None, 0)
    np.testing.assert_array_equal(mnist_normalise(x), ds.x)
    np.testing.assert_array_equal(y, ds.y)
    cfg = DomainStreamConfig(["none", "fog"], cycles=1, batch_size=100)
    s = DomainStream(x, y, cfg, seed=0, indices=np.arange(300), normalise=mnist_normalise)
    b = s.segment(0)[0]
    np.testing.assert_array_equal(b.x, ds.x[b.index])  # the clean domain is the standardised MNIST


def test_digits01() -> None:
    x, y = digits01()
    assert x.shape == (1797, 1, 8, 8) and x.dtype == np.float32 and 0 <= x.min() and x.max() <= 1
    assert y.dtype == np.int64 and set(y) == set(range(10))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"domains": ["fog", "frost"]}, "unknown corruption 'frost'"),
        ({"domains": []}, "domains is empty"),
        ({"domains": "fog"}, "must be a list"),
        ({"domains": ["fog", "fog"]}, "more than once"),
        ({"setting": "mixed_domains"}, "setting 'mixed_domains' is unknown; choose one of: continual"),
        ({"severity": 0}, "severity must be one of"),
        ({"severity": 6}, "severity must be one of"),
        ({"cycles": 0}, "cycles must be an integer >= 1"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"images_per_domain": 0}, "images_per_domain must be an integer >= 1"),
    ],
)
def test_bad_config_is_a_config_error(kwargs: dict, match: str) -> None:
    args = {"domains": ["fog"], "cycles": 1, **kwargs}
    with pytest.raises(ConfigError, match=match):
        DomainStreamConfig(**args)


def test_bad_stream_arguments_are_config_errors(pool) -> None:
    images, labels = pool
    cfg = DomainStreamConfig(["fog"], cycles=2)
    with pytest.raises(ConfigError, match="exceeds the pool"):
        DomainStream(images, labels, DomainStreamConfig(["fog"], images_per_domain=5000), seed=0)
    with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
        DomainStream(mnist_normalise(images), labels, cfg, seed=0)
    with pytest.raises(ConfigError, match="shape"):
        DomainStream(images[:, 0], labels, cfg, seed=0)
    with pytest.raises(ConfigError, match="one label per image"):
        DomainStream(images, labels[:-1], cfg, seed=0)
    with pytest.raises(ConfigError, match="distinct rows"):
        DomainStream(images, labels, cfg, seed=0, indices=[1, 1, 2])
    with pytest.raises(ConfigError, match="distinct rows"):
        DomainStream(images, labels, cfg, seed=0, indices=[len(images)])
    s = DomainStream(images, labels, cfg, seed=0)
    with pytest.raises(ConfigError, match="out of range: the stream has 2 segments"):
        s.segment(2)
    with pytest.raises(ConfigError, match="out of range"):
        s.describe(-1)


# -------------------------------------------------------------------------------- task streams


@pytest.fixture(scope="module")
def digits_ds(pool) -> ArrayDataset:
    return ArrayDataset(pool[0], pool[1], 10, "digits")


def test_split_classes_disjoint_and_sized(digits_ds: ArrayDataset) -> None:
    groups = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    ts = split_classes(digits_ds, groups, test_fraction=0.25, seed=1)
    assert len(ts) == 5 and ts.names[0] == "digits-classes-0-1" and ts[1] is ts.by_name("digits-classes-2-3")
    seen_train, seen_test = [], []
    for task, g in zip(ts, groups):
        assert set(task.train.y) == set(task.test.y) == set(g) and task.train.num_classes == 10
        tr, te = task.info["train_rows"], task.info["test_rows"]
        assert not set(tr) & set(te)
        np.testing.assert_array_equal(task.train.x, digits_ds.x[tr])
        np.testing.assert_array_equal(task.test.y, digits_ds.y[te])
        assert len(te) / (len(tr) + len(te)) == pytest.approx(0.25, abs=0.01)
        seen_train += list(tr)
        seen_test += list(te)
    assert sorted(seen_train + seen_test) == list(range(len(digits_ds)))  # a partition of the dataset
    again = split_classes(digits_ds, groups, test_fraction=0.25, seed=1)
    np.testing.assert_array_equal(again[2].info["test_rows"], ts[2].info["test_rows"])
    other = split_classes(digits_ds, groups, test_fraction=0.25, seed=2)
    assert not np.array_equal(other[2].info["test_rows"], ts[2].info["test_rows"])


def test_split_classes_relabel(digits_ds: ArrayDataset) -> None:
    ts = split_classes(digits_ds, [[7, 2, 9], [0]], seed=0, relabel=True)
    t = ts[0]
    assert t.train.num_classes == 3 and set(t.train.y) == {0, 1, 2}
    np.testing.assert_array_equal(np.array([7, 2, 9])[t.train.y], digits_ds.y[t.info["train_rows"]])
    assert ts[1].train.num_classes == 1 and set(ts[1].test.y) == {0}


def test_split_classes_bad_groups(digits_ds: ArrayDataset) -> None:
    with pytest.raises(ConfigError, match="disjoint"):
        split_classes(digits_ds, [[0, 1], [1, 2]])
    with pytest.raises(ConfigError, match=r"outside \[0, 10\)"):
        split_classes(digits_ds, [[0, 10]])
    with pytest.raises(ConfigError, match="non-empty"):
        split_classes(digits_ds, [[0], []])
    with pytest.raises(ConfigError, match="test_fraction"):
        split_classes(digits_ds, [[0]], test_fraction=0.0)


def test_permuted_tasks(digits_ds: ArrayDataset) -> None:
    ts = permuted(digits_ds, 3, seed=0)
    assert ts.names == ["digits-perm0", "digits-perm1", "digits-perm2"]
    perms = [t.info["permutation"] for t in ts]
    assert all(sorted(p) == list(range(64)) for p in perms)
    assert len({tuple(p) for p in perms}) == 3 and list(perms[0]) != list(range(64))
    rows = ts[0].info["train_rows"]
    for t in ts:
        np.testing.assert_array_equal(t.info["train_rows"], rows)  # same images, same split
        np.testing.assert_array_equal(t.train.y, digits_ds.y[rows])
        back = permute_pixels(t.train.x, t.info["inverse"])  # invertible
        np.testing.assert_array_equal(back, digits_ds.x[rows])
    again = permuted(digits_ds, 3, seed=0)
    assert all(np.array_equal(a.info["permutation"], b.info["permutation"]) for a, b in zip(ts, again))
    first = permuted(digits_ds, 2, seed=0, identity_first=True)
    np.testing.assert_array_equal(first[0].test.x, digits_ds.x[first[0].info["test_rows"]])


def test_permute_pixels_keeps_channels_together() -> None:
    x = np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2)
    p = np.array([3, 0, 2, 1])
    y = permute_pixels(x, p)
    np.testing.assert_array_equal(y.reshape(2, 3, 4), x.reshape(2, 3, 4)[:, :, p])
    np.testing.assert_array_equal(permute_pixels(y, np.argsort(p)), x)


def test_corrupted_tasks(digits_ds: ArrayDataset) -> None:
    ts = corrupted_tasks(digits_ds, ["none", "gaussian_noise", "contrast"], severity=4, seed=0)
    assert ts.names == ["none", "gaussian_noise", "contrast"]
    clean, noisy = ts[0], ts[1]
    np.testing.assert_array_equal(clean.train.x, digits_ds.x[clean.info["train_rows"]])
    np.testing.assert_array_equal(noisy.train.y, clean.train.y)
    assert 0.01 < np.abs(noisy.train.x - clean.train.x).mean() and noisy.info["severity"] == 4
    assert all(0 <= t.train.x.min() and t.train.x.max() <= 1 for t in ts)
    norm = corrupted_tasks(digits_ds, ["none"], seed=0, normalise=lambda v: v * 2 - 1)
    np.testing.assert_allclose(norm[0].test.x, clean.test.x * 2 - 1)
    with pytest.raises(ConfigError, match="unknown corruption"):
        corrupted_tasks(digits_ds, ["snowstorm"])
    with pytest.raises(ConfigError, match="non-empty list"):
        corrupted_tasks(digits_ds, "fog")


def test_task_stream_container() -> None:
    tasks = [Task("a", train={"env": "CartPole-v1", "gravity": 9.8}), Task("b", train={"env": "CartPole-v1"})]
    ts = TaskStream(tasks, "rl")
    assert len(ts) == 2 and ts.names == ["a", "b"] and ts[-1].name == "b" and ts[1].test is None
    assert isinstance(ts[:1], TaskStream) and ts[:1].names == ["a"]
    assert [t.name for t in ts] == ["a", "b"]
    with pytest.raises(ConfigError, match="repeats task names"):
        TaskStream([tasks[0], tasks[0]])
    with pytest.raises(ConfigError, match="no tasks"):
        TaskStream([])
    with pytest.raises(ConfigError, match="has no task 'c'"):
        ts.by_name("c")
