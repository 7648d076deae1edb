"""Prometheus's own checker on our files: the config, the alert rules (and that they fire
when they should, with promtool's rule unit tests), and every dashboard query's syntax.
promtool comes with Debian's `prometheus` package; without it these skip."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from .deployfiles import DEPLOY, load_yaml_docs, yaml_module

ALERTS = DEPLOY / "prometheus/alerts.yml"


def _promtool(*args: str) -> str:
    tool = shutil.which("promtool")
    if not tool:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    out = subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_prometheus_config_and_rules_check(tmp_path):
    # The config names the rule file by its path in the compose container: map it back
    # through compose's own volume list.
    compose = load_yaml_docs(DEPLOY / "compose/compose.yaml")[0]
    mounts = {v.split(":")[1]: (DEPLOY / "compose" / v.split(":")[0]).resolve()
              for v in compose["services"]["prometheus"]["volumes"] if v.startswith(".")}
    config = load_yaml_docs(DEPLOY / "prometheus/prometheus.yml")[0]
    config["rule_files"] = [str(mounts[f]) for f in config["rule_files"]]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml_module().safe_dump(config))
    assert "SUCCESS" in _promtool("check", "config", str(path))


def test_dashboard_queries_are_valid_promql(tmp_path):
    dash = json.loads((DEPLOY / "grafana/kvstore.json").read_text())
    rules = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            # What Grafana sends once it has replaced its variables.
            expr = (t["expr"].replace("$__rate_interval", "1m").replace("$__range", "1h")
                    .replace("$instance", ".*"))
            rules.append({"record": f"dashboard:panel_{p['id']}_{t['refId']}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml_module().safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in _promtool("check", "rules", str(path))


def test_alerts_fire_when_they_should(tmp_path):
    """promtool's rule unit tests on synthetic series (their names are the ones
    test_metrics_queried finds in a live scrape)."""
    node = {"job": "kvstore", "instance": "node-1:9465"}
    sel = 'job="kvstore",instance="node-1:9465"'

    def alert(severity, summary, **extra):
        return {"exp_labels": {**node, "severity": severity, **extra},
                "exp_annotations": {"summary": summary.format(**node)}}

    cases = {
        "interval": "1m",
        "input_series": [
            {"series": f"up{{{sel}}}", "values": "1 0 0 0 0"},
            {"series": f"kvstore_disk_failed{{{sel}}}", "values": "0 1 1 1"},
            # A minute: 10 OK, 5 NOT_FOUND (misses: calls, not failures), 1 INTERNAL: 6%
            # of all calls fail.
            {"series": f'kvstore_rpc_total{{{sel},method="Get",code="OK"}}',
             "values": "0+10x12"},
            {"series": f'kvstore_rpc_total{{{sel},method="Get",code="INTERNAL"}}',
             "values": "0+1x12"},
            {"series": f'kvstore_rpc_total{{{sel},method="Get",code="NOT_FOUND"}}',
             "values": "0+5x12"},
        ],
        "alert_rule_test": [
            {"eval_time": "1m", "alertname": "KVStoreDown", "exp_alerts": []},
            {"eval_time": "4m", "alertname": "KVStoreDown", "exp_alerts": [
                {**alert("critical", "kvstore {instance} is not answering scrapes"),
                 "exp_annotations": {
                     "summary": "kvstore node-1:9465 is not answering scrapes",
                     "description": "Engines on this host get no hits (never errors) "
                                    "while it is down."}}]},
            {"eval_time": "3m", "alertname": "KVStoreDiskWritesFailed", "exp_alerts": [
                alert("critical", "kvstore {instance}: disk tier writes stopped")]},
            {"eval_time": "12m", "alertname": "KVStoreRPCErrors", "exp_alerts": [
                {"exp_labels": {"instance": "node-1:9465", "severity": "warning"},
                 "exp_annotations": {"summary": "kvstore node-1:9465: over 5% of calls fail"}}]},
        ],
    }
    # NOT_FOUND alone (a cold cache) must not page anyone.
    quiet = {
        "interval": "1m",
        "input_series": [
            {"series": f'kvstore_rpc_total{{{sel},method="Get",code="OK"}}', "values": "0+1x12"},
            {"series": f'kvstore_rpc_total{{{sel},method="Get",code="NOT_FOUND"}}',
             "values": "0+100x12"},
        ],
        "alert_rule_test": [{"eval_time": "12m", "alertname": "KVStoreRPCErrors",
                             "exp_alerts": []}],
    }
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml_module().safe_dump({
        "rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": [cases, quiet]}))
    assert "SUCCESS" in _promtool("test", "rules", str(path))
