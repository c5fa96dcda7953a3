"""Prometheus text exposition (format 0.0.4), written directly: a handful of families, no registry needed.

We keep our own counters (engine/telemetry/stats.py) because /stats needs the same numbers as JSON; rendering them
as text is a few lines, where prometheus_client would add a second set of counters to keep in step.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = Mapping[str, str | int]


@dataclass
class Family:
    name: str
    kind: str  # counter | gauge | summary | untyped
    help: str
    samples: list[tuple[str, Labels, float]] = field(default_factory=list)  # (suffix, labels, value)

    def add(self, value: float, labels: Labels | None = None, suffix: str = "") -> "Family":
        self.samples.append((suffix, labels or {}, value))
        return self


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _value(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if float(x).is_integer() and abs(x) < 2**53:
        return str(int(x))
    return repr(float(x))


def render(families: Iterable[Family]) -> str:
    out: list[str] = []
    for f in families:
        out.append(f"# HELP {f.name} {_escape_help(f.help)}")
        out.append(f"# TYPE {f.name} {f.kind}")
        for suffix, labels, value in f.samples:
            lab = ""
            if labels:
                lab = "{" + ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels.items()) + "}"
            out.append(f"{f.name}{suffix}{lab} {_value(value)}")
    return "\n".join(out) + "\n"


def summary(name: str, help: str, series: Sequence[tuple[Labels, int, float]]) -> Family:
    """A summary without quantiles: (labels, count, sum) per series."""
    fam = Family(name, "summary", help)
    for labels, count, total in series:
        fam.add(count, labels, "_count")
        fam.add(total, labels, "_sum")
    return fam
