"""dg serve's KV-cache sequence layout (dgcli/server/slots.py): after any series of admissions,
promotions and removals every request still finds its own cache in the sequence it owns, the
stages stay in order, and each change moves at most one request per later stage."""

from __future__ import annotations

import random

import pytest

from dgcli.server.slots import DECODING, DENOISING, PREFILLING, SlotLayout


class Request:
    def __init__(self, name):
        self.name, self.stage = name, None


class FakeCache:
    """What each sequence holds: the name of the request whose tokens are there."""

    def __init__(self, n):
        self.seqs = [None] * n
        self.moves = 0

    def move(self, src, dst):
        assert self.seqs[src] is not None, "moved an empty sequence"
        self.seqs[dst], self.seqs[src] = self.seqs[src], None
        self.moves += 1

    def clear(self, seq):
        self.seqs[seq] = None


def check(layout, cache):
    layout.check()
    for i, request in enumerate(layout.requests):
        assert cache.seqs[i] == request.name, (i, cache.seqs, [r.name for r in layout.requests])
    assert all(s is None for s in cache.seqs[len(layout):])


@pytest.mark.parametrize("seed", range(40))
def test_random_admissions_promotions_and_removals_keep_every_cache_with_its_request(seed):
    rng = random.Random(seed)
    slots = rng.randint(1, 6)
    cache = FakeCache(slots)
    layout = SlotLayout(cache.move, cache.clear)
    names = iter(range(10**6))
    for _ in range(200):
        prefilling = layout.stage(PREFILLING)
        op = rng.choice(["insert", "insert", "remove", "promote"])
        before = cache.moves
        if op == "insert" and len(layout) < slots:
            stage = rng.choice([DENOISING, DECODING] + ([] if prefilling else [PREFILLING]))
            request = Request(next(names))
            seq = layout.insert(request, stage)
            assert cache.seqs[seq] is None
            cache.seqs[seq] = request.name  # its prompt goes in
            assert cache.moves - before <= 2
        elif op == "remove" and len(layout):
            layout.remove(rng.choice(layout.requests))
            assert cache.moves - before <= 3
        elif op == "promote" and prefilling:
            layout.promote(prefilling[0], rng.choice([DENOISING, DECODING]))
            assert cache.moves == before
        check(layout, cache)


def test_the_denoising_requests_own_the_first_sequences():
    cache = FakeCache(4)
    layout = SlotLayout(cache.move, cache.clear)
    a, p, d, e = Request("a"), Request("p"), Request("d"), Request("e")
    for request, stage in ((a, DECODING), (p, PREFILLING), (d, DENOISING)):
        cache.seqs[layout.insert(request, stage)] = request.name
    assert [r.name for r in layout.requests] == ["d", "p", "a"]
    layout.promote(p, DENOISING)
    cache.seqs[layout.insert(e, DENOISING)] = "e"
    assert [r.name for r in layout.requests] == ["d", "p", "e", "a"]
    check(layout, cache)
