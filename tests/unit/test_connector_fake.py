"""Both halves of the connector over a fake client on an in-process store
(kvstore_testing.fakeclient): a step's lookups, loads and saves through the store's pool
as a worker on the server's host makes them, with no server process.

Checked: a hit past the engine's own prefix cache loads only the pages beyond it; pages
spanning two blocks and unaligned prompts; two requests sharing a prefix in one step; a
producer only saves and a consumer only loads; a prompt stored to its last page does not
save that page again; a lease not acted on is dropped on every early exit. The same steps
against a real server and its transports, and the failures a real server's restart
brings: tests/integration/test_connector.py.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore_connector.config import Role  # noqa: E402
from kvstore_testing.fakeclient import FakeClient  # noqa: E402
from tests.integration.test_connector import (  # noqa: E402
    BLOCK,
    NAMES,
    Engine,
    kv_value,
    prompt,
)

# No server listens here: the halves are given the fake client instead.
NOWHERE = "127.0.0.1:1"


@pytest.fixture
def client():
    with FakeClient(dram=64 << 20, lease_ttl=2.0) as c:
        yield c


def engine(client: FakeClient, **kw) -> Engine:
    return Engine(NOWHERE, client=client, **kw)


def test_local_hit_is_not_loaded_again(client):
    a = engine(client)
    tokens = prompt(80, 4)
    a.run_prompt("a", tokens)
    b = engine(client)
    local_blocks = b.alloc(32)
    for layer, name in enumerate(NAMES):        # the engine's own prefix cache: 2 blocks
        pos = torch.arange(32)
        b.caches[name][:, torch.as_tensor(local_blocks)[pos // BLOCK], pos % BLOCK] = \
            kv_value(layer, pos, torch.as_tensor(tokens[:32]))
    hit, blocks, meta, _ = b.run_prompt("b", tokens, local=32, local_blocks=local_blocks)
    assert hit == 32                           # pages 2 and 3; the 5th holds the last token
    assert meta.loads[0].block_ids.reshape(-1).tolist() == blocks[2:4]
    b.expect_kv(blocks, tokens, 80)


def test_pages_spanning_two_blocks_and_unaligned_prompts(client):
    a = engine(client, page_tokens=32)
    tokens = prompt(77, 5)                     # 2 full 32-token pages, then 13 tokens
    hit, _, meta, _ = a.run_prompt("a", tokens)
    assert meta.saves[0].block_ids.shape == (2, 2)
    b = engine(client, page_tokens=32)
    hit, blocks, meta, _ = b.run_prompt("b", tokens)
    assert hit == 64 and meta.loads[0].block_ids.shape == (2, 2)
    b.expect_kv(blocks, tokens, 77)
    # A local hit that ends inside a 32-token page is not extended (it would overwrite
    # blocks the engine shares).
    c = engine(client, page_tokens=32)
    assert c.sched.hit("c", tokens, 16) == 0


def test_two_requests_sharing_a_prefix_in_one_step(client):
    a = engine(client)
    system = prompt(64, 6)
    a.run_prompt("a", np.concatenate([system, prompt(20, 7)]))
    b = engine(client)
    t1, t2 = (np.concatenate([system, prompt(30, s)]) for s in (8, 9))
    h1, h2 = b.sched.hit("r1", t1, 0), b.sched.hit("r2", t2, 0)
    assert h1 == h2 == 64
    b1, b2 = b.alloc(len(t1)), b.alloc(len(t2))
    b.sched.allocated("r1", b1, h1)
    b.sched.allocated("r2", b2, h2)
    b.sched.scheduled("r1", t1, 64, len(t1) - 64, block_ids=b1)
    b.sched.scheduled("r2", t2, 64, len(t2) - 64, block_ids=b2)
    meta, _, errors = b.step([(b1, t1, 64, len(t1)), (b2, t2, 64, len(t2))])
    assert len(meta.loads) == 2 and not errors
    b.expect_kv(b1, t1, len(t1))
    b.expect_kv(b2, t2, len(t2))


def test_roles_producer_saves_consumer_loads(client):
    producer = engine(client, role=Role.PRODUCER)
    tokens = prompt(64, 10)
    hit, _, meta, _ = producer.run_prompt("p", tokens)
    assert hit == 0 and meta.saves
    assert producer.sched.hit("p2", tokens, 0) == 0        # a producer never loads
    consumer = engine(client, role=Role.CONSUMER)
    hit, blocks, meta, _ = consumer.run_prompt("c", tokens)
    assert hit == 48 and not meta.saves                     # a consumer never saves
    consumer.expect_kv(blocks, tokens, 64)


def test_a_prompt_stored_to_its_last_page_does_not_save_that_page_again(client):
    """A prompt that ends on a page boundary, stored whole: the hit leaves the last page
    to compute (the engine must compute the last token), and that page, which the lookup
    found stored, is not saved again: the step asks for no Reserve. One page short of
    that, the last page is saved."""
    a = engine(client)
    tokens = prompt(64, 21)
    a.run_prompt("a", tokens)
    b = engine(client)
    hit, blocks, meta, errors = b.run_prompt("b", tokens)
    assert (hit, errors, meta.saves) == (48, set(), ())
    b.expect_kv(blocks, tokens, 64)
    other = prompt(64, 22)
    a.run_prompt("a2", other[:49])                        # pages 0-2 stored
    hit, _, meta, _ = b.run_prompt("b2", other)
    assert hit == 48 and [len(spec.keys) for spec in meta.saves] == [1]
    for e in (a, b):
        e.close()


def test_a_lease_not_acted_on_is_dropped_on_every_early_exit(client):
    a = engine(client)
    tokens = prompt(64, 33)
    a.run_prompt("a", tokens)
    b = engine(client)
    assert b.sched.hit("r", tokens, 0) == 48               # leased; the engine cannot
    assert b.sched.hit("r", tokens, 48) == 0               # allocate, then asks again with
    b.sched.build()                                        # a local hit covering it all
    assert client.leases == 0
    assert b.sched.hit("r2", tokens, 0) == 48
    b.sched.allocated("r2", b.alloc(64), 0)                # allocated, loading nothing
    b.sched.build()
    assert client.leases == 0
    b.close()
