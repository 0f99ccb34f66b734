"""The sharded lookup's metadata row: the size its docstrings state is the size encode builds, and it decodes back.

No processes: the row is built and read by the functions the round uses
(``TableRequest.meta``, ``encode_row``, ``encode_message``, ``decode_tables``),
for several table counts T, world sizes N, with and without pooled tables.
"""

from __future__ import annotations

import re

import pytest
import torch

from sparsecomm.collectives import sharded_request, sharded_wire
from sparsecomm.collectives.sharded_exchange import PooledRequest, TableRequest
from sparsecomm.collectives.sharded_wire import (FINGERPRINT_LEN, InputStatus, MetaHeader, decode_headers,
                                                 decode_pooled, decode_tables, encode_message, encode_pooled,
                                                 encode_row, padded_words, pooled_words, row_width, validate)
from sparsecomm.types import WireStatus

FORMULA = re.compile(r"``(6 \+ T \* \(3N \+ 12\))``")


def stated_width(doc: str, tables: int, n: int) -> int:
    """Evaluate the row-width formula a docstring states (``6 + T * (3N + 12)``) for T tables on N ranks."""
    match = FORMULA.search(doc)
    assert match, "the docstring no longer states the metadata row's width as a formula"
    return eval(match.group(1).replace("3N", "3 * N"), {}, {"T": tables, "N": n})


def request(n: int, t: int, pooled: bool, weights: bool = False) -> TableRequest:
    """A table's request on ``n`` ranks with distinct, recognizable numbers in every field."""
    g = torch.Generator().manual_seed(17 * n + t)
    counts = torch.randint(0, 5, (n,), generator=g)
    ids = torch.arange(int(counts.sum()), dtype=torch.int64)
    fingerprint = (100 + t, 4, t, int(pooled), 0, t % 3)
    if not pooled:
        return TableRequest(ids, counts, fingerprint, 1000, 10 + t, estimates=(7 + t, 9 + t))
    occurrences = counts + torch.randint(0, 3, (n,), generator=g)
    bags = torch.minimum(occurrences, torch.randint(1, 4, (n,), generator=g))
    pr = PooledRequest(occurrences, bags, [torch.zeros(0, dtype=torch.int64)] * n, 8 if weights else 0)
    return TableRequest(ids, counts, fingerprint, 1000, 10 + t, True, None, pr, torch.float64, (3, 5))


def row_of(requests, n, capacity=0):
    send = [r.counts.tolist() for r in requests]
    header = MetaHeader(WireStatus.OK, 0, 4, capacity, len(requests), row_width(len(requests), n) + capacity)
    return header, [r.meta(c) for r, c in zip(requests, send)]


CASES = [(t, n, pooled) for t in (1, 2, 5) for n in (1, 2, 3, 8) for pooled in (False, True, "mixed")]


@pytest.mark.parametrize("tables,n,pooled", CASES)
def test_the_stated_row_width_is_what_encode_builds(tables, n, pooled):
    requests = [request(n, t, pooled is True or (pooled == "mixed" and t % 2 == 1), weights=t == 0)
                for t in range(tables)]
    header, metas = row_of(requests, n)
    row = encode_row(header, metas)
    assert len(row) == row_width(tables, n) == 6 + tables * (3 * n + 12)
    assert len(row) == stated_width(sharded_wire.__doc__, tables, n)
    assert len(row) == stated_width(sharded_request.request_rows.__doc__, tables, n)
    capacity = 3
    header, metas = row_of(requests, n, capacity)
    message = encode_message(encode_row(header, metas), torch.arange(10).repeat(n), [10] * n, n, 6)
    assert message.shape == (n, len(row) + capacity)   # the row, then the ids padded to the capacity
    assert message[:, len(row):].tolist() == [[0, 1, 2]] * n


def test_the_words_behind_the_rows_are_each_peers_first_capacity():
    """Peers' words of different lengths (none, fewer than the capacity, more): each row carries its peer's first
    ``capacity``, and the receiving side reads them back in source order."""
    n, capacity = 3, 3
    requests = [request(n, 0, False)]
    header, metas = row_of(requests, n, capacity)
    row = encode_row(header, metas)
    words = torch.tensor([11, 12, 31, 32, 33, 34, 35])   # peer 0: two words, peer 1: none, peer 2: five
    message = encode_message(row, words, [2, 0, 5], n, 6)
    assert message[:, :len(row)].tolist() == [row] * n
    assert message[:, len(row):].tolist() == [[11, 12, 0], [0, 0, 0], [31, 32, 33]]
    assert padded_words(message, 1, [2, 0, 3]).tolist() == [11, 12, 31, 32, 33]
    assert padded_words(message, 1, [0, 0, 0]).tolist() == []


@pytest.mark.parametrize("tables,n,pooled", [(2, 3, "mixed"), (1, 1, True), (3, 8, False)])
def test_a_row_decodes_to_what_was_encoded(tables, n, pooled):
    requests = [request(n, t, pooled is True or (pooled == "mixed" and t == 1)) for t in range(tables)]
    header, metas = row_of(requests, n)
    message = encode_message(encode_row(header, metas), None, [0] * n, n, 6)
    headers = decode_headers(message)
    assert headers == [header] * n
    announced = decode_tables(message, headers, tables)
    for r in range(n):
        for t, (m, req) in enumerate(zip(announced.tables[r], requests)):
            assert m.fingerprint == req.fingerprint and len(m.fingerprint) == FINGERPRINT_LEN
            assert list(m.counts) == req.counts.tolist() == announced.counts[t, r].tolist()
            assert m.num_local == req.num_local and m.present == 1 and m.estimates == tuple(req.estimates)
            assert m.path == int(req.pooled is not None)
            if req.pooled is not None:
                assert list(m.occurrences) == req.pooled.occurrences.tolist() == announced.occurrences[t, r].tolist()
                assert list(m.bags) == req.pooled.bags.tolist() == announced.bags[t, r].tolist()
            else:
                assert not announced.occurrences[t, r].any() and not announced.bags[t, r].any()


def test_validate_names_an_impossible_count():
    n = 3
    requests = [TableRequest(torch.arange(3), torch.tensor([1, 1, 1]), (30, 4, 0, 0, 0, 0), 30, 10)]
    header, metas = row_of(requests, n)
    message = encode_message(encode_row(header, metas), None, [0] * n, n, 6)
    announced = decode_tables(message, decode_headers(message), 1)
    assert validate(announced, 0, [30], [8]) is None
    message[2, 6 + 2 + FINGERPRINT_LEN + 1] = 11   # rank 2 asks rank 1 for more ids than rank 1 owns
    announced = decode_tables(message, decode_headers(message), 1)
    assert "rank 2 announced 11 ids to look up on rank 1, outside [0, 10]" in validate(announced, 0, [30], [8])


@pytest.mark.parametrize("dtype", [None, torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("occurrences,bags", [(0, 0), (1, 1), (7, 3), (8, 8)])
def test_pooled_extras_take_the_words_they_are_sized_for(dtype, occurrences, bags):
    positions = torch.arange(occurrences, dtype=torch.int32)
    lengths = torch.full((bags,), 1, dtype=torch.int32)
    weights = torch.linspace(0, 1, occurrences).to(dtype) if dtype is not None else None
    words = encode_pooled(positions, lengths, weights)
    itemsize = torch.empty(0, dtype=dtype).element_size() if dtype is not None else 0
    assert words.dtype == torch.int64 and words.numel() == pooled_words(occurrences, bags, itemsize)
    part = decode_pooled(words, occurrences, bags, dtype)
    assert torch.equal(part.positions, positions.long()) and torch.equal(part.lengths, lengths.long())
    assert (part.weights is None) == (dtype is None)
    if dtype is not None:
        assert torch.equal(part.weights, weights)


def test_input_status_uses_the_one_code_set():
    assert InputStatus().ok and InputStatus().code is WireStatus.OK
    bad = InputStatus(WireStatus.BAD_INPUT, 0, "x")
    assert not bad.ok and MetaHeader(bad.code, 0, 0, 0, 1, 6).encode()[0] == int(WireStatus.BAD_INPUT)


@pytest.mark.parametrize("scheme,owner", [("range", None), ("table", 1), ("hash", None)])
def test_ids_problem_with_a_range_owner_finds_what_the_id_by_id_check_finds(scheme, owner):
    """An owner of one range checks received ids by their min and max; every refusal still names the sender and
    the id, as the id-by-id check does (which a hash owner always takes)."""
    from sparsecomm.sharded.layout import RowLayout
    V, world = 40, 3
    for me in range(world):
        layout = RowLayout(V, world, me, scheme, owner=owner)
        span = layout.owned_range()
        assert (span is None) == (scheme == "hash")
        mine = layout.owned_ids()
        if span is not None:   # the range is what owns() says, id by id
            every = torch.arange(-2, V + 2)
            assert torch.equal(mine, torch.arange(*span))
            assert torch.equal(layout.owns(every), (every >= span[0]) & (every < span[1]))
        others = torch.tensor([i for i in range(V) if i not in set(mine.tolist())])
        cases = [mine, torch.tensor([-1]), torch.tensor([V]), others[:1], torch.cat([mine, others[:1]])]
        for ids in cases:
            if ids.numel() == 0:
                continue
            counts = [ids.numel() - 1, 1]   # the last id came from rank 1
            fast = sharded_wire.ids_problem(ids, counts, me, V, layout.owns, span)
            slow = sharded_wire.ids_problem(ids, counts, me, V, layout.owns)
            assert fast == slow, (scheme, me, ids, fast, slow)
            bad = ids[-1].item()
            if bad in set(mine.tolist()):
                assert fast is None
            else:
                assert fast is not None and f"rank 1 asked rank {me} for id {bad}" in fast
