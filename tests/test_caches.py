"""RollbackBatchKVCache: rows of a batch roll back independently (holes, no data
movement) and stay equivalent to one KVCache per row: same entries, same RoPE
offsets, same attention output, through rows leaving and joining."""

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from mtp_serve.models.caches import RollbackBatchKVCache

H, D = 2, 8


def kv(rng, n):
    return mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32)), mx.array(
        rng.standard_normal((1, H, n, D)).astype(np.float32))


def attend(q, keys, values, mask):
    return scaled_dot_product_attention(q, keys, values, cache=None, scale=D**-0.5, mask=mask)


def check_equivalent(batch: RollbackBatchKVCache, rows: list, rng):
    """Entries, offsets and attention of every row match its own KVCache."""
    assert batch.offset.tolist() == [r.offset for r in rows]
    q = mx.array(rng.standard_normal((len(rows), H, 1, D)).astype(np.float32))
    k, v = batch.keys[..., : batch._idx, :], batch.values[..., : batch._idx, :]
    out = attend(q, k, v, batch.make_mask(1)[..., :-1])  # the query's own slot is not written here
    for i, ref in enumerate(rows):
        got = batch.extract(i)
        assert got.offset == ref.offset
        assert mx.array_equal(got.keys, ref.keys[..., : ref.offset, :]).item()
        assert mx.array_equal(got.values, ref.values[..., : ref.offset, :]).item()
        want = attend(q[i : i + 1], ref.keys[..., : ref.offset, :], ref.values[..., : ref.offset, :], None)
        assert mx.allclose(out[i : i + 1], want, atol=1e-5).item()


def test_rows_roll_back_independently_through_leave_and_join():
    rng = np.random.default_rng(0)
    rows = []
    for n in (5, 9, 2):
        c = KVCache()
        c.update_and_fetch(*kv(rng, n))
        rows.append(c)
    batch = RollbackBatchKVCache.merge(rows)
    saw_holes = False
    for step in range(12):
        T = 3
        new_k, new_v = kv(rng, T)
        ks = mx.concatenate([new_k] * len(rows)) + mx.arange(len(rows)).reshape(-1, 1, 1, 1)
        vs = mx.concatenate([new_v] * len(rows)) - mx.arange(len(rows)).reshape(-1, 1, 1, 1)
        batch.update_and_fetch(ks, vs)
        rejected = [int(x) for x in rng.integers(0, T, size=len(rows))]
        for i, (r, n) in enumerate(zip(rows, rejected)):
            r.update_and_fetch(ks[i : i + 1], vs[i : i + 1])
            r.trim(n)
        batch.trim_rows(rejected)
        saw_holes |= batch.holes is not None and bool(batch.holes.any().item())
        check_equivalent(batch, rows, rng)
        if step == 4:  # row 1 leaves
            batch.filter(mx.array([0, 2]))
            rows = [rows[0], rows[2]]
            check_equivalent(batch, rows, rng)
        if step == 7:  # a newcomer joins
            c = KVCache()
            c.update_and_fetch(*kv(rng, 11))
            batch.extend(RollbackBatchKVCache.merge([c]))
            rows.append(c)
            check_equivalent(batch, rows, rng)
    assert saw_holes


def test_merge_of_empty_caches_keeps_the_rollback_class():
    batch = RollbackBatchKVCache.merge([KVCache(), KVCache()])
    assert isinstance(batch, RollbackBatchKVCache)
    batch.update_and_fetch(mx.zeros((2, H, 3, D)), mx.zeros((2, H, 3, D)))
    batch.trim_rows([0, 2])
    assert batch.offset.tolist() == [3, 1]
