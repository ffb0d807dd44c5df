"""Reading Prometheus text (an engine's ``/metrics``) into something a program can query."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

#: vLLM's counter of prompt tokens by where they came from, and its labels for those loaded
#: by a KV connector (the decode side of a split), found in the engine's own prefix cache,
#: and computed.
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
EXTERNAL_KV = {"source": "external_kv_transfer"}
LOCAL_CACHE_HIT = {"source": "local_cache_hit"}
LOCAL_COMPUTE = {"source": "local_compute"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass(frozen=True)
class Metrics:
    """The samples of one scrape."""

    samples: tuple[Sample, ...]

    def total(self, name: str, **labels: str) -> float:
        """Sum of samples named ``name`` whose labels include every ``labels`` pair."""
        want = labels.items()
        return sum(
            s.value for s in self.samples if s.name == name and want <= dict(s.labels).items()
        )

    def by_label(self, name: str, *labels: str) -> dict[str, float]:
        """Sums of samples named ``name`` by the values of their ``labels`` (joined with
        '/'); samples lacking one of them are left out."""
        out: dict[str, float] = {}
        for s in self.samples:
            if s.name == name:
                have = dict(s.labels)
                if all(label in have for label in labels):
                    key = "/".join(have[label] for label in labels)
                    out[key] = out.get(key, 0.0) + s.value
        return out

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


def parse_metrics(text: str) -> Metrics:
    """Parse Prometheus exposition text; counters keep their ``_total`` sample names."""
    samples = [
        Sample(s.name, tuple(sorted(s.labels.items())), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]
    return Metrics(tuple(samples))
