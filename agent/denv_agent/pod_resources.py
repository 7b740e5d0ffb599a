"""Which GPU or MIG devices the kubelet gave each replica pod on this node.

The kubelet's pod-resources API (`v1.PodResourcesLister/List`, gRPC on a unix socket,
k8s.io/kubelet/pkg/apis/podresources/v1) lists every pod on the node with, per container,
the devices the device plugins allocated: `resource_name` `nvidia.com/gpu` with GPU UUIDs, or
`nvidia.com/mig-<profile>` with MIG device UUIDs (the GPU operator's mixed strategy). NVIDIA's
exporters (dcgm-exporter) map GPUs to pods the same way.

The answer is decoded here from protobuf's wire format, reading only the fields used; the
transport that fetches it is a `PodResourcesSource`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from denv_agent.config import Kubernetes, Replica
from denv_agent.periodic import start_periodic

log = logging.getLogger("denv_agent.pods")

GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
LIST_METHOD = "/v1.PodResourcesLister/List"

# Field numbers of api.proto (v1): ListPodResourcesResponse.pod_resources = 1;
# PodResources name = 1, namespace = 2, containers = 3; ContainerResources name = 1,
# devices = 2; ContainerDevices resource_name = 1, device_ids = 2. Others are skipped.
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


class DecodeError(ValueError):
    """The bytes are not a ListPodResourcesResponse."""


@dataclass(frozen=True)
class ContainerDevices:
    resource_name: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class ContainerResources:
    name: str
    devices: tuple[ContainerDevices, ...]


@dataclass(frozen=True)
class PodResources:
    name: str
    namespace: str
    containers: tuple[ContainerResources, ...]


class PodResourcesSource(Protocol):
    """Where the node's pod resources come from: the kubelet's socket, or a test's table."""

    def list(self) -> tuple[PodResources, ...]: ...


@dataclass(frozen=True)
class Assigned:
    """The devices of one replica's container: whole GPUs and MIG devices, by UUID."""

    gpus: frozenset[str] = frozenset()
    mig_devices: frozenset[str] = frozenset()


def replica_devices(
    pods: tuple[PodResources, ...],
    namespace: str,
    container: str,
    replica_pods: Mapping[str, str],
) -> dict[str, Assigned]:
    """Replica id -> its container's GPU devices, for the replicas whose pods run on this node.

    `replica_pods` maps replica id -> pod name. A replica absent from the answer has no pod
    here (another node runs it, or it is not scheduled yet); one present with no devices has a
    pod here that holds no GPU, which the verdict reports.
    """
    by_pod = {(p.namespace, p.name): p for p in pods}
    found: dict[str, Assigned] = {}
    for replica, pod_name in replica_pods.items():
        pod = by_pod.get((namespace, pod_name))
        if pod is None:
            continue
        gpus: set[str] = set()
        migs: set[str] = set()
        for held in pod.containers:
            if held.name != container:
                continue
            for devices in held.devices:
                if devices.resource_name == GPU_RESOURCE:
                    gpus.update(devices.device_ids)
                elif devices.resource_name.startswith(MIG_RESOURCE_PREFIX):
                    migs.update(devices.device_ids)
        found[replica] = Assigned(frozenset(gpus), frozenset(migs))
    return found


class PodMonitor:
    """Polls the node's pod resources; the view is the devices of the replicas running here.

    Until the first answer no replica is here (each is answered as unknown). A failed poll keeps
    the last view: pods keep their devices while they run, and a kubelet restarting says
    nothing new about them.
    """

    def __init__(
        self,
        source: PodResourcesSource,
        kubernetes: Kubernetes,
        replicas: tuple[Replica, ...],
        interval_s: float,
        on_change: Callable[[], None],
    ) -> None:
        self.source = source
        self.kubernetes = kubernetes
        self.replica_pods = {r.id: r.pod for r in replicas if r.pod is not None}
        self.interval_s = interval_s
        self.on_change = on_change
        self._view: dict[str, Assigned] = {}
        self._error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = start_periodic("pod-resources", self.interval_s, self.poll, self._stop)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def view(self) -> Mapping[str, Assigned]:
        return self._view

    def here(self, replica_id: str) -> bool:
        """Whether this node should check the replica: not given by pod, or its pod is here."""
        return replica_id not in self.replica_pods or replica_id in self._view

    def poll(self) -> None:
        try:
            pods = self.source.list()
        except (OSError, ValueError) as e:
            if str(e) != self._error:
                log.warning("pod resources: %s; keeping the last answer", e)
                self._error = str(e)
            return
        self._error = ""
        found = replica_devices(
            pods, self.kubernetes.namespace, self.kubernetes.container, self.replica_pods
        )
        if found != self._view:
            log.info("replicas here: %s", sorted(found) or "none")
            self._view = found
            self.on_change()


def decode_list_response(data: bytes) -> tuple[PodResources, ...]:
    """A ListPodResourcesResponse from its protobuf encoding."""
    return tuple(_pod(_bytes(value)) for number, value in _fields(data) if number == 1)


def _pod(data: bytes) -> PodResources:
    name = namespace = ""
    containers: list[ContainerResources] = []
    for number, value in _fields(data):
        if number == 1:
            name = _text(value)
        elif number == 2:
            namespace = _text(value)
        elif number == 3:
            containers.append(_container(_bytes(value)))
    return PodResources(name, namespace, tuple(containers))


def _container(data: bytes) -> ContainerResources:
    name = ""
    devices: list[ContainerDevices] = []
    for number, value in _fields(data):
        if number == 1:
            name = _text(value)
        elif number == 2:
            devices.append(_devices(_bytes(value)))
    return ContainerResources(name, tuple(devices))


def _devices(data: bytes) -> ContainerDevices:
    resource = ""
    ids: list[str] = []
    for number, value in _fields(data):
        if number == 1:
            resource = _text(value)
        elif number == 2:
            ids.append(_text(value))
    return ContainerDevices(resource, tuple(ids))


def _bytes(value: bytes | int) -> bytes:
    if not isinstance(value, bytes):
        raise DecodeError("a string or message field holds a number")
    return value


def _text(value: bytes | int) -> str:
    try:
        return _bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError("a string field is not UTF-8") from None


def _fields(data: bytes) -> Iterator[tuple[int, bytes | int]]:
    """(field number, value) of one message: bytes for length-delimited fields, else ints."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        if wire == _VARINT:
            value, at = _varint(data, at)
            yield number, value
        elif wire == _LENGTH:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise DecodeError("a field runs past the message")
            yield number, data[at : at + size]
            at += size
        elif wire in (_FIXED64, _FIXED32):
            size = 8 if wire == _FIXED64 else 4
            if at + size > len(data):
                raise DecodeError("a field runs past the message")
            yield number, int.from_bytes(data[at : at + size], "little")
            at += size
        else:
            raise DecodeError(f"wire type {wire} of field {number} is not read here")


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise DecodeError("a varint is cut short")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at
