"""Which pages a step's saves send to a store on another host (connector.worker.sending)."""

from __future__ import annotations

import numpy as np

from kvstore_connector.meta import SaveSpec
from kvstore_connector.worker.sending import Held, to_send


def _spec(req_id: str, keys: str) -> SaveSpec:
    return SaveSpec(req_id, tuple(k.encode() for k in keys),
                    np.arange(len(keys), dtype=np.int64).reshape(-1, 1))


def test_each_page_is_sent_once_and_none_the_store_holds_or_an_earlier_save_sends():
    a, b, c = _spec("a", "pqrs"), _spec("b", "pqxy"), _spec("c", "pq")
    stored = [k in "r" for k in "pqrs" + "pqxy" + "pq"]
    got = to_send([a, b, c], Held(stored, frozenset({b"y"})))
    assert [(spec.req_id, rows) for spec, rows in got] == [("a", [0, 1, 3]), ("b", [2])]


def test_nothing_to_send_when_the_store_holds_every_page():
    assert to_send([_spec("a", "pq")], Held([True, True], frozenset())) == []
