"""KubernetesSite under Pulumi's mocks, at `up` and at preview: what it registers, and how."""

import copy
import json
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from denv_iac.components.preview import SECRET_MARK, SECRET_SIG, shown
from denv_iac.core.balancer.model import RenderedConfig
from denv_iac.core.ingress import AGENT_PORT
from denv_iac.core.kube_manifests.agent import AGENT_PODS_PORT
from denv_iac.core.stack.reader import StackError
from denv_iac.haproxy import check_haproxy_config
from tests.components import stacks
from tests.components.harness import Run, cluster_outputs, plain_strings, run_program, waits_for
from tests.gateway_pki import reading_tls_from, write_pki

PREVIEW = pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
GOLDEN = Path(__file__).parent / "golden" / "k8s.json"
KUBERNETES_VERSION = "1.37.0"
SITE = "prod-k8s-use1"
PROVIDER = "pulumi:providers:kubernetes"
KUBECONFIG = (
    "apiVersion: v1\nclusters:\n- cluster:\n    server: https://k8s.example\n"
    "users:\n- name: ci\n  user:\n    token: KUBE-TOKEN-MATERIAL\n"
)
IMAGE = "vllm/vllm-openai:v0.11.0"


def k8s_args() -> Any:
    """Voice on whole H100s and a side model on MIG slices, in a cluster; the balancer on hcloud."""
    return copy.deepcopy(
        {
            "sites": [
                {
                    "name": "k8s-use1",
                    "kind": "kubernetes",
                    "kubeconfig": {"secure": KUBECONFIG},
                    "gpu": "H100",
                    "gpus_per_node": 8,
                    "max_nodes": 6,
                    "cache_size_gb": 800,
                },
                {
                    "name": "hetzner-fsn",
                    "kind": "hetzner",
                    "admin_cidrs": [stacks.ADMIN],
                    "ssh_private_key": {"secure": stacks.SSH_KEYS["hetzner-fsn"]},
                    "nodes": [
                        {"name": "gex-1", "address": "203.0.113.21", "server_model": "GEX44"}
                    ],
                },
            ],
            "recipes": [
                {
                    "name": "voice",
                    "min_warm": 2,
                    "spare": 1,
                    "sites": ["k8s-use1"],
                    "image": IMAGE,
                    "cold_start_budget_s": 1200,
                },
                {
                    "name": "side",
                    "gpu": "1g.10gb",
                    "min_warm": 1,
                    "spare": 1,
                    "port": 8100,
                    "sites": ["k8s-use1"],
                    "image": IMAGE,
                },
            ],
            "balancer": {"sites": ["hetzner-fsn"], "port": 443},
        }
    )


def _run(preview: bool, args: Any = None) -> Run:
    return run_program(lambda: cluster_outputs(args or k8s_args()), preview=preview)


def _kube(run: Run) -> list[Any]:
    return [r for r in run.registrations if r.type.startswith("kubernetes:")]


def _whole_numbers(value: Any) -> Any:
    """Registered inputs went through protobuf, where every number is a float."""
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _ports(value: Any) -> list[Any]:
    """Every port number an object names, at any depth."""
    if isinstance(value, dict):
        found = [v for k, v in value.items() if k in ("port", "containerPort", "targetPort")]
        return found + [p for v in value.values() for p in _ports(v)]
    if isinstance(value, list):
        return [p for v in value for p in _ports(v)]
    return []


def _manifest(inputs: dict[str, Any]) -> dict[str, Any]:
    return _whole_numbers(shown(inputs))  # type: ignore[no-any-return]


def _revealed(value: Any) -> Any:
    """Serialized inputs with each secret's value in its place, as the cluster receives them."""
    if isinstance(value, dict):
        if value.get(SECRET_SIG) == SECRET_MARK:
            return _revealed(value.get("value"))
        return {k: _revealed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_revealed(v) for v in value]
    return value


@PREVIEW
def test_site_registers_its_objects_through_the_kubeconfig_provider(preview: bool) -> None:
    run = _run(preview)
    (site,) = [r for r in run.registrations if r.type == "denv:index:KubernetesSite"]
    assert site.name == SITE
    (provider,) = run.of_type(PROVIDER)
    assert provider.parent == site.urn
    kinds = sorted((r.type.split(":")[-1], r.inputs["metadata"]["name"]) for r in _kube(run))
    assert kinds == [
        ("ConfigMap", "denv-agent"),
        ("ConfigMap", "denv-gateway"),
        ("DaemonSet", "denv-agent"),
        ("Deployment", "denv-gateway"),
        ("Namespace", "denv"),
        ("NetworkPolicy", "denv-agents-from-gateway"),
        ("NetworkPolicy", "denv-replicas-from-gateway"),
        ("PodDisruptionBudget", "denv-gateway"),
        ("PodDisruptionBudget", "side"),
        ("PodDisruptionBudget", "voice"),
        ("Secret", "denv-gateway-tls"),
        ("Service", "denv-agent"),
        ("Service", "denv-agent-local"),
        ("Service", "denv-gateway-node-0"),
        ("Service", "denv-gateway-node-1"),
        ("Service", "denv-gateway-node-2"),
        ("Service", "side"),
        ("Service", "voice"),
        ("StatefulSet", "side"),
        ("StatefulSet", "voice"),
    ]
    for registration in _kube(run):
        assert registration.parent == site.urn, registration.name
        assert registration.provider.startswith(provider.urn), registration.name


@PREVIEW
def test_every_registered_object_is_valid_kubernetes(preview: bool) -> None:
    for registration in _kube(_run(preview)):
        # Secrets' data as the cluster gets it: its schema is checked too.
        manifest = _whole_numbers(_revealed(registration.inputs))
        assert manifest["kind"] == registration.type.split(":")[-1]
        try:
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{registration.name}: {error.message} at {list(error.absolute_path)}")


def test_stateful_sets_hold_the_placed_replicas_on_their_gpu_shares() -> None:
    run = _run(preview=False)
    voice = _manifest(run.named(f"{SITE}-statefulset-voice").inputs)["spec"]
    side = _manifest(run.named(f"{SITE}-statefulset-side").inputs)["spec"]
    assert (voice["replicas"], side["replicas"]) == (3, 2)
    servers = [s["template"]["spec"]["containers"][0] for s in (voice, side)]
    assert [c["resources"]["limits"] for c in servers] == [
        {"nvidia.com/gpu": "1"},
        {"nvidia.com/mig-1g.10gb": "1"},
    ]
    assert [c["startupProbe"]["failureThreshold"] for c in servers] == [120, 90]
    budgets = [run.named(f"{SITE}-poddisruptionbudget-{p}").inputs for p in ("voice", "side")]
    assert [b["spec"]["minAvailable"] for b in budgets] == [2, 1]


def test_the_golden_snapshot_of_registered_inputs() -> None:
    run = _run(preview=False)
    # The site and what it holds: the other sites and the balancer have goldens of their own.
    # Secrets masked as a preview shows them (the kubeconfig, the gateway's key).
    snapshot = {
        r.urn: {"inputs": shown(r.inputs), "ignore_changes": list(r.ignore_changes)}
        for r in sorted(run.registrations, key=lambda r: r.urn)
        if "denv:index:KubernetesSite" in r.urn
    }
    text = json.dumps(snapshot, indent=1, sort_keys=True) + "\n"
    if os.environ.get("DENV_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "registrations changed: DENV_UPDATE_GOLDEN=1 to accept it"


@PREVIEW
def test_two_runs_register_identical_inputs(preview: bool) -> None:
    first, second = _run(preview), _run(preview)
    assert _kube(first)
    assert first.by_urn() == second.by_urn()


def test_raising_min_warm_changes_only_the_pool_and_the_gateway() -> None:
    before = _run(preview=False).by_urn()
    raised = k8s_args()
    raised["recipes"][0]["min_warm"] = 3
    after = _run(False, raised).by_urn()
    assert set(before) <= set(after)
    changed = sorted(
        urn.rsplit("::", 1)[-1] for urn in after if urn in before and after[urn] != before[urn]
    )
    added = sorted(urn.rsplit("::", 1)[-1] for urn in set(after) - set(before))
    gateway = [f"{SITE}-configmap-denv-gateway", f"{SITE}-deployment-denv-gateway"]
    # every node's agent reads the site's replica list: their config, and so their pods, change
    agents = [f"{SITE}-configmap-denv-agent", f"{SITE}-daemonset-denv-agent"]
    pool = [*agents, f"{SITE}-poddisruptionbudget-voice"]
    site_changes = [name for name in changed if name.startswith(SITE)]
    assert site_changes == sorted([*gateway, *pool, f"{SITE}-statefulset-voice"])
    # elsewhere, only the global balancer may change (its config lists the new replica)
    assert all(name.startswith("prod-balancer") for name in changed if name not in site_changes)
    # the new replica's planning node gets its gateway address
    assert added == [f"{SITE}-service-denv-gateway-node-3"]
    urns = {urn.rsplit("::", 1)[-1]: urn for urn in after}
    assert after[urns[f"{SITE}-statefulset-voice"]]["spec"]["replicas"] == 4
    # the gateway's pods roll only because their config changed
    deployment = urns[f"{SITE}-deployment-denv-gateway"]
    old, new = before[deployment]["spec"], after[deployment]["spec"]
    assert old["template"]["spec"] == new["template"]["spec"]
    assert {**old, "template": None} == {**new, "template": None}


@PREVIEW
def test_the_kubeconfig_is_a_secret_and_never_in_plaintext(preview: bool) -> None:
    run = _run(preview)
    material = [line.strip() for line in KUBECONFIG.splitlines() if "TOKEN" in line]
    assert material
    for registration in run.registrations:
        strings = plain_strings(registration.inputs)
        assert not any(m in s for m in material for s in strings), registration.name
    (provider,) = run.of_type(PROVIDER)
    assert shown(provider.inputs)["kubeconfig"] == "[secret]"


def test_replica_and_agent_ports_open_only_to_gateway_pods_and_the_gateway_to_balancers() -> None:
    run = _run(preview=False)
    policy = _manifest(run.named(f"{SITE}-networkpolicy-denv-replicas-from-gateway").inputs)
    gateway = _manifest(run.named(f"{SITE}-deployment-denv-gateway").inputs)
    agent = _manifest(run.named(f"{SITE}-daemonset-denv-agent").inputs)
    replica_pods = [
        _manifest(run.named(f"{SITE}-statefulset-{p}").inputs)["spec"]["template"]["metadata"]
        for p in ("voice", "side")
    ]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert all(selector.items() <= pod["labels"].items() for pod in replica_pods)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    gateway_pods = gateway["spec"]["template"]["metadata"]["labels"]
    agent_pods = agent["spec"]["template"]["metadata"]["labels"]
    sources = [source["podSelector"]["matchLabels"] for source in rule["from"]]
    assert all(set(source) == {"podSelector"} for source in rule["from"])
    assert [s.items() <= gateway_pods.items() for s in sources] == [True, False]
    assert [s.items() <= agent_pods.items() for s in sources] == [False, True]
    assert not any(s.items() <= p["labels"].items() for s in sources for p in replica_pods)
    assert sorted(p["port"] for p in rule["ports"]) == [8000, 8100]
    agents = _manifest(run.named(f"{SITE}-networkpolicy-denv-agents-from-gateway").inputs)
    assert agents["spec"]["podSelector"]["matchLabels"].items() <= agent_pods.items()
    # Agent checks from the gateway; the pod endpoints (readiness, preStop drain) from the
    # site's replica pods, which ask their own node's agent.
    checks, hooks = agents["spec"]["ingress"]
    (source,) = checks["from"]
    assert source["podSelector"]["matchLabels"] == sources[0]
    assert [p["port"] for p in checks["ports"]] == [AGENT_PORT]
    (source,) = hooks["from"]
    assert all(
        source["podSelector"]["matchLabels"].items() <= p["labels"].items() for p in replica_pods
    )
    assert [p["port"] for p in hooks["ports"]] == [AGENT_PODS_PORT]
    # SSH does not exist here: no object opens or forwards port 22
    assert 22 not in {port for r in _kube(run) for port in _ports(_manifest(r.inputs))}
    hosts = [f"{address}/32" for address in run.outputs["balancer_addresses"]]
    for node in ("node-0", "node-1", "node-2"):
        service = run.named(f"{SITE}-service-denv-gateway-{node}").inputs["spec"]
        assert service["type"] == "LoadBalancer"
        assert service["loadBalancerSourceRanges"] == hosts


def test_balancer_reaches_each_replica_at_its_nodes_gateway_address() -> None:
    run = _run(preview=False)
    config = run.outputs["haproxy_config"]
    services = {
        r.inputs["metadata"]["labels"]["denv/node"]: r
        for r in run.of_type("kubernetes:core/v1:Service")
        if "denv/node" in r.inputs["metadata"]["labels"]
    }
    addresses = {}
    for node, service in services.items():
        line = next(x for x in config.splitlines() if f"server voice.k8s-use1.{node}.0 " in x)
        address = line.split()[2].rsplit(":", 1)[0]
        ports = {p["port"] for p in service.inputs["spec"]["ports"]}
        assert int(line.split()[2].rsplit(":", 1)[1]) in ports
        # Its agent checks go to the relay that carries them over TLS to the same gateway.
        relay = line.split(" agent-addr 127.0.0.1 agent-port ")[1].split()[0]
        listen = config.split(f"listen denv.agent-relay.{relay}\n")[1].split("\n\n")[0]
        assert f"bind 127.0.0.1:{relay}\n    server gateway {address}:{AGENT_PORT} ssl " in listen
        addresses[node] = address
    assert len(set(addresses.values())) == 3


@pytest.mark.needs_haproxy
def test_gateway_config_passes_haproxy_check(tmp_path: Path) -> None:
    config_map = _run(preview=False).named(f"{SITE}-configmap-denv-gateway")
    pki = write_pki(tmp_path / "tls", "k8s-use1")
    config = reading_tls_from(config_map.inputs["data"]["haproxy.cfg"], pki.folder)
    check_haproxy_config(RenderedConfig(config), tmp_path / "check")


def _bad(args: Any) -> tuple[list[str], Run]:
    run = Run()
    with pytest.raises(StackError) as error:
        run_program(lambda: cluster_outputs(args), preview=False, run=run)
    return error.value.problems, run


def _without_kubeconfig() -> Any:
    args = k8s_args()
    del args["sites"][0]["kubeconfig"]
    return args


def _mig_on_l40s() -> Any:
    args = k8s_args()
    args["sites"][0]["gpu"] = "L40S"
    return args


def _plain_kubeconfig() -> Any:
    args = k8s_args()
    args["sites"][0]["kubeconfig"] = KUBECONFIG
    return args


@pytest.mark.parametrize(
    "args, problem",
    [
        (
            _without_kubeconfig(),
            "sites[0].kubeconfig: missing; set it with 'pulumi config set --secret' "
            "(see docs/stacks.md)",
        ),
        (
            _mig_on_l40s(),
            'recipes[1].gpu: MIG profile "1g.10gb" does not exist on L40S (L40S has no MIG, '
            "site k8s-use1); use a whole GPU",
        ),
        (
            _plain_kubeconfig(),
            "sites[0].kubeconfig: must be a Pulumi secret, never plain text; set it with "
            "'pulumi config set --secret' (see docs/stacks.md)",
        ),
    ],
    ids=["no kubeconfig", "MIG on L40S", "plain kubeconfig"],
)
def test_bad_input_is_one_line_and_registers_nothing(args: Any, problem: str) -> None:
    problems, run = _bad(args)
    assert problems == [problem]
    assert run.registrations == []


def test_a_recipe_without_an_image_is_refused_before_any_kubernetes_object() -> None:
    args = k8s_args()
    del args["recipes"][0]["image"]
    problems, run = _bad(args)
    assert problems == [
        "recipes[0].image: missing; a kubernetes site (k8s-use1) runs the model server as a "
        "container: add image: vllm/vllm-openai:v0.11.0"
    ]
    assert [r for r in run.registrations if r.name.startswith(SITE)] == []


GATEWAY_TLS = "pulumi-python:dynamic/denv:GatewayTls"


@PREVIEW
def test_the_gateway_secret_carries_the_sites_certificate_and_key_as_a_secret(
    preview: bool,
) -> None:
    run = _run(preview)
    (tls,) = run.of_type(GATEWAY_TLS)
    assert tls.name == "prod-gateway-tls" and tls.parent.endswith("::prod")
    assert tls.inputs["sites"] == ["k8s-use1"]
    # Every key's slot is a secret from the first registration: masked at preview too.
    inputs = shown(tls.inputs)
    assert [inputs[k] for k in ("ca_key", "client_pem", "gateway_pems")] == ["[secret]"] * 3
    secret = run.named(f"{SITE}-secret-denv-gateway-tls")
    assert secret.type == "kubernetes:core/v1:Secret" and secret.parent.endswith(SITE)
    assert shown(secret.inputs)["stringData"] == "[secret]"
    assert _revealed(secret.inputs)["stringData"] == {
        "ca.pem": "(the gateway CA of prod-gateway-tls)",
        "gateway.pem": "(the gateway certificate and key of k8s-use1)",
    }
    # The balancer host's deploy gets the CA and its client certificate and key, a secret.
    deployments = run.of_type("pulumi-python:dynamic/denv:NodeDeployment")
    (setup,) = [r for r in deployments if "balancer" in r.inputs]
    assert shown(setup.inputs)["gateway_tls"] == "[secret]"
    assert _revealed(setup.inputs)["gateway_tls"] == {
        "ca": "(the gateway CA of prod-gateway-tls)",
        "client": "(the balancer's client certificate and key)",
    }
    # No key shows outside a secret, anywhere.
    keys = ("certificate and key",)
    for registration in run.registrations:
        assert not [s for s in plain_strings(registration.inputs) if any(k in s for k in keys)]


def test_the_balancer_reaches_gateways_over_mutual_tls_named_by_site() -> None:
    config = _run(preview=False).outputs["haproxy_config"]
    servers = [line for line in config.splitlines() if "server voice.k8s-use1." in line]
    assert servers
    tls = (
        "ssl verify required ca-file /etc/haproxy/denv/gateway-ca.pem"
        " crt /etc/haproxy/denv/gateway-client.pem ssl-min-ver TLSv1.3"
        " sni str(gateway.k8s-use1.denv.internal) check-sni gateway.k8s-use1.denv.internal"
        " verifyhost gateway.k8s-use1.denv.internal"
    )
    assert all(tls in line for line in servers)


def test_a_plain_link_registers_no_ca_and_no_gateway_secret() -> None:
    args = k8s_args()
    args["balancer"]["overlay"] = {"enabled": False}
    run = _run(False, args)
    assert not run.of_type(GATEWAY_TLS)
    assert not [r for r in run.registrations if r.name.endswith("denv-gateway-tls")]
    assert " ssl " not in run.outputs["haproxy_config"]


def _two_clusters_and_a_node() -> Any:
    """Voice over two clusters and a Hetzner box between them (in the sites' order); side on the
    first cluster alone."""
    args = k8s_args()
    first, box = args["sites"]
    first["max_nodes"] = 2
    second = {**copy.deepcopy(first), "name": "k8s-usw2", "namespace": "denv-b"}
    args["sites"] = [first, box, second]
    voice, side = args["recipes"]
    voice["sites"], voice["min_warm"] = ["k8s-use1", "hetzner-fsn", "k8s-usw2"], 4
    side["min_warm"] = 1
    return args


def _waits(run: Run) -> dict[str, set[str]]:
    return {r.urn: set(r.dependencies) for r in run.registrations}


@PREVIEW
def test_a_pool_rolls_through_its_clusters_and_nodes_one_after_another(preview: bool) -> None:
    run = _run(preview, _two_clusters_and_a_node())
    sets = {
        (r.name.split("-statefulset-")[0], r.inputs["metadata"]["labels"]["denv/pool"]): r
        for r in run.of_type("kubernetes:apps/v1:StatefulSet")
    }
    assert set(sets) == {
        ("prod-k8s-use1", "voice"),
        ("prod-k8s-use1", "side"),
        ("prod-k8s-usw2", "voice"),
    }
    (box,) = [
        r.urn
        for r in run.of_type("pulumi-python:dynamic/denv:NodeDeployment")
        if r.name == "prod-hetzner-fsn-gex-1-setup-deploy"
    ]
    first, second = sets["prod-k8s-use1", "voice"].urn, sets["prod-k8s-usw2", "voice"].urn
    waits = _waits(run)
    # The sites' order: the first cluster, then the box, then the second cluster, each waiting
    # on the one before it directly (the provider awaits a StatefulSet's rollout).
    assert first in waits[box]
    assert box in waits[second]
    assert waits_for(run, first, second)
    # Side shares no unit with voice: it rolls beside it, and nothing orders voice after it.
    side = sets["prod-k8s-use1", "side"].urn
    for urn in (first, box, second):
        assert not waits_for(run, side, urn) and not waits_for(run, urn, side)
    # Each StatefulSet is awaited as long as its rollout may take, past the provider's 10 min.
    for (_, pool), stateful_set in sets.items():
        timeouts = stateful_set.custom_timeouts
        assert timeouts["create"] == timeouts["update"], pool
        assert int(timeouts["update"].removesuffix("s")) > 900 + 600, pool


def test_one_cluster_serving_a_pool_waits_on_nothing() -> None:
    run = _run(False)
    waits = _waits(run)
    namespace = next(r.urn for r in run.of_type("kubernetes:core/v1:Namespace"))
    for stateful_set in run.of_type("kubernetes:apps/v1:StatefulSet"):
        assert waits[stateful_set.urn] == {namespace}, stateful_set.name
