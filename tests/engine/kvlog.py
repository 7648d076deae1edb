"""Our packages' log lines in an engine's log, each marked with its level and logger.

Imported at module level by driver.py and vllm_cli.py, so it runs in every process of the
engine: vLLM's engine-core and worker processes import the main module again (spawn) or
inherit its state (fork). Without a handler of our own, Python prints a warning's bare
message, and a test could not tell a connector's warning from any other line.
"""

from __future__ import annotations

import logging
import re

__all__ = ["LINE", "setup"]

# A line of ours in the log: "KVSTORE WARNING kvstore_connector.worker: ..."
LINE = re.compile(r"^KVSTORE (?P<level>[A-Z]+) (?P<logger>[\w.]+): (?P<message>.*)$")


def setup() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("KVSTORE %(levelname)s %(name)s: %(message)s"))
    for name in ("kvstore_connector", "kvstore_client", "connector"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
