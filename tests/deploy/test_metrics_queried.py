"""Every metric and label the Grafana dashboard and the alerts query is in a live scrape.

A real server (DRAM and disk tiers) serves a little of every kind of traffic the panels
show; its /metrics is parsed and each PromQL selector is checked against it, so renaming
a metric or a label, or dropping one, fails here instead of blanking a panel.
"""

from __future__ import annotations

import json
import re
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore_client import KVStoreClient, PageLayout
from kvstore_testing.serverproc import ServerProcess, free_port

from .deployfiles import DEPLOY, load_yaml_docs
from .promql import grouping_labels, selectors

# Labels Prometheus adds to every scraped series, and its own synthetic metric `up`.
TARGET_LABELS = {"instance", "job"}
PROMETHEUS_OWN = {"up"}


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana/kvstore.json").read_text())
    out = [(f"panel {p['title']!r}", t["expr"])
           for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"])
        assert m, f"variable {var['name']}: unexpected query {var['definition']}"
        out.append((f"variable {var['name']}", f"{m.group(1)}"))
    return out


def _alert_exprs() -> list[tuple[str, str]]:
    groups = load_yaml_docs(DEPLOY / "prometheus/alerts.yml")[0]["groups"]
    return [(f"alert {r['alert']}", r["expr"]) for g in groups for r in g["rules"]]


@pytest.fixture(scope="module")
def scrape(tmp_path_factory):
    """{sample name: {label: {values}}} from a server that saw puts, gets, lookups,
    shared-memory reserve/commit/abort and acquire/release, misses and a disk tier."""
    port = free_port()
    disk = tmp_path_factory.mktemp("disk")
    with ServerProcess(dram="64MiB", disk="64MiB", disk_dir=str(disk),
                       metrics_port=port) as srv:
        layout = PageLayout(model="deploy-metrics", num_layers=2, page_tokens=4,
                            num_kv_heads=2, head_size=16)
        # gRPC and the fast path each name their calls in kvstore_rpc_*: drive both.
        for run, (shm, fast) in enumerate(((False, False), (True, False), (True, True))):
            keys = [b"deploy-key-%d-%06d" % (run, i) for i in range(8)]
            with KVStoreClient(srv.address, shared_memory=shm, data_plane=fast) as c:
                ns = c.register_layout(layout)
                c.put(ns, keys[:4], np.ones((4, ns.page_bytes), dtype=np.uint8))
                assert c.lookup(ns, keys) == 4
                c.get(ns, keys[:4])
                with pytest.raises(KeyError):
                    c.get(ns, keys[4:5])            # a miss: NOT_FOUND
                if shm:
                    with c.acquire(ns, keys[:2]):
                        pass
                    with pytest.raises(RuntimeError):
                        with c.reserve(ns, keys[6:8]):
                            raise RuntimeError("abort this reservation")
                    with c.reserve(ns, keys[4:6]) as r:
                        for view in r.views:
                            view[:] = 7
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    samples: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            labels = samples.setdefault(s.name, {})
            for k, v in s.labels.items():
                labels.setdefault(k, set()).add(v)
    return samples


def _check(where: str, expr: str, scrape: dict) -> list[str]:
    problems = []
    used_labels: set[str] = set()
    found = selectors(expr)
    if not found:
        problems.append(f"{where}: no metric found in {expr!r}")
    for sel in found:
        if sel.metric in PROMETHEUS_OWN:
            continue
        if sel.metric not in scrape:
            problems.append(f"{where}: metric {sel.metric} is not in the server's /metrics")
            continue
        labels = scrape[sel.metric]
        used_labels |= set(labels)
        for m in sel.matchers:
            if m.label in TARGET_LABELS:
                continue
            if m.label not in labels:
                problems.append(f"{where}: {sel.metric} has no label {m.label}")
            elif m.op == "=" and m.value not in labels[m.label]:
                problems.append(f"{where}: {sel.metric}{{{m.label}={m.value!r}}} never seen "
                                f"(seen: {sorted(labels[m.label])})")
            elif m.op == "=~" and re.fullmatch(r"[\w|]+", m.value):
                for alt in m.value.split("|"):
                    if alt not in labels[m.label]:
                        problems.append(f"{where}: {sel.metric}{{{m.label}={alt!r}}} never "
                                        f"seen (seen: {sorted(labels[m.label])})")
    for label in grouping_labels(expr) - TARGET_LABELS:
        if label not in used_labels:
            problems.append(f"{where}: groups by {label!r}, which no metric it reads has")
    return problems


@pytest.mark.parametrize("source", ["grafana", "alerts"])
def test_every_queried_metric_is_served(scrape, source):
    exprs = _dashboard_exprs() if source == "grafana" else _alert_exprs()
    problems = [p for where, expr in exprs for p in _check(where, expr, scrape)]
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_renamed_metric_or_label(scrape):
    # The checker itself: a wrong name, label or value must be reported.
    assert _check("t", 'rate(kvstore_hit_total[5m])', scrape)
    assert _check("t", 'sum by (tiers) (kvstore_pages)', scrape)
    assert _check("t", 'kvstore_rpc_total{method="Lookups"}', scrape)
    assert not _check("t", 'sum by (tier) (rate(kvstore_bytes_in_total[5m]))', scrape)
