"""A Prometheus endpoint's samples, as the telemetry tests read them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from resilient_rl.telemetry import scrape


def samples(url: str) -> dict[tuple[str, frozenset], float]:
    """Scrape ``url`` and index every sample by (name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(scrape(url)) for s in fam.samples}


def value(data: dict, name: str, **labels: str) -> float | None:
    return data.get((name, frozenset(labels.items())))


def names(data: dict) -> set[str]:
    return {name for name, _ in data}
