"""The e2e bench's hit-path verdicts (bench/e2e_bench.py hit_checks) on given figures."""
from kvstore_bench.e2e_bench import hit_checks


def _record(**point) -> dict:
    base = {"preset": "1b", "tokens": 1024, "recompute_s": 0.0072, "miss_save_s": 0.0087,
            "dram_hit_s": 0.0078, "miss_save_ratio": 1.20}
    return {"device": "cuda", "ttft": [base | point]}


def test_a_miss_below_the_floor_is_judged_by_the_declined_round():
    line = hit_checks(_record(declined_floor=4096, declined_s=0.0073,
                              declined_ratio=0.99))[-1]
    assert "miss+save 1.20x without the floor, 1.01x with it ok" in line


def test_a_declined_round_slower_than_the_bound_fails():
    line = hit_checks(_record(declined_floor=4096, declined_s=0.0080,
                              declined_ratio=0.90))[-1]
    assert "1.11x with it FAIL" in line


def test_above_the_floor_the_miss_with_saves_is_judged():
    line = hit_checks(_record())[-1]
    assert line.endswith("miss+save 1.20x FAIL")


def test_off_the_gpu_nothing_is_judged():
    assert hit_checks({"device": "cpu", "ttft": []}) == []
