"""SIGKILLs under puts, spills and deletes with the disk tier: every restart succeeds (half of
them with a smaller --disk than the pages on disk), no page is served wrong, and no
acknowledged delete comes back. bench/kill_test.py runs it at length (30 kills)."""

import pytest

from kvstore_bench.kill_test import KillConfig, report, run


@pytest.mark.slow
def test_sigkill_rounds_restart_with_no_corrupt_page_and_no_resurrected_delete():
    result = run(KillConfig(kills=4, seed=1), log=lambda line: None)
    print(report(result))
    assert result.ok, result.errors[:5]
    assert result.restarts_ok == 4 and result.kills == 4
    assert result.deletes_checked > 0 and result.pages_checked > 0
