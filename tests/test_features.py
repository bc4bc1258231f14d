"""core.features.FeatureStore: each request's unread target features, newest `window` of them, in
position order, whatever mix of prefill chunks, decode steps and accepted drafts wrote them."""
import torch

from augury.core.features import FeatureStore
from augury.core.request import Request
from augury.sampling_params import SamplingParams

DIM = 6


def _req(i: int) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8))


def _feats(positions, req_tag: int) -> torch.Tensor:
    """Features whose values name their request and position."""
    return torch.tensor([[req_tag * 1000.0 + p] * DIM for p in positions])


def _advance(store: FeatureStore, req: Request, n: int, window: int, tag: int) -> None:
    store.add(req, _feats(range(req.num_computed, req.num_computed + n), tag), window)
    req.num_computed += n


def test_features_come_back_in_position_order_and_only_the_newest_window():
    store, window = FeatureStore(), 5
    a, b = _req(0), _req(1)
    _advance(store, a, 3, window, 1)  # a prefill chunk
    _advance(store, b, 9, window, 2)  # longer than the window: its first 4 are dropped
    for _ in range(2):  # decode steps of the batch, one indexed copy each
        reqs = [a, b]
        store.add_step(reqs, torch.cat([_feats([r.num_computed], t) for r, t in zip(reqs, (1, 2))]), window)
        for r in reqs:
            r.num_computed += 1
    skip, got = store.take(a)
    assert skip == 0 and torch.equal(got, _feats(range(0, 5), 1))
    skip, got = store.take(b)
    assert skip == 6 and torch.equal(got, _feats(range(6, 11), 2))
    assert (a.num_pending, a.draft_skip, b.num_pending, b.draft_skip) == (0, 0, 0, 0)
    # after a take, only what came later is held; the ring wraps around without mixing positions
    _advance(store, b, 3, window, 2)
    skip, got = store.take(b)
    assert skip == 0 and torch.equal(got, _feats(range(11, 14), 2))
    skip, got = store.take(b)  # nothing new
    assert skip == 0 and got.shape == (0, DIM)


def test_slots_are_reused_and_grow_and_a_wider_window_drops_what_was_held():
    store = FeatureStore()
    reqs = [_req(i) for i in range(6)]
    for i, r in enumerate(reqs):  # more requests than the first buffer's slots: it grows
        _advance(store, r, 2, 4, i)
    assert len({r.feat_slot for r in reqs}) == 6
    for i, r in enumerate(reqs):  # growing kept every request's features
        assert torch.equal(store.take(r)[1], _feats(range(0, 2), i))
    slot = reqs[0].feat_slot
    store.release(reqs[0])
    late = _req(9)
    _advance(store, late, 1, 4, 9)
    assert late.feat_slot == slot  # the slot given back serves the next request
    _advance(store, reqs[1], 2, 4, 1)
    _advance(store, reqs[1], 1, 8, 1)  # the window grew past the buffer's: rebuilt, older features dropped
    skip, got = store.take(reqs[1])
    assert skip == 2 and torch.equal(got, _feats([4], 1))


def test_features_arrive_in_the_buffers_dtype():
    store = FeatureStore()
    r = _req(0)
    store.add(r, torch.ones(2, DIM, dtype=torch.bfloat16), 4)
    r.num_computed += 2
    store.add(r, torch.full((1, DIM), 2.0), 4)
    r.num_computed += 1
    _, got = store.take(r)
    assert got.dtype == torch.bfloat16 and got[:, 0].tolist() == [1.0, 1.0, 2.0]
