"""The pod-resources client against a real gRPC server on a unix socket (grpcio, test-only).

The kubelet serves `v1.PodResourcesLister/List` with grpc-go; grpcio's server speaks the same
HTTP/2 and gRPC framing, so the client is checked against an independent implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from denv_agent.kubelet import KubeletPodResources, PodResourcesError
from denv_agent.nvml_double import FakeNvml
from denv_agent.pod_resources import Assigned, replica_devices

from agent.tests.agent_testkit import ReplicaServer, make_config, reply, running, wait_for
from agent.tests.test_agent_pod_resources import EIGHT_GPUS, GPUS, MIG_NODE, MIGS, _encoded, _pod

grpc = pytest.importorskip("grpc")

Handler = Callable[[bytes, Any], bytes]


@contextmanager
def kubelet(tmp_path: Path, answer: Handler) -> Iterator[Path]:
    """A gRPC server on a unix socket serving List with `answer` (raw bytes in and out)."""
    path = tmp_path / "kubelet.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(answer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("v1.PodResourcesLister", {"List": handler}),)
    )
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        yield path
    finally:
        server.stop(0)


def _answering(data: bytes) -> Handler:
    def answer(request: bytes, _context: Any) -> bytes:
        assert request == b"", "ListPodResourcesRequest has no fields"
        return data

    return answer


@pytest.mark.parametrize(
    "answer, replicas, expected",
    [
        (EIGHT_GPUS, {"voice.3": "voice-3"}, {"voice.3": Assigned(gpus=frozenset({GPUS[3]}))}),
        (MIG_NODE, {"side.1": "side-1"}, {"side.1": Assigned(mig_devices=frozenset({MIGS[1]}))}),
        (b"", {"voice.0": "voice-0"}, {}),  # a node with no pods: an empty message
    ],
    ids=["8 GPUs", "MIG slices", "no pods"],
)
def test_the_agent_reads_the_kubelets_answer_over_its_socket(
    tmp_path: Path, answer: bytes, replicas: dict[str, str], expected: dict[str, Assigned]
) -> None:
    with kubelet(tmp_path, _answering(answer)) as path:
        pods = KubeletPodResources(path).list()
        assert replica_devices(pods, "denv", "server", replicas) == expected
        # A second call on a new connection, as every poll makes.
        assert KubeletPodResources(path).list() == pods


def test_an_answer_past_the_default_window_arrives_whole(tmp_path: Path) -> None:
    # 1000 pods, about 140 KiB: more than HTTP/2's default 64 KiB window.
    many = _encoded(
        *(
            _pod(f"job-{i}", "batch", main=[("nvidia.com/gpu", [f"GPU-{i:0>60}"])])
            for i in range(1000)
        )
    )
    assert len(many) > 65535
    with kubelet(tmp_path, _answering(many)) as path:
        pods = KubeletPodResources(path).list()
    assert len(pods) == 1000 and pods[-1].name == "job-999"


def test_a_grpc_error_or_no_kubelet_is_one_line(tmp_path: Path) -> None:
    def refuse(_request: bytes, context: Any) -> bytes:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "not allowed")

    with kubelet(tmp_path, refuse) as path, pytest.raises(PodResourcesError) as raised:
        KubeletPodResources(path).list()
    assert str(raised.value) == "the call ended without a pod list (a gRPC error)"
    # A path no server ever had: the one above may still answer while its server winds down.
    with pytest.raises(PodResourcesError, match=r"kubelet\.sock: No such file or directory"):
        KubeletPodResources(tmp_path / "never" / "kubelet.sock").list()


def test_a_node_agent_answers_for_the_pods_on_its_node_by_their_gpus(tmp_path: Path) -> None:
    """A whole agent on Kubernetes: its config names every replica of the site by pod, the
    kubelet says which are here on which GPU, and each verdict follows that GPU."""
    nvml = FakeNvml(2)
    servers = [ReplicaServer(), ReplicaServer()]
    answer = {"pods": _encoded(_pod("voice-0", server=[("nvidia.com/gpu", [nvml.gpus[1].uuid])]))}
    socket = str(tmp_path / "kubelet.sock")
    kube = {"namespace": "denv", "container": "server", "pod_resources_socket": socket}
    replicas = [
        {"id": f"voice.{i}", "health_url": s.health_url, "pod": f"voice-{i}"}
        for i, s in enumerate(servers)
    ]
    config = make_config(tmp_path, replicas, kubernetes=kube)
    try:
        with (
            kubelet(tmp_path, lambda _request, _context: answer["pods"]),
            running(config, nvml) as agent,
        ):
            wait_for(lambda: reply(agent, "voice.0"), "up ready 100%\n")
            # voice-1 runs on another node: unknown here, and never checked from here
            assert reply(agent, "voice.1") == "down #unknown replica\n"
            assert agent.replicas.view()["voice.1"].checks == 0
            nvml.inject_xid(1, 48)  # the GPU the kubelet gave voice-0, not GPU 0
            wait_for(lambda: reply(agent, "voice.0"), lambda r: r.startswith("down #xid 48"))
            # voice-1 is scheduled here, on GPU 0
            answer["pods"] = _encoded(
                _pod("voice-0", server=[("nvidia.com/gpu", [nvml.gpus[1].uuid])]),
                _pod("voice-1", server=[("nvidia.com/gpu", [nvml.gpus[0].uuid])]),
            )
            wait_for(lambda: reply(agent, "voice.1"), "up ready 100%\n")
            assert agent.replicas.view()["voice.1"].checks > 0
            # and goes away again: its readings go with it, a pod coming back starts afresh
            answer["pods"] = _encoded(
                _pod("voice-0", server=[("nvidia.com/gpu", [nvml.gpus[1].uuid])])
            )
            wait_for(lambda: reply(agent, "voice.1"), "down #unknown replica\n")
            wait_for(lambda: agent.replicas.view()["voice.1"].checks, 0)
    finally:
        for server in servers:
            server.close()
