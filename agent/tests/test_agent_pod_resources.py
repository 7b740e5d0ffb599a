"""The kubelet's pod-resources answer, decoded and mapped to replicas: an 8-GPU node, a MIG node.

Answers are encoded by protobuf itself from the messages of k8s.io/kubelet's
pkg/apis/podresources/v1/api.proto (fields the agent skips included), so the decoder is checked
against the real wire format, not against itself.
"""

from __future__ import annotations

from typing import Any

import pytest
from denv_agent.pod_resources import (
    Assigned,
    ContainerDevices,
    ContainerResources,
    DecodeError,
    PodResources,
    decode_list_response,
    replica_devices,
)

descriptor_pb2 = pytest.importorskip("google.protobuf.descriptor_pb2")
descriptor_pool = pytest.importorskip("google.protobuf.descriptor_pool")
message_factory = pytest.importorskip("google.protobuf.message_factory")

NS = "denv"
GPUS = [f"GPU-{i:08d}-1111-2222-3333-444444444444" for i in range(8)]
MIGS = [f"MIG-{i:08d}-aaaa-bbbb-cccc-dddddddddddd" for i in range(7)]

_STRING, _INT64, _UINT64, _MESSAGE = 9, 3, 4, 11
_ONE, _MANY = 1, 3
# api.proto v1, as published: (message, [(field, number, type, label, message type)]).
_API = [
    ("ListPodResourcesResponse", [("pod_resources", 1, _MESSAGE, _MANY, "PodResources")]),
    (
        "PodResources",
        [
            ("name", 1, _STRING, _ONE, ""),
            ("namespace", 2, _STRING, _ONE, ""),
            ("containers", 3, _MESSAGE, _MANY, "ContainerResources"),
        ],
    ),
    (
        "ContainerResources",
        [
            ("name", 1, _STRING, _ONE, ""),
            ("devices", 2, _MESSAGE, _MANY, "ContainerDevices"),
            ("cpu_ids", 3, _INT64, _MANY, ""),
            ("memory", 4, _MESSAGE, _MANY, "ContainerMemory"),
        ],
    ),
    (
        "ContainerMemory",
        [
            ("memory_type", 1, _STRING, _ONE, ""),
            ("size", 2, _UINT64, _ONE, ""),
            ("topology", 3, _MESSAGE, _ONE, "TopologyInfo"),
        ],
    ),
    ("TopologyInfo", [("nodes", 1, _MESSAGE, _MANY, "NUMANode")]),
    ("NUMANode", [("ID", 1, _INT64, _ONE, "")]),
    (
        "ContainerDevices",
        [
            ("resource_name", 1, _STRING, _ONE, ""),
            ("device_ids", 2, _STRING, _MANY, ""),
            ("topology", 3, _MESSAGE, _ONE, "TopologyInfo"),
        ],
    ),
]


def _response_class() -> Any:
    file = descriptor_pb2.FileDescriptorProto(name="podresources_v1.proto", package="v1")
    file.syntax = "proto3"
    for name, fields in _API:
        message = file.message_type.add(name=name)
        for field, number, kind, label, type_name in fields:
            added = message.field.add(name=field, number=number, type=kind, label=label)
            if type_name:
                added.type_name = f".v1.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("v1.ListPodResourcesResponse")
    )


Response = _response_class()


def _pod(name: str, namespace: str = NS, **containers: list[tuple[str, list[str]]]) -> Any:
    """A pod as the kubelet lists it, with the extras it carries (CPUs, memory, NUMA)."""
    return {
        "name": name,
        "namespace": namespace,
        "containers": [
            {
                "name": container,
                "cpu_ids": [2, 3],
                "memory": [
                    {"memory_type": "memory", "size": 1 << 34, "topology": {"nodes": [{"ID": 0}]}}
                ],
                "devices": [
                    {
                        "resource_name": resource,
                        "device_ids": ids,
                        "topology": {"nodes": [{"ID": 1}]},
                    }
                    for resource, ids in devices
                ],
            }
            for container, devices in containers.items()
        ],
    }


def _encoded(*pods: Any) -> bytes:
    message = Response()
    for pod in pods:
        _fill(message.pod_resources.add(), pod)
    return bytes(message.SerializeToString())


def _fill(message: Any, values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict):
            _fill(getattr(message, key), value)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for item in value:
                _fill(getattr(message, key).add(), item)
        elif isinstance(value, list):
            getattr(message, key).extend(value)
        else:
            setattr(message, key, value)


# A node of 8 whole GPUs: voice-0..5 hold one each, a two-GPU pod of another namespace shares
# the node, and a pod of the same name in another namespace must not be taken for a replica.
EIGHT_GPUS = _encoded(
    *(_pod(f"voice-{i}", server=[("nvidia.com/gpu", [GPUS[i]])]) for i in range(6)),
    _pod("trainer-0", "ml", main=[("nvidia.com/gpu", GPUS[6:8])]),
    _pod("voice-6", "other", server=[("nvidia.com/gpu", [GPUS[6]])]),
    _pod("coredns-1", "kube-system", coredns=[]),
)
# A node whose GPU 0 is cut into 1g.10gb slices and GPU 1 into 3g.40gb: side replicas on
# slices, one voice replica on a whole GPU, and a pod whose server got no device at all.
MIG_NODE = _encoded(
    _pod("side-0", server=[("nvidia.com/mig-1g.10gb", [MIGS[0]])]),
    _pod("side-1", server=[("nvidia.com/mig-1g.10gb", [MIGS[1]])]),
    _pod("big-0", server=[("nvidia.com/mig-3g.40gb", [MIGS[5]])]),
    _pod(
        "voice-2",
        server=[("nvidia.com/gpu", [GPUS[2]])],
        sidecar=[("nvidia.com/gpu", [GPUS[3]])],
    ),
    _pod("cpu-0", server=[]),
)

EIGHT = {f"voice.k8s.node-0.{i}": f"voice-{i}" for i in range(8)}
MIXED = {
    "side.k8s.node-0.0.0": "side-0",
    "side.k8s.node-0.0.1": "side-1",
    "side.k8s.node-1.0.0": "side-2",  # on another node: not in the answer
    "big.k8s.node-0.1.0": "big-0",
    "voice.k8s.node-1.0": "voice-2",
    "cpu.k8s.node-0.0": "cpu-0",
}


@pytest.mark.parametrize(
    "answer, replicas, expected",
    [
        (
            EIGHT_GPUS,
            EIGHT,
            {f"voice.k8s.node-0.{i}": Assigned(gpus=frozenset({GPUS[i]})) for i in range(6)},
        ),
        (
            MIG_NODE,
            MIXED,
            {
                "side.k8s.node-0.0.0": Assigned(mig_devices=frozenset({MIGS[0]})),
                "side.k8s.node-0.0.1": Assigned(mig_devices=frozenset({MIGS[1]})),
                "big.k8s.node-0.1.0": Assigned(mig_devices=frozenset({MIGS[5]})),
                # Only the server container's devices count, not a sidecar's.
                "voice.k8s.node-1.0": Assigned(gpus=frozenset({GPUS[2]})),
                "cpu.k8s.node-0.0": Assigned(),
            },
        ),
    ],
    ids=["8 GPUs", "MIG slices"],
)
def test_each_replica_gets_the_devices_of_its_pods_server(
    answer: bytes, replicas: dict[str, str], expected: dict[str, Assigned]
) -> None:
    pods = decode_list_response(answer)
    assert replica_devices(pods, NS, "server", replicas) == expected


def test_the_answer_decodes_to_every_pod_container_and_device() -> None:
    pods = decode_list_response(MIG_NODE)
    assert [(p.namespace, p.name) for p in pods] == [
        (NS, "side-0"),
        (NS, "side-1"),
        (NS, "big-0"),
        (NS, "voice-2"),
        (NS, "cpu-0"),
    ]
    assert pods[3] == PodResources(
        "voice-2",
        NS,
        (
            ContainerResources("server", (ContainerDevices("nvidia.com/gpu", (GPUS[2],)),)),
            ContainerResources("sidecar", (ContainerDevices("nvidia.com/gpu", (GPUS[3],)),)),
        ),
    )
    assert decode_list_response(b"") == ()


@pytest.mark.parametrize(
    "data",
    [
        EIGHT_GPUS[:-3],  # cut inside a string
        b"\x0a",  # a length with no bytes after it
        b"\x0a\xff",  # a varint cut short
        b"\x0a\x02\x0a\x01",  # a pod whose name runs past it
        b"\x0b",  # wire type 3 (groups) is not proto3
        b"\x0a\x03\x0a\x01\xff",  # a name that is not UTF-8
    ],
)
def test_a_broken_answer_is_a_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_list_response(data)
