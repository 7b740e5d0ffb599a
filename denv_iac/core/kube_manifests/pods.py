"""A kubernetes site's replica pods: one StatefulSet per pool (its server container, the
readiness and preStop hooks that ask the pod's own node's agent), its headless Service and
disruption budget, how fast it may roll and how long `pulumi up` waits for it, and who may
reach its ports."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from denv_iac.core.balancer.gateway import (
    gateway_rejoin_ms,
)
from denv_iac.core.balancer.tiers import rejoin_s
from denv_iac.core.drain import drain_plan
from denv_iac.core.endpoint import balancer_settings
from denv_iac.core.kube_manifests.agent import agent_pods_url
from denv_iac.core.kube_manifests.objects import (
    SERVER_CONTAINER,
    Manifest,
    agent_labels,
    disruption_budget,
    gateway_labels,
    gpu_node_affinity,
    http_probe,
    kube_object,
    object_meta,
    pod_selector,
    replica_labels,
    replica_pods,
    site_labels,
)
from denv_iac.core.placement import PlacedReplica
from denv_iac.core.scripts import script
from denv_iac.core.stack.command import ANY_ADDRESS, render_command
from denv_iac.core.stack.model import SERVER_STOP_S, RecipeSpec, SiteSpec, StackSpec

# The replica pod's own name, given to its hooks by the downward API.
POD_NAME_ENV = "DENV_POD"
# How often the warm readiness is asked, how long one answer may take (python3's start-up
# included), and how many misses make a ready pod unready.
READY_PERIOD_S = 10
READY_TIMEOUT_S = 5
READY_FAILURES = 3
CACHE_VOLUME = "cache"
STARTUP_PERIOD_S = 10


@dataclass(frozen=True)
class PoolManifests:
    pool: str
    stateful_set: Manifest
    service: Manifest  # headless: gives each pod its stable DNS name
    disruption_budget: Manifest
    # The recipe's `secure:` env values, without them: the component fills `stringData` with
    # the secrets themselves, so no manifest or preview of the StatefulSet ever holds one.
    env_secret: Manifest | None
    # How long `pulumi up` waits for the StatefulSet's rollout (see rollout_timeout_s).
    rollout_timeout_s: int


def gpu_resource(recipe: RecipeSpec) -> str:
    """The extended resource a replica asks for: a whole GPU, or one MIG device."""
    return f"nvidia.com/mig-{recipe.share}" if recipe.is_mig else "nvidia.com/gpu"


def startup_failure_threshold(recipe: RecipeSpec) -> int:
    """Probes every STARTUP_PERIOD_S, enough of them to cover the recipe's cold start."""
    return math.ceil(recipe.cold_start_budget_s / STARTUP_PERIOD_S)


def min_available(recipe: RecipeSpec, on_site: int) -> int:
    """The PodDisruptionBudget's minAvailable for `on_site` replicas of the pool here.

    A pool survives losing `spare` replicas, but each of its sites may be drained by its own
    operators at the same time: a site may give up only its proportional part of the spare,
    rounded down, so that all sites' allowances together never exceed it. At least one replica
    stays, even when that makes a drain wait, since an empty site means a cold start.
    """
    share = recipe.spare * on_site // recipe.replicas_wanted
    return max(1, on_site - share)


def max_unavailable(recipe: RecipeSpec, on_site: int) -> int:
    """How many of the pool's pods here a rollout may restart at once: the site's share of the
    spare (what the disruption budget lets go), and at least one, so that a rollout moves.
    The controller takes a pod down only once the one before it is ready again; above one it
    needs the MaxUnavailableStatefulSet feature, and one at a time without it."""
    return max(1, on_site - min_available(recipe, on_site))


def termination_grace_s(recipe: RecipeSpec) -> int:
    """How long a stopping pod may take: its sessions' drain bound, then the server's own stop
    (what `docker stop -t` gives it on a node)."""
    return recipe.drain_timeout_s + SERVER_STOP_S


# What a rollout takes beyond its pods' drains and cold starts: scheduling, pulling the image
# (the provider's own default bound for a whole StatefulSet).
ROLLOUT_SLACK_S = 600


def pod_rejoin_s(stack: StackSpec) -> int:
    """How long a pod that is warm again takes to be counted UP by the endpoint: first by its
    site's gateway, whose relay the endpoint's checks pass through, then by the endpoint."""
    return math.ceil(gateway_rejoin_ms() / 1000) + rejoin_s(balancer_settings(stack))


def rollout_timeout_s(recipe: RecipeSpec, on_site: int, rejoin: int) -> int:
    """How long `pulumi up` waits for a pool's StatefulSet here to finish a rollout before it
    fails the update: each wave of `max_unavailable` pods stops within its grace period, is
    warm within `cold_start_budget_s` and back in rotation within `rejoin` s (pod_rejoin_s),
    plus ROLLOUT_SLACK_S. The provider's default, 10
    minutes for the whole StatefulSet, is shorter than one default cold start (900 s): a
    healthy rollout would fail the update and stop the pool's later rollout units."""
    waves = math.ceil(on_site / max_unavailable(recipe, on_site))
    wave = termination_grace_s(recipe) + recipe.cold_start_budget_s + rejoin
    return waves * wave + ROLLOUT_SLACK_S


def env_secret_name(recipe: RecipeSpec) -> str:
    """The Secret that holds a recipe's `secure:` env values on a kubernetes site."""
    return f"{recipe.name}-env"


# A replica pod's hooks, run by python3 in the recipe's image (the engines' images have it; not
# every one has curl). Each asks the agent of the pod's own node (AGENT_LOCAL_NAME), never
# through a proxy the recipe's env may name. Arguments after the script: the pod's agent URL,
# then the hook's own.
# Readiness (data/scripts/pod_ready.py): exit 0 only on the agent's 200 (warm); its reason, or
# why it was not asked, is what the kubelet shows in the pod's events.
READY_HOOK = script("pod_ready.py")
# preStop (data/scripts/pod_stop.py): drain, then wait by the pod's drain plan (the one rule,
# denv_iac.core.drain, that nodes follow too): `settle` s for the balancers to hear the drain at
# their next agent check, then until no connection to the server's port carries work, `wait` s
# at most in all; past it, what is open is cut when the server stops. A connection quiet for
# `quiet` s (a balancer's idle pooled one) is not waited for. Arguments: url, port, wait,
# settle, hold, quiet.
STOP_HOOK = script("pod_stop.py")


def drain_settle_s(agent_inter_ms: int) -> float:
    """How long a stopping pod waits after its drain before it may stop with no connection open:
    the balancers ask the agent every `agent_inter_ms` through the gateway's relay, so two of
    their checks and a second for the relay, after which nothing new arrives."""
    return round(2 * agent_inter_ms / 1000 + 1, 3)


def ready_command(site: SiteSpec) -> list[str]:
    return ["python3", "-c", READY_HOOK, agent_pods_url(site)]


def stop_command(site: SiteSpec, recipe: RecipeSpec, agent_inter_ms: int) -> list[str]:
    """The preStop: drain, wait for the connections that carry work to end, by the recipe's
    drain plan; the agent holds the drain at most the grace period, by whose end the kubelet
    has stopped the pod."""
    plan = drain_plan([recipe], drain_settle_s(agent_inter_ms))
    hold = termination_grace_s(recipe)
    args = (recipe.port, plan.bound_s, float(plan.settle_s), hold, plan.quiet_s)
    return ["python3", "-c", STOP_HOOK, agent_pods_url(site), *(str(a) for a in args)]


def _server_container(recipe: RecipeSpec, site: SiteSpec, agent_inter_ms: int) -> Manifest:
    cache_env = {"HF_HOME": recipe.cache_dirs[0], "VLLM_CACHE_ROOT": recipe.cache_dirs[-1]}
    env: list[Manifest] = [{"name": k, "value": v} for k, v in recipe.env if k not in cache_env]
    env += [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": env_secret_name(recipe), "key": k}}}
        for k, _ in recipe.secret_env
        if k not in cache_env
    ]
    env += [{"name": k, "value": v} for k, v in cache_env.items()]
    env.append({"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    container: Manifest = {
        "name": SERVER_CONTAINER,
        "image": recipe.image,
        "ports": [{"name": "http", "containerPort": recipe.port, "protocol": "TCP"}],
        "env": env,
        "resources": {"limits": {gpu_resource(recipe): "1"}},
        "startupProbe": http_probe(
            recipe.health_path, "http", STARTUP_PERIOD_S, startup_failure_threshold(recipe)
        ),
        # Ready means warm, as the agent of the pod's node judges it: the server answers and,
        # where the recipe has a first-token probe, has streamed a first token. The rollout's
        # next pod, and the disruption budget, wait on it.
        "readinessProbe": {
            "exec": {"command": ready_command(site)},
            "periodSeconds": READY_PERIOD_S,
            "timeoutSeconds": READY_TIMEOUT_S,
            "failureThreshold": READY_FAILURES,
        },
        # Before the kubelet stops the server: drain it, let its calls end (scripts/pod_stop.py).
        "lifecycle": {"preStop": {"exec": {"command": stop_command(site, recipe, agent_inter_ms)}}},
        # One claim for every cache folder, each in its own sub-folder of it.
        "volumeMounts": [
            {"name": CACHE_VOLUME, "mountPath": path, "subPath": f"dir-{index}"}
            for index, path in enumerate(recipe.cache_dirs)
        ],
    }
    if recipe.command:
        # arguments to the image's entrypoint
        container["args"] = list(render_command(recipe.command, port=recipe.port, host=ANY_ADDRESS))
    return container


def pool_manifests(
    stack: StackSpec, site: SiteSpec, recipe: RecipeSpec, placed: Sequence[PlacedReplica]
) -> PoolManifests:
    labels = replica_labels(stack.name, site, recipe.name)
    selector = pod_selector(labels)
    pod_spec: Manifest = {
        "containers": [_server_container(recipe, site, stack.balancer.timers.agent_inter_ms)],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        # The placement spreads replicas over nodes so that one lost node costs at most
        # `spare`; the scheduler is asked for the same.
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": selector},
            }
        ],
        "affinity": gpu_node_affinity(site),
        "terminationGracePeriodSeconds": termination_grace_s(recipe),
    }
    stateful_set = kube_object(
        "apps/v1",
        "StatefulSet",
        object_meta(site, recipe.name, labels),
        spec={
            "serviceName": recipe.name,
            "replicas": len(placed),
            # Every replica cold-starts at once, not one after another.
            "podManagementPolicy": "Parallel",
            # A changed template rolls pod by pod, each ready before the next (see
            # max_unavailable); the cold start above is for scaling only.
            # A ready (warm) pod counts as available, letting the rollout take the next one,
            # only once the balancers count it UP again (as a node's roll waits `rejoin_s`).
            "minReadySeconds": pod_rejoin_s(stack),
            "updateStrategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": max_unavailable(recipe, len(placed))},
            },
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": CACHE_VOLUME, "labels": labels},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": f"{site.cache_size_gb}Gi"}},
                    },
                }
            ],
            # A replica scaled away and back, or replaced, finds its weights and kernels.
            "persistentVolumeClaimRetentionPolicy": {
                "whenDeleted": "Retain",
                "whenScaled": "Retain",
            },
        },
    )
    service = kube_object(
        "v1",
        "Service",
        object_meta(site, recipe.name, labels),
        spec={
            "clusterIP": "None",
            "selector": selector,
            # Starting pods get their DNS name too, so their agent can answer `starting`.
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": "http", "port": recipe.port, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    )
    budget = disruption_budget(
        stack.name, site, recipe.name, labels, min_available(recipe, len(placed))
    )
    env_secret = (
        kube_object(
            "v1", "Secret", object_meta(site, env_secret_name(recipe), labels), type="Opaque"
        )
        if recipe.secret_env
        else None
    )
    return PoolManifests(
        recipe.name,
        stateful_set,
        service,
        budget,
        env_secret,
        rollout_timeout_s(recipe, len(placed), pod_rejoin_s(stack)),
    )


def replica_network_policy(
    stack: str, site: SiteSpec, pools: list[str], spec: StackSpec
) -> Manifest:
    """Replica ports: the gateway relays requests there, the agents check health there."""
    ports = sorted({r.port for r in spec.recipes if r.name in pools})
    sources = [gateway_labels(stack, site), agent_labels(stack, site)]
    return kube_object(
        "networking.k8s.io/v1",
        "NetworkPolicy",
        object_meta(site, "denv-replicas-from-gateway", site_labels(stack, site, role="replica")),
        spec={
            "podSelector": {"matchLabels": replica_pods(site)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": pod_selector(s)}} for s in sources],
                    "ports": [{"protocol": "TCP", "port": port} for port in ports],
                }
            ],
        },
    )
