"""The metric selectors and grouping labels a PromQL expression uses, for checking them.

Not a PromQL parser: enough of the grammar to find every `name{label op "value"}` selector
and every `by (...)` / `on (...)` label list in the expressions of our dashboard and alerts.
A test that used a construct this cannot read would find a name it does not know and fail
loudly, never pass quietly.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["Matcher", "Selector", "grouping_labels", "selectors"]

# Words that are PromQL syntax, not metric names (functions are told apart by their "(").
_KEYWORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset", "inf", "nan",
}
# Grafana's own variables, which Grafana replaces before Prometheus sees the query.
_GRAFANA_RANGES = re.compile(r"\$__(rate_interval|interval|range)")

_TOKEN = re.compile(r"""
    (?P<grouping>\b(?:by|without|on|ignoring|group_left|group_right)\s*\((?P<labels>[^)]*)\))
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<range>\[[^\]]*\])
  | (?P<number>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)
  | (?P<name>[A-Za-z_:][\w:]*)\s*(?P<matchers>\{[^}]*\})?(?P<call>\s*\()?
""", re.VERBOSE)
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True, slots=True)
class Matcher:
    label: str
    op: str         # =, !=, =~ or !~
    value: str


@dataclasses.dataclass(frozen=True, slots=True)
class Selector:
    metric: str
    matchers: tuple[Matcher, ...]


def _tokens(expr: str):
    return _TOKEN.finditer(_GRAFANA_RANGES.sub("5m", expr))


def selectors(expr: str) -> list[Selector]:
    """Every metric selector in expr, with its label matchers."""
    out = []
    for m in _tokens(expr):
        name = m.group("name")
        if not name or m.group("call") or name in _KEYWORDS:
            continue
        matchers = tuple(Matcher(*g) for g in _MATCHER.findall(m.group("matchers") or ""))
        out.append(Selector(name, matchers))
    return out


def grouping_labels(expr: str) -> set[str]:
    """Labels named in by (...), without (...), on (...), ignoring (...), group_left (...)."""
    labels = set()
    for m in _tokens(expr):
        if m.group("grouping"):
            labels |= {x.strip() for x in m.group("labels").split(",") if x.strip()}
    return labels
