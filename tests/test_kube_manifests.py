"""Kubernetes manifests of a kubernetes site: every object valid against the Kubernetes schema."""

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from denv_agent import agentcheck
from denv_agent.config import Kubernetes
from denv_agent.config import parse as parse_agent_config
from denv_agent.http_api import MAX_HOLD_S

from denv_iac.core.balancer.gateway import AGENT_UNKNOWN
from denv_iac.core.balancer.model import RenderedConfig
from denv_iac.core.ingress import AGENT_PORT
from denv_iac.core.kube_manifests.agent import AGENT_PODS_PORT, AGENT_RUN_DIR
from denv_iac.core.kube_manifests.gateway import (
    GATEWAY_PORT_BASE,
    GATEWAY_TLS_CA,
    GATEWAY_TLS_DIR,
    GATEWAY_TLS_PEM,
    GATEWAY_TLS_SECRET,
)
from denv_iac.core.kube_manifests.objects import GPU_PRODUCTS
from denv_iac.core.kube_manifests.pods import (
    gpu_resource,
    max_unavailable,
    min_available,
    rollout_timeout_s,
    startup_failure_threshold,
)
from denv_iac.core.kube_manifests.site import SiteManifests, site_manifests, site_problems
from denv_iac.core.placement import place_replicas
from denv_iac.core.stack.catalog import load_catalog
from denv_iac.core.stack.exposure import stack_warnings
from denv_iac.core.stack.model import SERVER_STOP_S, RecipeSpec
from denv_iac.core.stack.reader import StackError, read_stack
from denv_iac.haproxy import check_haproxy_config
from tests.gateway_pki import reading_tls_from, write_pki

KUBERNETES_VERSION = "1.37.0"
IMAGE = "vllm/vllm-openai:v0.11.0"


def _site(**extra: Any) -> dict[str, Any]:
    return {
        "name": "k8s",
        "kind": "kubernetes",
        "kubeconfig": {"secure": "sealed"},
        "gpu": "H100",
        "gpus_per_node": 8,
        "max_nodes": 4,
        **extra,
    }


def _recipe(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "min_warm": 2, "spare": 1, "sites": ["k8s"], "image": IMAGE, **extra}


VOICE = _recipe("voice", ttft_budget_ms=300, command=["--model", "example/voice"])
SIDE = _recipe("side", gpu="1g.10gb", port=8100)
STACKS = {
    "whole GPUs": ([_site()], [VOICE]),
    "MIG slices": ([_site()], [SIDE]),
    "both, one cache dir": ([_site(cache_size_gb=50)], [VOICE, {**SIDE, "cache_dirs": ["/c"]}]),
    "L40S, no spare": ([_site(gpu="L40S", gpus_per_node=4)], [_recipe("v", spare=0)]),
    "two sites": (
        [_site(max_nodes=2), _site(name="k8s-b", namespace="gpu")],
        [_recipe("voice", min_warm=3, spare=1, sites=["k8s", "k8s-b"])],
    ),
}


# A Kubernetes site cannot host the balancer: it runs on a machine of its own site.
EDGE = {"name": "edge", "kind": "local", "nodes": [{"name": "lb", "gpu": "L4", "gpus": 1}]}


def _manifests(
    sites: list[Any], recipes: list[Any], site: str = "k8s", private_links: bool = True
) -> SiteManifests:
    balancer = {"sites": ["edge"], "overlay": {"enabled": private_links}}
    stack = read_stack(
        "prod",
        {"denv:sites": [*sites, EDGE], "denv:recipes": recipes, "denv:balancer": balancer},
    )
    return site_manifests(stack, stack.site(site), place_replicas(stack).replicas)


def _pool(manifests: SiteManifests, name: str) -> Any:
    return next(p for p in manifests.pools if p.pool == name)


def _server(stateful_set: dict[str, Any]) -> dict[str, Any]:
    containers = stateful_set["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "server")


LINKS = pytest.mark.parametrize("private_links", [True, False], ids=["tls", "plain"])


@LINKS
@pytest.mark.parametrize("sites, recipes", STACKS.values(), ids=STACKS.keys())
def test_every_object_is_valid_kubernetes(
    sites: list[Any], recipes: list[Any], private_links: bool
) -> None:
    for site in sites:
        objects = _manifests(sites, recipes, site["name"], private_links).objects()
        kinds = {o["kind"] for o in objects}
        assert kinds >= {"Namespace", "StatefulSet", "Service", "PodDisruptionBudget"}, kinds
        for manifest in objects:
            try:
                kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                name = f"{manifest['kind']} {manifest['metadata']['name']}"
                pytest.fail(f"{name}: {error.message} at {list(error.absolute_path)}")


@pytest.mark.needs_haproxy
@LINKS
@pytest.mark.parametrize("sites, recipes", STACKS.values(), ids=STACKS.keys())
def test_gateway_config_passes_haproxy_check(
    sites: list[Any], recipes: list[Any], private_links: bool, tmp_path: Path
) -> None:
    config = _manifests(sites, recipes, private_links=private_links).gateway_config["data"]
    # The certificate and CA the Secret gives the pod, here in a folder of the test's.
    pki = write_pki(tmp_path / "tls", "k8s")
    checked = reading_tls_from(config["haproxy.cfg"], pki.folder)
    check_haproxy_config(RenderedConfig(checked), tmp_path / "check")


TLS_BIND = (
    f"ssl crt {GATEWAY_TLS_DIR}/{GATEWAY_TLS_PEM} ca-file {GATEWAY_TLS_DIR}/{GATEWAY_TLS_CA}"
    " verify required ssl-min-ver TLSv1.3"
)


@pytest.mark.parametrize(
    "private_links, bind_options", [(True, " " + TLS_BIND), (False, "")], ids=["tls", "plain"]
)
def test_every_listener_the_balancer_calls_takes_only_mutual_tls(
    private_links: bool, bind_options: str
) -> None:
    manifests = _manifests([_site()], [VOICE, SIDE], private_links=private_links)
    config = manifests.gateway_config["data"]["haproxy.cfg"]
    called = {route.listen_port for route in manifests.routes} | {AGENT_PORT}
    binds = dict(
        (int(line.split()[1].lstrip(":")), line.strip())
        for line in config.splitlines()
        if line.strip().startswith("bind ")
    )
    # The health port serves the kubelet's probes inside the cluster: no Service exposes it.
    assert set(binds) == called | {8404}
    assert binds.pop(8404) == "bind :8404"
    assert binds == {port: f"bind :{port}{bind_options}" for port in called}


def test_the_gateway_reads_its_key_from_a_secret_mounted_read_only_for_haproxy_alone() -> None:
    manifests = _manifests([_site()], [VOICE])
    secret = manifests.gateway_tls
    # The frame only: the component fills the data, so no manifest or preview holds a key.
    assert secret is not None and secret["kind"] == "Secret" and secret["type"] == "Opaque"
    assert secret["metadata"]["name"] == GATEWAY_TLS_SECRET and "data" not in secret
    assert "stringData" not in secret
    objects = manifests.objects()
    assert objects.index(secret) < objects.index(manifests.gateway)
    pod = manifests.gateway["spec"]["template"]["spec"]
    (tls,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert tls["secret"] == {"secretName": GATEWAY_TLS_SECRET, "defaultMode": 0o440}
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    assert mount == {"name": "tls", "mountPath": GATEWAY_TLS_DIR, "readOnly": True}
    # The official image runs HAProxy as group haproxy (99): its files, read by it alone.
    assert pod["securityContext"] == {"fsGroup": 99}


def test_a_plain_link_has_no_tls_secret_and_mounts_none() -> None:
    manifests = _manifests([_site()], [VOICE], private_links=False)
    assert manifests.gateway_tls is None
    assert "Secret" not in {o["kind"] for o in manifests.objects()}
    pod = manifests.gateway["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["config"]
    assert "securityContext" not in pod


@pytest.mark.parametrize(
    "share, resource",
    [
        ("whole", "nvidia.com/gpu"),
        ("1g.10gb", "nvidia.com/mig-1g.10gb"),
        ("3g.40gb", "nvidia.com/mig-3g.40gb"),
    ],
)
def test_gpu_resource(share: str, resource: str) -> None:
    assert gpu_resource(RecipeSpec("p", share, (("k8s",),), 1)) == resource


@pytest.mark.parametrize("budget, failures", [(10, 1), (900, 90), (905, 91), (1200, 120)])
def test_startup_probe_covers_the_cold_start_budget(budget: int, failures: int) -> None:
    recipe = RecipeSpec("p", "whole", (("k8s",),), 1, cold_start_budget_s=budget)
    assert startup_failure_threshold(recipe) == failures


@pytest.mark.parametrize(
    "min_warm, spare, on_site, least",
    [
        (2, 1, 3, 2),  # the whole pool here: one may go
        (1, 1, 2, 1),
        (2, 2, 2, 1),  # half the pool here: half the spare
        (3, 1, 2, 2),  # a share below one replica: none may go
        (1, 0, 1, 1),
        (1, 3, 4, 1),  # never below one
    ],
)
def test_disruption_budget_keeps_all_but_the_sites_share_of_the_spare(
    min_warm: int, spare: int, on_site: int, least: int
) -> None:
    recipe = RecipeSpec("p", "whole", (("k8s",),), min_warm, spare)
    assert min_available(recipe, on_site) == least


@pytest.mark.parametrize(
    "min_warm, spare, on_site, at_once",
    [
        (2, 1, 3, 1),  # the whole pool here: its spare
        (2, 2, 4, 2),
        (2, 2, 2, 1),  # half the pool here: half the spare
        (3, 1, 2, 1),  # no share of the spare here: still one, or the rollout never moves
        (1, 0, 1, 1),
    ],
)
def test_a_rollout_restarts_the_sites_share_of_the_spare_at_once(
    min_warm: int, spare: int, on_site: int, at_once: int
) -> None:
    recipe = RecipeSpec("p", "whole", (("k8s",),), min_warm, spare)
    assert max_unavailable(recipe, on_site) == at_once
    assert at_once == max(1, on_site - min_available(recipe, on_site))  # the budget's complement


@pytest.mark.parametrize(
    "min_warm, spare, on_site, drain_s, cold_s, rejoin_s, bound_s",
    [
        # Three pods one at a time, each within 120 + 30 s to stop, 900 s to warm and 6 s to
        # be back in rotation: 3768 s.
        (2, 1, 3, 120, 900, 6, 3 * (150 + 900 + 6) + 600),
        # Four pods two at a time: two waves.
        (2, 2, 4, 120, 900, 6, 2 * (150 + 900 + 6) + 600),
        # One pod, a short drain and a fast model: still past the provider's 10 minutes.
        (1, 0, 1, 5, 60, 0, 35 + 60 + 600),
    ],
)
def test_up_waits_for_a_statefulsets_whole_rollout(
    min_warm: int, spare: int, on_site: int, drain_s: int, cold_s: int, rejoin_s: int, bound_s: int
) -> None:
    recipe = RecipeSpec(
        "p",
        "whole",
        (("k8s",),),
        min_warm,
        spare,
        cold_start_budget_s=cold_s,
        drain_timeout_s=drain_s,
    )
    assert rollout_timeout_s(recipe, on_site, rejoin_s) == bound_s


@pytest.mark.parametrize(
    "timers, min_ready_s",
    [
        # The gateway's 1 s checks, rise 2 (3 s), then the endpoint's: agent 200 ms, inter
        # 1000 ms, 2 x (fastinter 250 + timeout 500) ms = 2.7 s, rounded up to 3.
        ({}, 3 + 3),
        # Slow checks: agent 1000, inter 4000, 2 x (1000 + 2000) = 11 s.
        ({"check_inter_ms": 4000, "check_timeout_ms": 2000, "agent_inter_ms": 1000}, 3 + 11),
    ],
)
def test_a_rolled_pod_counts_as_available_once_the_balancers_count_it_up(
    timers: dict[str, int], min_ready_s: int
) -> None:
    stack = read_stack(
        "prod",
        {
            "denv:sites": [_site(), EDGE],
            "denv:recipes": [VOICE],
            "denv:balancer": {"sites": ["edge"], "timers": timers},
        },
    )
    manifests = site_manifests(stack, stack.site("k8s"), place_replicas(stack).replicas)
    pool = _pool(manifests, "voice")
    assert pool.stateful_set["spec"]["minReadySeconds"] == min_ready_s
    # The rollout's bound leaves each pod that long to rejoin.
    on_site = pool.stateful_set["spec"]["replicas"]
    voice = next(r for r in stack.recipes if r.name == "voice")
    assert pool.rollout_timeout_s == rollout_timeout_s(voice, on_site, min_ready_s)
    assert pool.rollout_timeout_s > rollout_timeout_s(voice, on_site, 0)


def test_a_stopping_pod_is_given_its_drain_bound_and_the_servers_stop() -> None:
    pool = _pool(_manifests([_site()], [{**VOICE, "drain_timeout_s": 300}]), "voice")
    spec = pool.stateful_set["spec"]
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] == 300 + SERVER_STOP_S
    rolling = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert spec["updateStrategy"] == rolling


@pytest.mark.parametrize(
    ("drain_timeout_s", "agent_inter_ms", "settle"),
    [
        (120, 200, "1.4"),  # the defaults: two agent checks and a second for the relay
        (300, 2000, "5.0"),  # slow agent checks: a longer settle
        (2, 2000, "2.0"),  # never past the drain bound
        (86400, 200, "1.4"),  # the longest bound a recipe may set: the agent still holds it
    ],
)
def test_a_stopping_pod_drains_and_waits_within_its_grace_period(
    drain_timeout_s: int, agent_inter_ms: int, settle: str
) -> None:
    balancer = {"sites": ["edge"], "timers": {"agent_inter_ms": agent_inter_ms}}
    stack = read_stack(
        "prod",
        {
            "denv:sites": [_site(), EDGE],
            "denv:recipes": [{**VOICE, "drain_timeout_s": drain_timeout_s}],
            "denv:balancer": balancer,
        },
    )
    manifests = site_manifests(stack, stack.site("k8s"), place_replicas(stack).replicas)
    pod = _pool(manifests, "voice").stateful_set["spec"]["template"]["spec"]
    server = _server(_pool(manifests, "voice").stateful_set)
    command = server["lifecycle"]["preStop"]["exec"]["command"]
    python, flag, script, url, port, wait, settle_s, hold, quiet = command
    assert (python, flag, port) == ("python3", "-c", "8000")
    assert "/drain?hold_s=" in script and "/proc/net/tcp" in script
    # The drain plan's numbers: its bound, its settle time, its quiet window (nodes' too).
    assert (wait, settle_s, quiet) == (str(drain_timeout_s), settle, "40")
    # The kubelet kills the pod at its grace period: the hook's wait fits in it, with the
    # server's own stop after it, and the agent's drain lasts no longer than the pod.
    grace = pod["terminationGracePeriodSeconds"]
    assert grace == drain_timeout_s + SERVER_STOP_S == int(hold) <= MAX_HOLD_S
    assert float(settle_s) <= int(wait) <= grace - SERVER_STOP_S
    # Both hooks ask the agent of the pod's own node, by the pod's name.
    ready = server["readinessProbe"]
    assert ready["exec"]["command"][3] == url
    assert ready["timeoutSeconds"] >= 5  # python3's start-up and one agent answer
    assert {"name": "DENV_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in (
        server["env"]
    )
    local = manifests.agent_local_service
    assert url == f"http://{local['metadata']['name']}.denv.svc.cluster.local:{AGENT_PODS_PORT}"
    assert local["spec"]["internalTrafficPolicy"] == "Local"
    assert local["spec"]["selector"] == manifests.agent["spec"]["selector"]["matchLabels"]
    (agent,) = manifests.agent["spec"]["template"]["spec"]["containers"]
    (service_port,) = local["spec"]["ports"]
    assert {"name": service_port["targetPort"], "containerPort": AGENT_PODS_PORT}.items() <= (
        next(p for p in agent["ports"] if p["name"] == "pods").items()
    )
    text = manifests.agent_config["data"]["agent.toml"]
    config = parse_agent_config(
        text.replace("control_token_file", "control_token", 1), base=Path("/")
    )
    assert config.listen.pods == ("0.0.0.0", AGENT_PODS_PORT)


@pytest.mark.parametrize(
    "recipe, resource, replicas, least",
    [(VOICE, "nvidia.com/gpu", 3, 2), (SIDE, "nvidia.com/mig-1g.10gb", 3, 2)],
)
def test_stateful_set_per_pool(
    recipe: dict[str, Any], resource: str, replicas: int, least: int
) -> None:
    manifests = _manifests([_site(cache_size_gb=300)], [recipe])
    pool = _pool(manifests, recipe["name"])
    spec = pool.stateful_set["spec"]
    assert spec["replicas"] == replicas
    assert pool.disruption_budget["spec"]["minAvailable"] == least
    server = _server(pool.stateful_set)
    assert server["resources"] == {"limits": {resource: "1"}}
    assert server["startupProbe"]["periodSeconds"] == 10
    assert server["startupProbe"]["failureThreshold"] == 90
    assert server["startupProbe"]["httpGet"]["path"] == "/health"
    # Ready means warm, which the node's agent judges (test_a_replica_pod_is_ready_when_warm...).
    assert server["readinessProbe"]["exec"]["command"][:2] == ["python3", "-c"]
    assert {m["mountPath"] for m in server["volumeMounts"]} == set(RecipeSpec.cache_dirs)
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env == {
        "HF_HOME": "/var/cache/denv/hf",
        "VLLM_CACHE_ROOT": "/var/cache/denv/compile",
        "DENV_POD": None,  # the pod's name, from the downward API
    }
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "300Gi"
    pod = spec["template"]["spec"]
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (expression,) = terms["nodeSelectorTerms"][0]["matchExpressions"]
    assert expression["key"] == "nvidia.com/gpu.product"
    assert "NVIDIA-H100-80GB-HBM3" in expression["values"]
    # The replica pod is the model server alone: its agent is the node's (the DaemonSet).
    assert [c["name"] for c in pod["containers"]] == ["server"]
    assert pool.service["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("gpu", ["H100", "L40S"])
def test_one_agent_per_gpu_node_sees_every_gpu_through_the_nvidia_runtime_class(gpu: str) -> None:
    manifests = _manifests([_site(gpu=gpu)], [_recipe("v")])
    daemon = manifests.agent
    assert daemon["kind"] == "DaemonSet"
    pod = daemon["spec"]["template"]["spec"]
    # Since GPU Operator 25.10 (CDI on) `nvidia` is no longer the default runtime: without the
    # class, NVIDIA_VISIBLE_DEVICES=all gives the container no GPU and NVML fails.
    assert pod["runtimeClassName"] == "nvidia"
    (agent,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    # It asks for no GPU: the device plugin would give it one of the replicas' GPUs only.
    assert not any(key.startswith("nvidia.com/") for key in agent["resources"]["limits"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    socket_dir = mounts["/var/lib/kubelet/pod-resources"]
    assert socket_dir["readOnly"] is True
    assert volumes[socket_dir["name"]]["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    assert agent["ports"] == [
        {"name": "agent", "containerPort": AGENT_PORT, "protocol": "TCP"},
        {"name": "pods", "containerPort": AGENT_PODS_PORT, "protocol": "TCP"},
    ]
    # On the nodes the replicas may land on, and only there.
    replica_pod = _pool(manifests, "v").stateful_set["spec"]["template"]["spec"]
    assert pod["affinity"] == replica_pod["affinity"]
    assert pod["tolerations"] == replica_pod["tolerations"]
    config = volumes["config"]["configMap"]["name"]
    assert config == manifests.agent_config["metadata"]["name"]
    selector = daemon["spec"]["selector"]["matchLabels"]
    assert manifests.agent_service["spec"]["selector"] == selector
    assert manifests.agent_service["spec"]["clusterIP"] == "None"


def test_every_agent_reads_one_config_naming_the_sites_replicas_by_pod() -> None:
    manifests = _manifests([_site()], [VOICE, SIDE])
    text = manifests.agent_config["data"]["agent.toml"]
    token_file = f'control_token_file = "{AGENT_RUN_DIR}/agent.token"'
    assert token_file in text
    config = parse_agent_config(text.replace(token_file, f'control_token = "{"t" * 32}"'))
    assert config.kubernetes == Kubernetes(
        "denv", "server", Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    )
    replicas = {r.id: r for r in config.replicas}
    assert sorted(replicas) == sorted(route.replica_id for route in manifests.routes)
    voice = replicas["voice.k8s.node-1.0"]
    assert (voice.pod, voice.gpu, voice.mig_uuid) == ("voice-1", None, None)
    assert voice.health_url == "http://voice-1.voice.denv.svc.cluster.local:8000/health"
    assert voice.probe is not None and voice.probe.ttft_budget_ms == 300
    side = replicas["side.k8s.node-2.1.0"]
    assert (side.pod, side.probe) == ("side-2", None)
    assert side.health_url == "http://side-2.side.denv.svc.cluster.local:8100/health"


def test_the_gateway_relays_each_agent_check_to_the_agent_that_knows_the_replica() -> None:
    manifests = _manifests([_site(max_nodes=3)], [VOICE, SIDE])
    config = manifests.gateway_config["data"]["haproxy.cfg"]
    # The agents' own answer for a replica of another node: the one the check filters out.
    assert AGENT_UNKNOWN.encode() + b"\n" == agentcheck.UNKNOWN
    for route in manifests.routes:
        backend = config.split(f"backend agent.{route.replica_id}\n")[1].split("\n\n")[0]
        assert f'tcp-check send "{route.replica_id}\\n"' in backend
        assert f'tcp-check expect ! string "{AGENT_UNKNOWN}"' in backend
        # Every node's agent may hold it: 3 planning nodes of 8 GPUs, one GPU a node at most.
        assert "server-template agent 1-24 denv-agent.denv.svc.cluster.local:" in backend
        assert route.pod_host not in backend


def test_replica_ports_take_traffic_only_from_gateway_and_agent_pods_agents_from_gateway() -> None:
    manifests = _manifests([_site()], [VOICE, SIDE])
    spec = manifests.network_policy["spec"]
    assert spec["podSelector"]["matchLabels"] == {"denv/role": "replica", "denv/site": "k8s"}
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    gateway_pods = manifests.gateway["spec"]["template"]["metadata"]["labels"]
    agent_pods = manifests.agent["spec"]["template"]["metadata"]["labels"]
    gateway, agents = (source["podSelector"]["matchLabels"] for source in rule["from"])
    assert gateway.items() <= gateway_pods.items() and gateway["denv/role"] == "gateway"
    assert agents.items() <= agent_pods.items() and agents["denv/role"] == "agent"
    assert sorted(p["port"] for p in rule["ports"]) == [8000, 8100]
    spec = manifests.agent_network_policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= agent_pods.items()
    # Agent checks from the gateway alone; the pod endpoints from the site's replica pods alone.
    sources = [
        ([source["podSelector"]["matchLabels"] for source in rule["from"]], rule["ports"])
        for rule in spec["ingress"]
    ]
    replica_pods = {"denv/role": "replica", "denv/site": "k8s"}
    assert sources == [
        ([gateway], [{"protocol": "TCP", "port": AGENT_PORT}]),
        ([replica_pods], [{"protocol": "TCP", "port": AGENT_PODS_PORT}]),
    ]


def test_each_node_service_relays_its_replicas_ports_to_their_own_listeners() -> None:
    manifests = _manifests([_site()], [VOICE, SIDE])
    assert sorted(manifests.node_services) == ["node-0", "node-1", "node-2"]
    listeners = [route.listen_port for route in manifests.routes]
    assert len(set(listeners)) == len(listeners) == 6
    config = manifests.gateway_config["data"]["haproxy.cfg"]
    for route in manifests.routes:
        service = manifests.node_services[route.node]["spec"]
        assert service["type"] == "LoadBalancer"
        ports = {p["port"]: p["targetPort"] for p in service["ports"]}
        assert ports[route.service_port] == route.listen_port
        assert ports[AGENT_PORT] == AGENT_PORT
        assert f"bind :{route.listen_port} ssl " in config
        assert f"{route.pod_host}:{route.pod_port}" in config
        assert f'-m str "{route.replica_id}\\n"' in config
    node_1 = [r for r in manifests.routes if r.node == "node-1"]
    assert {r.listen_port for r in node_1} == {GATEWAY_PORT_BASE + 64, GATEWAY_PORT_BASE + 72}


def test_raising_min_warm_keeps_every_existing_route() -> None:
    before = _manifests([_site()], [VOICE]).routes
    after = _manifests([_site()], [{**VOICE, "min_warm": 3}]).routes
    assert set(before) < set(after)
    assert len(after) == len(before) + 1


@pytest.mark.parametrize(
    "site, recipes, problem",
    [
        (_site(), [VOICE], None),
        (
            _site(),
            [{k: v for k, v in VOICE.items() if k != "image"}],
            "recipes[0].image: missing; a kubernetes site (k8s) runs the model server as a "
            "container: add image: vllm/vllm-openai:v0.11.0",
        ),
        (
            _site(max_nodes=1000, gpus_per_node=8),
            [VOICE],
            "sites: k8s.max_nodes: 1000 nodes of 8 GPUs need gateway ports up to 73999; keep "
            "max_nodes x gpus_per_node at most 6942",
        ),
        (
            _site(),
            [{**VOICE, "env": {"DENV_POD": "x"}}],
            "recipes[0].env.DENV_POD: the pod's own name on a kubernetes site (k8s), which its "
            "hooks read: remove it from env",
        ),
        (_site(), [{**VOICE, "env": {"DENV_POD": "x"}, "sites": ["edge"]}], None),
    ],
)
def test_site_problems(site: dict[str, Any], recipes: list[Any], problem: str | None) -> None:
    stack = read_stack(
        "prod",
        {"denv:sites": [site, EDGE], "denv:recipes": recipes, "denv:balancer": {"sites": ["edge"]}},
    )
    assert site_problems(stack.site("k8s"), stack.recipes) == ([problem] if problem else [])


def test_every_catalog_gpu_has_its_own_product_labels() -> None:
    assert sorted(GPU_PRODUCTS) == sorted(load_catalog().gpus)
    labels = [label for products in GPU_PRODUCTS.values() for label in products]
    assert len(labels) == len(set(labels)), "a product label claimed by two catalog models"


@pytest.mark.parametrize(
    "gpu, product, matched",
    [
        ("H100", "NVIDIA-H100-80GB-HBM3", True),
        ("H100", "NVIDIA-H100-PCIe", True),
        # 94 GB and 1g.12gb slices: a 1g.10gb replica or an 80 GB placement would be wrong there.
        ("H100", "NVIDIA-H100-NVL", False),
        ("H200", "NVIDIA-H200", True),
        ("H200", "NVIDIA-H200-NVL", False),
        ("H200-NVL", "NVIDIA-H200-NVL", True),
        ("H200-NVL", "NVIDIA-H200", False),
        ("B300", "NVIDIA-B300-SXM6-AC", True),
        ("B200", "NVIDIA-B300-SXM6-AC", False),
        (
            "RTX-PRO-6000-BLACKWELL-MAXQ",
            "NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-Workstation-Edition",
            True,
        ),
        ("RTX-PRO-6000-BLACKWELL-MAXQ", "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", False),
        ("A100-80GB", "NVIDIA-A100-SXM4-80GB", True),
        ("A100-80GB", "NVIDIA-A100-SXM4-40GB", False),
        ("L40S", "NVIDIA-L40", False),
    ],
)
def test_replicas_land_only_on_their_catalog_models_cards(
    gpu: str, product: str, matched: bool
) -> None:
    manifests = _manifests([_site(gpu=gpu, gpus_per_node=1)], [_recipe("v", spare=0)])
    pod = _pool(manifests, "v").stateful_set["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (expression,) = terms["nodeSelectorTerms"][0]["matchExpressions"]
    assert (expression["key"], expression["operator"]) == ("nvidia.com/gpu.product", "In")
    assert (product in expression["values"]) is matched


@pytest.mark.parametrize("private_links", [True, False], ids=["tls", "plain"])
def test_a_plain_link_to_a_used_kubernetes_site_is_warned_about(private_links: bool) -> None:
    balancer = {"sites": ["edge"], "overlay": {"enabled": private_links}}
    stack = read_stack(
        "prod", {"denv:sites": [_site(), EDGE], "denv:recipes": [VOICE], "denv:balancer": balancer}
    )
    warned = [w for w in stack_warnings(stack) if "gateway" in w]
    assert warned == (
        []
        if private_links
        else [
            "balancer.overlay.enabled: false also sends prompts, streams and agent checks to the "
            "gateway of k8s in plain TCP; turn it back on (mutual TLS to the gateway) unless the "
            "cluster shares one private network with the balancer"
        ]
    )


def _pod_specs(manifests: SiteManifests) -> list[dict[str, Any]]:
    return [
        m["spec"]["template"]["spec"]
        for m in manifests.objects()
        if m["kind"] in ("DaemonSet", "Deployment", "StatefulSet")
    ]


def test_the_namespace_admits_the_agents_host_path_whatever_the_clusters_default() -> None:
    # Pod Security baseline (and restricted) forbid hostPath volumes: a cluster enforcing either
    # by default would refuse the agent, which reads the kubelet's pod-resources socket.
    manifests = _manifests([_site()], [VOICE, SIDE])
    host_paths = [
        v["hostPath"]["path"]
        for p in _pod_specs(manifests)
        for v in p.get("volumes", ())
        if "hostPath" in v
    ]
    assert host_paths  # the reason for the level
    labels = manifests.namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


@pytest.mark.parametrize(
    ("recipes", "strategy", "warned"),
    [([VOICE, SIDE], None, True), ([VOICE], None, False), ([VOICE, SIDE], "mixed", False)],
    ids=["mig-unstated", "no-mig", "mig-mixed"],
)
def test_a_mig_recipe_on_a_kubernetes_site_names_the_operators_mig_strategy(
    recipes: list[Any], strategy: str | None, warned: bool
) -> None:
    balancer = {"sites": ["edge"]}
    site = _site() if strategy is None else _site(mig_strategy=strategy)
    stack = read_stack(
        "prod", {"denv:sites": [site, EDGE], "denv:recipes": recipes, "denv:balancer": balancer}
    )
    lines = [w for w in stack_warnings(stack) if "mig.strategy" in w]
    assert lines == (
        [
            "recipes[1].share: 1g.10gb on k8s needs the GPU operator's mixed MIG strategy (its "
            "default, single, never offers nvidia.com/mig-1g.10gb and the pods stay Pending); "
            "install it with --set mig.strategy=mixed and set the site's mig_strategy: mixed"
        ]
        if warned
        else []
    )


def test_a_mig_recipe_on_a_site_whose_operator_runs_the_single_strategy_is_refused() -> None:
    config = {
        "denv:sites": [_site(mig_strategy="single"), EDGE],
        "denv:recipes": [VOICE, SIDE],
        "denv:balancer": {"sites": ["edge"]},
    }
    with pytest.raises(StackError) as refused:
        read_stack("prod", config)
    assert refused.value.problems == [
        'recipes[1].gpu: MIG profile "1g.10gb" on site k8s, whose GPU operator runs the single'
        " MIG strategy: it never offers nvidia.com/mig-1g.10gb, so the pods would stay Pending;"
        " reinstall the operator with --set mig.strategy=mixed and set mig_strategy: mixed, or"
        " use a whole GPU"
    ]


def test_a_mig_strategy_outside_the_operators_is_refused() -> None:
    config = {
        "denv:sites": [_site(mig_strategy="mixd"), EDGE],
        "denv:recipes": [VOICE],
        "denv:balancer": {"sites": ["edge"]},
    }
    with pytest.raises(StackError) as refused:
        read_stack("prod", config)
    assert refused.value.problems == ['sites[0].mig_strategy: "mixd" is not one of mixed, single']
