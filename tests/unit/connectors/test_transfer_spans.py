"""The KV transfer spans of our P/D connector (``connectors/common/tracing.py``).

vLLM's real Scheduler plans both sides of requests that carry trace headers (as EngineCore
keeps them when the engine traces), real workers move the KV over the ``tcp`` backend on
127.0.0.1, and the spans land in an in-memory exporter: each a child of its own request's
``traceparent``, with the bytes moved, the peer and the outcome.
"""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.unit.connectors.sched_harness import make_request, make_scheduler, make_vllm_config, step
from tests.unit.connectors.test_worker_side import (
    BLOCK,
    HEAD,
    HEADS,
    LAYERS,
    PROMPT_HASH,
    Clock,
    caches,
    poll,
    recv,
    worker,
)
from vllm_pd_ext.connectors.common.metadata import (
    PdTransferMetadata,
    PushSpec,
    RecvSpec,
    RemoteRef,
    SendSpec,
)
from vllm_pd_ext.connectors.common.tracing import TransferSpans
from vllm_pd_ext.transfer_params import READ, WRITE, PdExtWriteDecode, PrefillLeg
from vllm_pd_ext.util.vllm_process import free_port

#: Blocks of the real schedulers' KV cache, for workers that serve them.
SCHED_BLOCKS = 64
#: The bytes of one block across every layer, in these tests' caches.
BLOCK_BYTES = LAYERS * BLOCK * HEADS * 2 * HEAD * 4
PROMPT = 40  # two full blocks and a half one: three blocks move

P_TRACE, P_SPAN = 0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B7
D_TRACE, D_SPAN = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x53995C3F42CD8AD8


def traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def traced_pair(exporter):
    """(prefill worker, its caches, decode worker, its caches, side port) over tcp, both
    ending their spans into ``exporter``."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    port = free_port()
    clock = Clock()
    p = worker("kv_producer", port, clock=clock, backend="tcp", num_blocks=SCHED_BLOCKS)
    p.engine_id = "engine-kv_producer"  # as the real prefill scheduler names it
    p.clock = clock  # type: ignore[attr-defined]  # the tests move the lease clock
    d = worker("kv_consumer", free_port(), backend="tcp", num_blocks=SCHED_BLOCKS)
    p.spans = d.spans = TransferSpans(provider)
    pc, dc = caches(True, num_blocks=SCHED_BLOCKS), caches(False, num_blocks=SCHED_BLOCKS)
    p.register_kv_caches(pc)
    d.register_kv_caches(dc)
    yield p, pc, d, dc, port
    d.shutdown()
    p.shutdown()
    provider.shutdown()


def spans_named(exporter: InMemorySpanExporter, name: str, n: int = 1) -> list:
    """The ``n`` finished spans called ``name`` (polled: transfer threads end them)."""
    return poll(
        lambda: [s for s in exporter.get_finished_spans() if s.name == name][:n] or None,
        f"{n} {name} span(s)",
    )


def assert_child_of(span, trace_id: int, span_id: int) -> None:
    assert span.context.trace_id == trace_id
    assert span.parent is not None and span.parent.span_id == span_id


def test_a_read_is_a_load_span_under_the_decode_request_and_a_hold_span_under_the_prefill(
    tiny_qwen, traced_pair, exporter
):
    """READ through real schedulers: the decode request's ``kv_load`` (the bytes of three
    blocks, the prefill engine as peer and side channel) and the prefill request's
    ``kv_hold`` (released by the decode's transport), each under its request's trace."""
    p, _pc, d, _dc, port = traced_pair
    p_config = make_vllm_config(tiny_qwen, "kv_producer", {"side_channel_port": port})
    p_sched = make_scheduler(p_config)
    d_sched = make_scheduler(make_vllm_config(tiny_qwen, "kv_consumer"))
    p_req = make_request(PROMPT, PrefillLeg(transfer_mode=READ).params(), max_tokens=1)
    p_req.trace_headers = {"traceparent": traceparent(P_TRACE, P_SPAN)}
    p_sched.add_request(p_req)
    _, outputs = step(p_sched)
    answer = outputs[0].outputs[0].kv_transfer_params
    p.bind(step(p_sched)[0].kv_connector_metadata)  # the finished request's blocks, held
    assert p.get_finished({p_req.request_id}) == (None, None)
    d_req = make_request(PROMPT, dict(answer), max_tokens=2)
    d_req.trace_headers = {"traceparent": traceparent(D_TRACE, D_SPAN), "tracestate": "a=1"}
    d_sched.add_request(d_req)
    d_meta = step(d_sched)[0].kv_connector_metadata
    (spec,) = d_meta.recv
    assert spec.traceparent == traceparent(D_TRACE, D_SPAN)
    d.bind(d_meta)
    d.start_load_kv()
    assert poll(lambda: d.get_finished(set())[1], "the load") == {d_req.request_id}
    assert d.get_block_ids_with_load_errors() == set()
    (load,) = spans_named(exporter, "kv_load")
    assert_child_of(load, D_TRACE, D_SPAN)
    assert load.kind == SpanKind.CLIENT and load.status.status_code == StatusCode.UNSET
    attrs = load.attributes
    assert attrs["vllm_pd.kv.outcome"] == "ok" and attrs["vllm_pd.kv.mode"] == READ
    assert attrs["vllm_pd.kv.bytes"] == 3 * BLOCK_BYTES
    assert attrs["vllm_pd.kv.peer"] == "engine-kv_producer"  # the prefill's, from its answer
    assert (attrs["server.address"], attrs["server.port"]) == ("127.0.0.1", port)
    assert attrs["vllm_pd.kv.request_id"] == d_req.request_id
    assert load.end_time > load.start_time
    # the prefill side frees the blocks once the decode says done: the hold span ends
    assert poll(lambda: p.get_finished(set())[0], "the release") == {p_req.request_id}
    (hold,) = spans_named(exporter, "kv_hold")
    assert_child_of(hold, P_TRACE, P_SPAN)
    assert hold.attributes["vllm_pd.kv.outcome"] == "released"
    assert hold.attributes["vllm_pd.kv.blocks"] == 3
    assert hold.attributes["vllm_pd.kv.peer"] == d.transport.engine_id
    assert hold.status.status_code == StatusCode.UNSET


def test_a_write_is_a_push_span_under_the_prefill_request_and_a_load_span_under_the_decode(
    tiny_qwen, traced_pair, exporter
):
    p, pc, d, _dc, port = traced_pair
    p_sched = make_scheduler(make_vllm_config(tiny_qwen, "kv_producer"))
    d_sched = make_scheduler(make_vllm_config(tiny_qwen, "kv_consumer"))
    tid = "t-traced"
    p_req = make_request(
        PROMPT, PrefillLeg(transfer_mode=WRITE, transfer_id=tid).params(), max_tokens=1
    )
    p_req.trace_headers = {"traceparent": traceparent(P_TRACE, P_SPAN)}
    p_sched.add_request(p_req)
    p_meta = step(p_sched)[0].kv_connector_metadata
    assert p_meta.push[0].traceparent == traceparent(P_TRACE, P_SPAN)
    d_params = PdExtWriteDecode.build(tid, None, "127.0.0.1", port).signed(None)
    d_req = make_request(PROMPT, d_params, max_tokens=2)
    d_req.trace_headers = {"traceparent": traceparent(D_TRACE, D_SPAN)}
    d_sched.add_request(d_req)
    d_meta = step(d_sched)[0].kv_connector_metadata
    d.bind(d_meta)
    d.start_load_kv()
    p.bind(p_meta)
    for layer in pc:
        p.save_kv_layer(layer)
    p.wait_for_save()
    p.bind(step(p_sched)[0].kv_connector_metadata)  # the finished request keeps its blocks
    assert poll(lambda: d.get_finished(set())[1], "the load") == {d_req.request_id}
    assert d.get_block_ids_with_load_errors() == set()
    (push,) = spans_named(exporter, "kv_push")
    assert_child_of(push, P_TRACE, P_SPAN)
    assert push.attributes["vllm_pd.kv.outcome"] == "ok"
    assert push.attributes["vllm_pd.kv.mode"] == WRITE
    assert push.attributes["vllm_pd.kv.bytes"] == 3 * BLOCK_BYTES
    assert push.attributes["vllm_pd.kv.peer"] == d.engine_id  # the decode that offered
    (load,) = spans_named(exporter, "kv_load")
    assert_child_of(load, D_TRACE, D_SPAN)
    assert load.attributes["vllm_pd.kv.outcome"] == "ok"
    assert load.attributes["vllm_pd.kv.mode"] == WRITE
    assert load.attributes["vllm_pd.kv.bytes"] == 0  # the prefill side moved them


def test_a_failed_load_and_an_expired_hold_are_error_spans(traced_pair, exporter):
    p, _pc, d, _dc, _port = traced_pair
    dead = RemoteRef("engine-gone", "127.0.0.1", free_port(), "p-req")
    parent = traceparent(D_TRACE, D_SPAN)
    recv(d, RecvSpec("d-req", READ, dead, (((5, 1),),), ((5,),), traceparent=parent))
    assert poll(lambda: d.get_finished(set())[1], "the failure") == {"d-req"}
    assert d.get_block_ids_with_load_errors() == {5}
    (load,) = spans_named(exporter, "kv_load")
    assert_child_of(load, D_TRACE, D_SPAN)
    assert load.status.status_code == StatusCode.ERROR
    assert load.attributes["vllm_pd.kv.outcome"] == "failed"
    assert load.attributes["error.type"] == "LoadFailed"
    assert load.attributes["vllm_pd.kv.peer"] == "engine-gone"
    held = SendSpec("p-req", READ, ((1, 2),), traceparent=traceparent(P_TRACE, P_SPAN))
    p.bind(PdTransferMetadata(send=[held]))
    p.get_finished({"p-req"})
    p.clock.now += p.cfg.lease_s + 1
    assert p.get_finished(set()) == ({"p-req"}, None)
    (hold,) = spans_named(exporter, "kv_hold")
    assert_child_of(hold, P_TRACE, P_SPAN)
    assert hold.status.status_code == StatusCode.ERROR
    assert hold.attributes["vllm_pd.kv.outcome"] == "expired"
    assert hold.attributes["error.type"] == "LeaseExpired"
    assert "vllm_pd.kv.peer" not in hold.attributes  # nobody claimed the blocks


def test_a_push_with_no_decode_offer_within_the_lease_is_an_error_span(traced_pair, exporter):
    p, _pc, _d, _dc, _port = traced_pair
    p.cfg = p.cfg.model_copy(update={"lease_s": 0.2})  # the push waits this long for an offer
    push = PushSpec("p-req", "t-nobody", ((1, 2),), PROMPT_HASH, traceparent(P_TRACE, P_SPAN))
    p.bind(PdTransferMetadata(push=[push]))
    p.wait_for_save()
    (span,) = spans_named(exporter, "kv_push")
    assert_child_of(span, P_TRACE, P_SPAN)
    assert span.attributes["vllm_pd.kv.outcome"] == "failed"
    assert "vllm_pd.kv.bytes" not in span.attributes and "vllm_pd.kv.peer" not in span.attributes
    assert span.status.status_code == StatusCode.ERROR


def test_untraced_transfers_make_no_span_and_never_start_a_tracer(traced_pair, exporter):
    """Requests without a traceparent (the engine does not trace) leave OpenTelemetry
    untouched: the same READ moves the KV and ends no span."""
    p, _pc, d, _dc, port = traced_pair
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", READ, ((1, 2, 3),))]))
    p.get_finished({"p-req"})
    ref = RemoteRef(p.engine_id, "127.0.0.1", port, "p-req")
    recv(d, RecvSpec("d-req", READ, ref, (((5, 1), (9, 2), (6, 3)),), ((5, 9, 6),)))
    assert poll(lambda: d.get_finished(set())[1], "the load") == {"d-req"}
    assert poll(lambda: p.get_finished(set())[0], "the release") == {"p-req"}
    assert d.get_block_ids_with_load_errors() == set()
    assert d.stats.take().data["bytes"] == [3 * BLOCK_BYTES]
    assert exporter.get_finished_spans() == ()
    assert p.spans._tracer is None and d.spans._tracer is None
