"""The Kubernetes objects of a kubernetes site, as plain manifests: pure, no Pulumi.

A module per part: `site` (all the site's objects together, and what a stack must satisfy for
them), `pods` (the replicas), `agent` (the node agent), `gateway` (the relay), `objects` (what
they are all made of).

Replicas are pods: one StatefulSet per pool, pod `<pool>-<ordinal>` serving the pool's
`ordinal`-th replica placed on the site, on one `nvidia.com/gpu` or one MIG device
(`nvidia.com/mig-<profile>`, the GPU operator's mixed strategy).

The global balancer reaches every replica at its node's address and `replica_port`, and asks
every node's agent on AGENT_PORT, sending the replica id (`agent-send`). On this site the
placement's nodes are planning units of `gpus_per_node` GPUs, not Kubernetes nodes: the
scheduler picks those. Two replicas on different planning nodes often share a port (the same
GPU index on each), so one address for the whole site would make them indistinguishable.
Hence the gateway design: one HAProxy Deployment in the cluster forwarding TCP, and one
LoadBalancer Service per planning node, whose address is that node's address. A Service maps
each replica port of its node onto a gateway listener of its own (GATEWAY_PORT_BASE plus the
node's ordinal and the replica's GPU and slice, so a listener never moves when replicas are
added), which forwards to the pod's stable name `<pool>-<i>.<pool>.<ns>.svc.cluster.local`.

The agent runs as NVIDIA's own exporters do (dcgm-exporter): one pod per GPU node, a
DaemonSet, in the `nvidia` runtime class with every GPU of the node visible, reading from the
kubelet's pod-resources API which GPU or MIG device each replica pod was given. A container
that asks for no GPU sees none: since GPU Operator 25.10, CDI is on and `nvidia` is no longer
the default runtime, so without the runtime class NVML fails. Every agent of the site has the
same config, naming all the site's replicas by pod; it answers for the replicas whose pods run
on its node and says AGENT_UNKNOWN (denv_iac.core.balancer.gateway) for the others. Agent checks all
arrive at the gateway on AGENT_PORT; it routes each by the replica id it carries to a backend
holding every node's agent, where a check sending that id marks down each agent that does not
know the replica, so the balancer's check is relayed to the agent of the replica's node. The
global balancer keeps its per-replica health checks, agent verdicts and session affinity
exactly as on machines; the gateway is only a relay, its haproxy.cfg rendered by
`denv_iac.core.balancer.gateway`. The price is one cloud load balancer per planning node.

A replica pod rolls as a replica on a machine does. Its readiness means warm, and its preStop
drains it and waits for its calls to end; both ask the agent of the pod's own node, through a
Service that keeps traffic on the caller's node (AGENT_LOCAL_NAME), on the agent's pod endpoints.

Every listener the balancer calls (replica ports and the agent frontend) takes only TLS with a
client certificate of the stack's own CA, whose certificate and key reach the pods as a Secret
(see `denv_iac.core.stack.gateway_link` for why TLS and not a WireGuard peer).
"""
