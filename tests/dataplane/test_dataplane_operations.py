"""Operating the balancer: reloads that keep streams, and the Prometheus exporter."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx

from benchmarks.lab.dataplane import Dataplane, StreamOutcome, stream_chat
from denv_iac.local.processes import free_port
from denv_iac.local.replica_model import ReplicaSimConfig


def test_reload_keeps_the_running_stream_and_loses_no_request(
    start_dataplane: Callable[..., Dataplane],
) -> None:
    plane = start_dataplane(sim=ReplicaSimConfig("template", ttft_ms=20, itl_ms=10, tokens=60))
    long_stream: list[StreamOutcome] = []
    with plane.client() as client:
        streaming = threading.Thread(
            target=lambda: long_stream.append(stream_chat(client, {"model": "voice"}))
        )
        streaming.start()
        with plane.client() as other:
            before = stream_chat(other, {"model": "llm", "max_tokens": 1})
            assert plane.haproxy is not None
            plane.haproxy.reload()
            during = [stream_chat(other, {"model": "llm", "max_tokens": 1}) for _ in range(20)]
        streaming.join(timeout=10)

    assert before.done
    assert [(o.status, o.done) for o in during] == [(200, True)] * 20
    (outcome,) = long_stream
    assert outcome.done and outcome.error is None and len(outcome.chunks) == 61


def test_prometheus_exporter_reports_every_server(
    start_dataplane: Callable[..., Dataplane],
) -> None:
    port = free_port()
    plane = start_dataplane(prometheus_port=port)

    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)

    assert metrics.status_code == 200
    for replica_id in plane.replicas:
        assert f'server="{replica_id}"' in metrics.text
    assert 'haproxy_backend_active_servers{proxy="voice.tier10"} 2' in metrics.text
