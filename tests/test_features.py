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


def test_a_forward_writing_the_rows_step_rows_names_equals_add_step():
    """step_rows tells a forward where each request's decode features go (the fused kernel writes
    them there); after kept_step the store holds what add_step would have, in a buffer that grows
    for a request new to it, and it names no rows before the buffer exists or for another width."""
    window = 4
    direct, copied = FeatureStore(), FeatureStore()
    assert direct.step_rows([_req(0)], DIM, window) is None  # no buffer yet: the forward returns them
    pairs = []
    for i in range(5):  # the fifth request takes a slot past the first buffer's four: it grows
        a, b = _req(i), _req(i)
        _advance(direct, a, 2 + i, window, i)
        _advance(copied, b, 2 + i, window, i)
        pairs.append((a, b))
    assert direct.step_rows([pairs[0][0]], DIM + 1, window) is None  # another width
    assert direct.step_rows([pairs[0][0]], DIM, window + 1) is None  # a wider window rebuilds first
    pairs += [(_req(i), _req(i)) for i in range(5, 9)]  # none yet: slots come with the step (the 9th grows it)
    for _ in range(6):  # past the window: the ring wraps
        reqs_a, reqs_b = [p[0] for p in pairs], [p[1] for p in pairs]
        feats = torch.cat([_feats([r.num_computed], int(r.request_id[1:])) for r in reqs_a])
        slots = direct.buf.shape[0]
        rows, index = direct.step_rows(reqs_a, DIM, window)
        assert direct.buf.shape[0] == (16 if _ == 0 else slots)
        assert rows.data_ptr() == direct.buf.data_ptr() and index.dtype == torch.int64
        rows[index] = feats  # what the forward does
        direct.kept_step(reqs_a, window)
        copied.add_step(reqs_b, feats, window)
        for a, b in pairs:
            a.num_computed += 1
            b.num_computed += 1
    for a, b in pairs:
        skip_a, got_a = direct.take(a)
        skip_b, got_b = copied.take(b)
        assert skip_a == skip_b and torch.equal(got_a, got_b) and got_a.shape[0] == window
