"""Counters, gauges and histograms for one event loop, exposed through prometheus_client.

prometheus_client's metric types take a lock on every update and search histogram buckets in
a Python loop; the proxy updates a dozen of them per request (one histogram per streamed
event), all from its one event-loop thread. These keep plain numbers, bisect for the bucket,
and build the same exposition (``_total`` counters, cumulative ``le`` buckets with ``+Inf``,
``_sum`` and ``_count``) only when scraped. Not thread-safe: update them from the loop only.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString


class _Value:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class _Buckets:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


_Child = TypeVar("_Child", _Value, _Buckets)


class _Family(Generic[_Child]):
    """One metric name; its children by label values (one unlabelled child without
    labels, whose methods the family itself forwards)."""

    kind = ""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _Child] = {}
        if not self.labelnames:
            self._only: _Child = self._new_child()
            self._children[()] = self._only
        if registry is not None:
            registry.register(self)

    def _new_child(self) -> _Child:
        raise NotImplementedError

    def labels(self, *values: str) -> _Child:
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {key}")
            child = self._children[key] = self._new_child()
        return child

    def remove(self, *values: str) -> None:
        """Drop the child of these label values (its series leaves the exposition)."""
        self._children.pop(tuple(str(v) for v in values), None)

    def describe(self) -> list[Metric]:
        return [self._family()]

    def _family(self) -> Metric:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in self._children.items():
            self._add(family, list(values), child)
        yield family

    def _add(self, family, values: list[str], child) -> None:
        family.add_metric(values, child.value)


class _Scalar(_Family[_Value]):
    def _new_child(self) -> _Value:
        return _Value()


class Counter(_Scalar):
    def inc(self, amount: float = 1.0) -> None:
        self._only.value += amount

    def _family(self) -> Metric:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)


class Gauge(_Scalar):
    def inc(self, amount: float = 1.0) -> None:
        self._only.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self._only.value -= amount

    def set(self, value: float) -> None:
        self._only.value = float(value)

    def _family(self) -> Metric:
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)


class Histogram(_Family[_Buckets]):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        bounds = tuple(sorted(float(b) for b in buckets if b != float("inf")))
        if not bounds:
            raise ValueError(f"{name}: a histogram needs at least one finite bucket")
        self.bounds = bounds
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> _Buckets:
        return _Buckets(self.bounds)

    def observe(self, amount: float) -> None:
        self._only.observe(amount)

    def _family(self) -> Metric:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _add(self, family, values: list[str], child) -> None:
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), child.counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric(values, buckets, child.sum)
