"""Every kind of bad stack gets its own one-line message naming the path and the fix."""

from collections.abc import Callable
from typing import Any

import pytest

from denv_iac.core.balancer import BalancerPool, BalancerTier
from denv_iac.core.balancer.haproxy import render_haproxy_config
from denv_iac.core.dataplane import balancer_pools
from denv_iac.core.endpoint import balancer_settings
from denv_iac.core.placement import place_replicas
from denv_iac.core.stack.model import AGENT_INTER_MS, MAX_CONCURRENCY, Secret, SimulatedServer
from denv_iac.core.stack.reader import StackError, read_stack
from tests.balancer.sample_pools import MAP_DIR, VOICE, server
from tests.stacks import SECRET, valid_config

Config = dict[str, Any]
KEY_A, KEY_B = "ab" * 32, "cd" * 32


def site(c: Config, i: int) -> dict[str, Any]:
    return c["denv:sites"][i]  # type: ignore[no-any-return]


def recipe(c: Config, i: int) -> dict[str, Any]:
    return c["denv:recipes"][i]  # type: ignore[no-any-return]


CASES: list[tuple[str, Callable[[Config], object], str]] = [
    (
        "unknown top key",
        lambda c: c.update({"denv:site": []}),
        "denv:site: unknown config key; use one of denv:sites, denv:recipes, denv:balancer",
    ),
    ("no sites", lambda c: c.pop("denv:sites"), "sites: missing; give a list"),
    (
        "empty recipes",
        lambda c: c.update({"denv:recipes": []}),
        "recipes: is empty; give at least one entry",
    ),
    (
        "site not a mapping",
        lambda c: c["denv:sites"].append("oops"),
        "sites[7]: expected a mapping of keys to values, got a string",
    ),
    (
        "bad kind",
        lambda c: site(c, 0).update(kind="gcp"),
        'sites[0].kind: "gcp" is not one of aws, lambda, nebius, hetzner, joined, '
        "kubernetes, local",
    ),
    (
        "typo key in site",
        lambda c: site(c, 1).update(max_node=3),
        'sites[1].max_node: unknown key; did you mean "max_nodes"?',
    ),
    (
        "bad site name",
        lambda c: site(c, 0).update(name="Local_1"),
        'sites[0].name: "Local_1" is not a valid name; use 1-40 lower-case letters, digits and '
        "'-', starting and ending with a letter or digit",
    ),
    (
        "duplicate site",
        lambda c: site(c, 1).update(name="local"),
        'sites: site name "local" is used twice; give each site its own name',
    ),
    (
        "duplicate node",
        lambda c: site(c, 0)["nodes"][1].update(name="node-a"),
        'sites[0].nodes: node name "node-a" is used twice; rename one',
    ),
    (
        "unknown gpu",
        lambda c: site(c, 0)["nodes"][0].update(gpu="H1000"),
        'sites[0].nodes[0].gpu: GPU model "H1000" is unknown; use one of A10, A100-40GB, '
        "A100-80GB, A10G, A30, B200, B300, H100, H200, H200-NVL, L4, L40S, RTX-4000-SFF-ADA, "
        "RTX-6000-ADA, RTX-PRO-4000-SFF-BLACKWELL, RTX-PRO-6000-BLACKWELL-MAXQ",
    ),
    (
        "gpus zero",
        lambda c: site(c, 0)["nodes"][0].update(gpus=0),
        "sites[0].nodes[0].gpus: 0 is out of range; use a number from 1 to 16",
    ),
    (
        "gpus not int",
        lambda c: site(c, 0)["nodes"][0].update(gpus="two"),
        "sites[0].nodes[0].gpus: expected a whole number, got a string",
    ),
    (
        "unknown instance type",
        lambda c: site(c, 1).update(instance_type="p9.48xlarge"),
        'sites[1].instance_type: "p9.48xlarge" is not a GPU offering we know on aws; use one of '
        "g5.12xlarge, g5.48xlarge, g5.xlarge, g6.12xlarge, g6.48xlarge, g6.xlarge, g6e.12xlarge, "
        "g6e.48xlarge, g6e.xlarge, p4d.24xlarge, p4de.24xlarge, p5.48xlarge, p5.4xlarge, "
        "p5e.48xlarge, p5en.48xlarge, p6-b200.48xlarge",
    ),
    (
        "max_nodes missing",
        lambda c: site(c, 1).pop("max_nodes"),
        "sites[1].max_nodes: missing; add max_nodes: 1",
    ),
    (
        "plaintext ssh key",
        lambda c: site(c, 1).update(ssh_private_key="-----BEGIN KEY"),
        "sites[1].ssh_private_key: must be a Pulumi secret, never plain text; set it with "
        "'pulumi config set --secret' (see docs/stacks.md)",
    ),
    (
        "missing lambda api key",
        lambda c: site(c, 2).pop("api_key"),
        "sites[2].api_key: missing; set it with 'pulumi config set --secret' (see docs/stacks.md)",
    ),
    (
        "robot user without its password",
        lambda c: site(c, 4).update(robot_user=SECRET),
        "sites[4].robot_password: missing; robot_user is set, and the Robot firewall needs "
        "both: set robot_password too, or remove robot_user",
    ),
    (
        "plaintext robot password",
        lambda c: site(c, 4).update(robot_user=SECRET, robot_password="hunter2"),
        "sites[4].robot_password: must be a Pulumi secret, never plain text; set it with "
        "'pulumi config set --secret' (see docs/stacks.md)",
    ),
    (
        "bad cidr",
        lambda c: site(c, 1).update(admin_cidrs=["10.0.0.0/33"]),
        'sites[1].admin_cidrs: "10.0.0.0/33" is not a CIDR block; write it like 198.51.100.0/24',
    ),
    (
        "nebius preset",
        lambda c: site(c, 3).update(preset="3gpu"),
        'sites[3].preset: "gpu-h100-sxm/3gpu" is not a GPU offering we know on nebius; use one of '
        "gpu-b200-sxm/8gpu-160vcpu-1792gb, gpu-h100-sxm/1gpu-16vcpu-200gb, "
        "gpu-h100-sxm/8gpu-128vcpu-1600gb, gpu-h200-sxm/1gpu-16vcpu-200gb, "
        "gpu-h200-sxm/8gpu-128vcpu-1600gb",
    ),
    (
        "hetzner model",
        lambda c: site(c, 4)["nodes"][0].update(server_model="GEX9"),
        'sites[4].nodes[0].server_model: "GEX9" is unknown; use one of GEX130, GEX131, GEX44, '
        "GEX45, GEX63",
    ),
    (
        "joined address missing",
        lambda c: site(c, 5)["nodes"][0].pop("address"),
        "sites[5].nodes[0].address: missing; add address: 203.0.113.10",
    ),
    (
        "bad address",
        lambda c: site(c, 5)["nodes"][0].update(address="a b;rm"),
        'sites[5].nodes[0].address: "a b;rm" is not an IP address or host name; write a host '
        "name in letters, digits, '.' and '-', no part starting with '-'",
    ),
    (
        "kubeconfig plaintext",
        lambda c: site(c, 6).update(kubeconfig="apiVersion: v1"),
        "sites[6].kubeconfig: must be a Pulumi secret, never plain text; set it with "
        "'pulumi config set --secret' (see docs/stacks.md)",
    ),
    (
        "secret in plain field",
        lambda c: site(c, 1).update(region=SECRET),
        "sites[1].region: is encrypted but is not a secret field; set it in plain text",
    ),
    (
        "min_warm zero",
        lambda c: recipe(c, 0).update(min_warm=0),
        "recipes[0].min_warm: 0 is out of range; use a number from 1 to 10000",
    ),
    (
        "min_warm missing",
        lambda c: recipe(c, 0).pop("min_warm"),
        "recipes[0].min_warm: missing; add min_warm: 1",
    ),
    (
        "spare negative",
        lambda c: recipe(c, 0).update(spare=-1),
        "recipes[0].spare: -1 is out of range; use a number from 0 to 10000",
    ),
    (
        "port out of range",
        lambda c: recipe(c, 0).update(port=70000),
        "recipes[0].port: 70000 is out of range; use a number from 1 to 65535",
    ),
    (
        "balancer port",
        lambda c: c["denv:balancer"].update(port=0),
        "balancer.port: 0 is out of range; use a number from 1 to 65535",
    ),
    (
        "survive",
        lambda c: recipe(c, 0).update(survive="zone"),
        'recipes[0].survive: "zone" is not one of node, site',
    ),
    (
        "typo in recipe",
        lambda c: recipe(c, 0).update(minwarm=2),
        'recipes[0].minwarm: unknown key; did you mean "min_warm"?',
    ),
    (
        "duplicate recipe",
        lambda c: recipe(c, 1).update(name="voice"),
        'recipes: recipe name "voice" is used twice; give each recipe its own name',
    ),
    (
        "unknown site ref",
        lambda c: recipe(c, 0).update(sites=["local", "gcp-1"]),
        'recipes[0].sites: site "gcp-1" is not defined; define it under denv:sites or use one of '
        "local, aws-use1, lambda-use1, nebius-eun1, hetzner-fsn, office, k8s",
    ),
    (
        "site listed twice",
        lambda c: recipe(c, 0).update(sites=["local", ["aws-use1", "local"]]),
        'recipes[0].sites: site "local" is listed twice; list each site once',
    ),
    (
        "mig on l40s",
        lambda c: recipe(c, 1).update(sites=["office"]),
        'recipes[1].gpu: MIG profile "1g.10gb" does not exist on L40S '
        "(L40S has no MIG, site office); use a whole GPU",
    ),
    (
        "wrong mig profile",
        lambda c: recipe(c, 1).update(gpu="1g.5gb"),
        'recipes[1].gpu: MIG profile "1g.5gb" does not exist on H100 (site local); use one of '
        "1g.10gb, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb",
    ),
    (
        "not a share",
        lambda c: recipe(c, 1).update(gpu="half"),
        'recipes[1].gpu: "half" is not a GPU share; use "whole" or a MIG profile like "1g.10gb"',
    ),
    (
        "gpu_models unknown",
        lambda c: recipe(c, 0).update(gpu_models=["H101"]),
        'recipes[0].gpu_models: GPU model "H101" is unknown; use one of A10, A100-40GB, '
        "A100-80GB, A10G, A30, B200, B300, H100, H200, H200-NVL, L4, L40S, RTX-4000-SFF-ADA, "
        "RTX-6000-ADA, RTX-PRO-4000-SFF-BLACKWELL, RTX-PRO-6000-BLACKWELL-MAXQ",
    ),
    (
        "gpu_models exclude site",
        lambda c: recipe(c, 2).update(gpu_models=["L40S"]),
        'recipes[2].sites: site "hetzner-fsn" has no L40S GPUs; remove it from this '
        "recipe or allow its GPU in gpu_models",
    ),
    (
        "duplicate model name",
        lambda c: recipe(c, 1).update(models=["voice"]),
        'recipes: model name "voice" is routed to two recipes; a model needs one pool',
    ),
    (
        "model name injection",
        lambda c: recipe(c, 0).update(models=["x\nuse_backend y"]),
        "recipes[0].models: 'x\\nuse_backend y' holds a newline; write it on one line",
    ),
    (
        "health path",
        lambda c: recipe(c, 0).update(health_path="health"),
        'recipes[0].health_path: "health" is not a URL path; write it like /health',
    ),
    (
        "relative cache dir",
        lambda c: recipe(c, 0).update(cache_dirs=["cache"]),
        'recipes[0].cache_dirs: "cache" is not an absolute path; start it with /',
    ),
    (
        "simulate typo",
        lambda c: recipe(c, 0).update(simulate={"ttft": 5}),
        'recipes[0].simulate.ttft: unknown key; did you mean "ttft_ms"?',
    ),
    (
        "simulated speech engine unknown",
        lambda c: recipe(c, 0).update(simulate={"speech": "festival"}),
        'recipes[0].simulate.speech: "festival" is not one of tone, espeak-ng',
    ),
    (
        "simulated slots zero",
        lambda c: recipe(c, 0).update(simulate={"slots": 0}),
        "recipes[0].simulate.slots: 0 is out of range; use a number from 1 to 100000",
    ),
    (
        "simulated engine unknown",
        lambda c: recipe(c, 0).update(simulate={"engine": "triton"}),
        'recipes[0].simulate.engine: "triton" is not one of vllm, sglang, tgi',
    ),
    (
        "engine unknown",
        lambda c: recipe(c, 0).update(engine="triton"),
        'recipes[0].engine: "triton" is not one of auto, vllm, sglang, tgi, llamacpp, none',
    ),
    (
        "simulated queue limit negative",
        lambda c: recipe(c, 0).update(simulate={"queue_limit": -1}),
        "recipes[0].simulate.queue_limit: -1 is out of range; use a number from 0 to 1000000",
    ),
    (
        "simulated itl growth not a number",
        lambda c: recipe(c, 0).update(simulate={"itl_growth": "fast"}),
        "recipes[0].simulate.itl_growth: expected a number >= 0, got a string",
    ),
    (
        "simulated itl growth too large",
        lambda c: recipe(c, 0).update(simulate={"itl_growth": 11}),
        "recipes[0].simulate.itl_growth: 11.0 is out of range; use a number from 0 to 10",
    ),
    (
        "simulated speech slots zero",
        lambda c: recipe(c, 0).update(simulate={"speech_slots": 0}),
        "recipes[0].simulate.speech_slots: 0 is out of range; use a number from 1 to 10000",
    ),
    (
        "affinity not bool",
        lambda c: recipe(c, 0).update(session_affinity="yes"),
        "recipes[0].session_affinity: expected true or false, got a string",
    ),
    (
        "balancer site unknown",
        lambda c: c["denv:balancer"].update(sites=["nowhere"]),
        'balancer.sites: site "nowhere" is not defined; use one of local, aws-use1, lambda-use1, '
        "nebius-eun1, hetzner-fsn, office, k8s",
    ),
    (
        "digest",
        lambda c: c["denv:balancer"].update(api_key_digests=["sk-live-123"]),
        "balancer.api_key_digests: entries must be SHA-256 hex digests (64 lower-case hex "
        "characters); compute one with `denv key digest`",
    ),
    (
        "port clash",
        lambda c: c["denv:balancer"].update(port=8405),
        "balancer.prometheus_port: 8405 is also the endpoint port; pick another",
    ),
    (
        "tls plaintext",
        lambda c: c["denv:balancer"].update(tls_certificate="-----BEGIN"),
        "balancer.tls_certificate: must be a Pulumi secret, never plain text; set it with "
        "'pulumi config set --secret' (see docs/stacks.md)",
    ),
    (
        "client secret key plaintext",
        lambda c: c["denv:balancer"].update(client_secret_key="a-key"),
        "balancer.client_secret_key: must be a Pulumi secret, never plain text; set 32 or more "
        "random characters with 'pulumi config set --secret' (e.g. from `openssl rand -base64 "
        "32`; see docs/balancer.md)",
    ),
    (
        "client secret key without api keys",
        lambda c: c["denv:balancer"].update(
            client_secret_key={"secure": "ciphertext"}, api_key_digests=[]
        ),
        "balancer.client_secret_key: client secrets are minted with an API key and none is "
        "listed; add api_key_digests (see `denv key digest`) or remove client_secret_key",
    ),
    (
        "dns typo",
        lambda c: c["denv:balancer"].update(dns={"zone": "Z1", "name": "a.example"}),
        "balancer.dns.zone_id: missing; add zone_id: Z0123456789ABC",
    ),
    (
        "check timeout past its interval",
        lambda c: c["denv:balancer"].update(timers={"check_timeout_ms": 2000}),
        "balancer.timers.check_timeout_ms: 2000 exceeds check_inter_ms (1000); a check would"
        " still wait when the next is due: lower it or raise check_inter_ms",
    ),
    (
        "timer misspelt",
        lambda c: c["denv:balancer"].update(timers={"connect_timeout": 300}),
        'balancer.timers.connect_timeout: unknown key; did you mean "connect_timeout_ms"?',
    ),
    (
        "timer zero",
        lambda c: c["denv:balancer"].update(timers={"connect_timeout_ms": 0}),
        "balancer.timers.connect_timeout_ms: 0 is out of range; use a number from 1 to 60000",
    ),
    (
        "endpoint on ssh",
        lambda c: c["denv:balancer"].update(port=22),
        "balancer.port: 22 is SSH's port, and the balancer opens its ports to the internet; use "
        "another, e.g. 8080",
    ),
    (
        "metrics on the agent's port",
        lambda c: c["denv:balancer"].update(prometheus_port=9100),
        "balancer.prometheus_port: 9100 is the node agent's port; use another, e.g. 8080",
    ),
    (
        "replicas on the endpoint port",
        lambda c: recipe(c, 0).update(port=8080),
        "recipes[0].port: replicas on site local take ports 8080-8095, which includes 8080 (the "
        "balancer's endpoint); move the recipe's port clear of it",
    ),
    (
        "replicas on the metrics port",
        lambda c: recipe(c, 0).update(port=8400),
        "recipes[0].port: replicas on site local take ports 8400-8415, which includes 8405 (the "
        "balancer's metrics); move the recipe's port clear of it",
    ),
    (
        "replicas on ssh",
        lambda c: recipe(c, 0).update(port=20),
        "recipes[0].port: replicas on site local take ports 20-35, which includes 22 (SSH); move "
        "the recipe's port clear of it",
    ),
    (
        "replica port past 65535",
        lambda c: recipe(c, 0).update(port=65530),
        "recipes[0].port: 65530 leaves no room for the replicas on site local: 2 GPUs per node "
        "take ports up to 65545; use a port of at most 65520",
    ),
    (
        "two nodes on one machine",
        lambda c: site(c, 4)["nodes"][0].update(address="192.0.2.10"),
        'sites[5].nodes[0].address: "192.0.2.10" is also the address of node gex-1 of site '
        "hetzner-fsn; a spare on the same machine fails with it: give each node its own machine",
    ),
    (
        "port nan",
        lambda c: recipe(c, 0).update(port=float("nan")),
        "recipes[0].port: expected a whole number, got nan (not a finite number)",
    ),
    (
        "port inf",
        lambda c: recipe(c, 0).update(port=float("inf")),
        "recipes[0].port: expected a whole number, got inf (not a finite number)",
    ),
    (
        "price nan",
        lambda c: site(c, 1).update(price_per_gpu_hour=float("nan")),
        "sites[1].price_per_gpu_hour: expected a number >= 0, got nan (not a finite number)",
    ),
    (
        "no balancer site",
        lambda c: c["denv:balancer"].update(sites=[]),
        "balancer.sites: is empty; name the site or sites that run the balancer",
    ),
    (
        "integer config key",
        lambda c: c.update({1: "x"}),
        "1: config keys are names like denv:sites; quote this one",
    ),
    (
        "balancer on kubernetes",
        lambda c: c["denv:balancer"].update(sites=["k8s"]),
        "balancer.sites: k8s: a kubernetes site cannot host the balancer yet; use one of aws, "
        "hetzner, joined, local",
    ),
    (
        "aws region typo",
        lambda c: site(c, 1).update(region="us-east1"),
        'sites[1].region: "us-east1" is not a region name on aws; write it like us-east-1',
    ),
    (
        "nebius region typo",
        lambda c: site(c, 3).update(region="eu-north-1"),
        'sites[3].region: "eu-north-1" is not a region name on nebius; write it like eu-north1',
    ),
    (
        "hetzner location typo",
        lambda c: site(c, 4).update(location="fsn"),
        'sites[4].location: "fsn" is not one of fsn1, nbg1, hel1, ash, hil, sin',
    ),
    (
        "address of dots",
        lambda c: site(c, 5)["nodes"][0].update(address="..."),
        'sites[5].nodes[0].address: "..." is not an IP address or host name; write a host name '
        "in letters, digits, '.' and '-', no part starting with '-'",
    ),
    (
        "machine names collide",
        lambda c: c["denv:sites"].append(
            {
                "name": "local-node",
                "kind": "local",
                "nodes": [{"name": "a", "gpu": "L4", "gpus": 1}],
            }
        ),
        "sites[7].nodes[0].name: node a of site local-node makes the machine name local-node-a, "
        "as node node-a of site local does; rename a site or a node",
    ),
    (
        "system namespace",
        lambda c: site(c, 6).update(namespace="kube-system"),
        'sites[6].namespace: "kube-system" belongs to Kubernetes; the site creates and owns its '
        "namespace, so give one of its own, e.g. denv",
    ),
    (
        "kubernetes service name starting with a digit",
        lambda c: c["denv:recipes"].append(
            {"name": "7b", "min_warm": 1, "sites": ["k8s"], "image": "vllm/vllm-openai:v0.11.0"}
        ),
        'recipes[3].name: "7b" names the Kubernetes Service of its pool on k8s, which must start '
        "with a letter; rename it",
    ),
    (
        "one mount path twice",
        lambda c: recipe(c, 0).update(cache_dirs=["/c", "/c/"]),
        'recipes[0].cache_dirs: "/c" is listed twice; one volume mounts at each path',
    ),
    (
        "replica capacity of zero",
        lambda c: recipe(c, 0).update(max_concurrency=0),
        "recipes[0].max_concurrency: 0 is out of range; use a number from 1 to 100000",
    ),
    (
        "replica capacity as a word",
        lambda c: recipe(c, 1).update(max_concurrency="lots"),
        "recipes[1].max_concurrency: expected a whole number, got a string",
    ),
    (
        "site name with a newline",
        lambda c: recipe(c, 2).update(sites=["office\nhetzner-fsn"]),
        "recipes[2].sites[0]: 'office\\nhetzner-fsn' holds a newline; write it on one line",
    ),
    # Empty secrets, a volume over the whole container, a budget of 0 read as none, a DNS name
    # with a blank, a command of one string (one argument): each refused with its fix.
    *(
        (
            f"empty secret {where}",
            mutate,
            f"{where}: secure: is empty, a secret of nothing; set it with 'pulumi config set "
            "--secret'",
        )
        for where, mutate in (
            ("recipes[0].env.TOKEN", lambda c: recipe(c, 0).update(env={"TOKEN": {"secure": ""}})),
            (
                "sites[4].robot_user",
                lambda c: site(c, 4).update(robot_user={"secure": ""}, robot_password=SECRET),
            ),
            (
                "sites[4].robot_password",
                lambda c: site(c, 4).update(robot_user=SECRET, robot_password={"secure": " "}),
            ),
            (
                "sites[5].ssh_private_key",
                lambda c: site(c, 5).update(ssh_private_key={"secure": ""}),
            ),
            ("sites[2].api_key", lambda c: site(c, 2).update(api_key={"secure": ""})),
        )
    ),
    *(
        (
            f"volume at {path}",
            lambda c, path=path: recipe(c, 0).update(cache_dirs=[path]),
            f'recipes[0].cache_dirs: "{path}" would mount a volume over the whole container; '
            "name a folder, e.g. /root/.cache/huggingface",
        )
        for path in ("/", "//")
    ),
    (
        "queue budget as long as the first-token budget",
        lambda c: recipe(c, 0).update(queue_budget_ms=1000),
        "recipes[0].queue_budget_ms: 1000 leaves no time for the first token within"
        " first_token_timeout_ms (1000); make it smaller, e.g. 200",
    ),
    (
        "round trip in seconds",
        lambda c: site(c, 0).update(round_trip_ms=2500),
        "sites[0].round_trip_ms: 2500 is past 2000 ms, more than any link on Earth; give the"
        " round trip in milliseconds, as `denv status` shows it",
    ),
    (
        "negative round trip",
        lambda c: site(c, 0).update(round_trip_ms=-1),
        "sites[0].round_trip_ms: -1 is below 0; give a number >= 0",
    ),
    (
        "queue budget of 0",
        lambda c: recipe(c, 0).update(queue_budget_ms=0),
        "recipes[0].queue_budget_ms: 0 is out of range; use a number from 1 to 600000",
    ),
    (
        "ttft budget of 0",
        lambda c: recipe(c, 0).update(ttft_budget_ms=0),
        "recipes[0].ttft_budget_ms: 0 is out of range; use a number from 1 to 600000",
    ),
    (
        "dns name with a blank",
        lambda c: c["denv:balancer"].update(dns={"zone_id": "Z1", "name": "llm example.com"}),
        'balancer.dns.name: "llm example.com" is not a DNS name; write a host name in letters, '
        "digits, '.' and '-', no part starting with '-'",
    ),
    (
        "command as one string",
        lambda c: recipe(c, 0).update(command="vllm serve x"),
        "recipes[0].command: one string is one argument; write each as an item, e.g. "
        '[vllm, serve, "$MODEL"]',
    ),
    (
        "key scope names a pool no recipe names",
        lambda c: c["denv:balancer"].update(
            api_key_digests=[KEY_B, {"digest": KEY_A, "pools": ["side", "vocie"]}]
        ),
        f'balancer.api_key_digests[1].pools: key {KEY_A[:12]}... may use pool "vocie", which no'
        " recipe names; use one of voice, side, rtx",
    ),
    (
        "key scope of no pool",
        lambda c: c["denv:balancer"].update(api_key_digests=[{"digest": KEY_A, "pools": []}]),
        "balancer.api_key_digests[0].pools: is empty; list the recipes this key may use, or leave"
        " pools out",
    ),
    (
        "key rate of zero",
        lambda c: c["denv:balancer"].update(api_key_digests=[{"digest": KEY_A, "rate": 0}]),
        "balancer.api_key_digests[0].rate: 0 is out of range; use a number from 1 to 1000000",
    ),
    (
        "key scope misspelt",
        lambda c: c["denv:balancer"].update(api_key_digests=[{"digest": KEY_A, "pool": ["side"]}]),
        'balancer.api_key_digests[0].pool: unknown key; did you mean "pools"?',
    ),
    (
        "key entry of another type",
        lambda c: c["denv:balancer"].update(api_key_digests=[KEY_A, 7]),
        "balancer.api_key_digests[1]: expected a key's digest, or a mapping of digest, pools and"
        " rate, got a number",
    ),
    (
        "key scope of pools that are no names",
        lambda c: c["denv:balancer"].update(api_key_digests=[{"digest": KEY_A, "pools": [5]}]),
        "balancer.api_key_digests[0].pools: expected a list of non-empty strings, got a list",
    ),
    (
        "key listed twice",
        lambda c: c["denv:balancer"].update(
            api_key_digests=[KEY_A, {"digest": KEY_A, "pools": ["side"]}]
        ),
        f"balancer.api_key_digests[1]: key {KEY_A[:12]}... is listed twice; give each key one"
        " entry",
    ),
    (
        "scoped key not a digest",
        lambda c: c["denv:balancer"].update(
            api_key_digests=[{"digest": "sk-live-1", "pools": ["side"]}]
        ),
        "balancer.api_key_digests: entries must be SHA-256 hex digests (64 lower-case hex "
        "characters); compute one with `denv key digest`",
    ),
]


@pytest.mark.parametrize(
    ("change", "expected"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_stack_reports_one_line(change: Callable[[Config], object], expected: str) -> None:
    config = valid_config()
    change(config)
    with pytest.raises(StackError) as raised:
        read_stack("t", config)
    assert expected in raised.value.problems


def test_case_count_meets_the_bar() -> None:
    assert len(CASES) >= 30


def test_valid_stack_reads() -> None:
    stack = read_stack("t", valid_config())
    assert [s.kind for s in stack.sites] == [
        "local",
        "aws",
        "lambda",
        "nebius",
        "hetzner",
        "joined",
        "kubernetes",
    ]
    assert stack.site("aws-use1").gpu == "H100" and stack.site("aws-use1").gpus_per_node == 8
    assert stack.site("hetzner-fsn").nodes[0].gpu == "RTX-4000-SFF-ADA"
    assert stack.recipes[0].tiers == (("local", "aws-use1"), ("lambda-use1",))
    assert stack.recipes[0].model_names == ("voice",)


def test_every_problem_reported_at_once() -> None:
    config = valid_config()
    recipe(config, 0).update(min_warm=0, port=0, colour="red")
    site(config, 1).update(kind="gcp")
    with pytest.raises(StackError) as raised:
        read_stack("t", config)
    assert len(raised.value.problems) == 4
    assert all("\n" not in line.split(": ", 1)[0] for line in raised.value.problems)


def test_secrets_stay_opaque() -> None:
    stack = read_stack("t", valid_config())
    key = stack.site("lambda-use1").api_key
    assert isinstance(key, Secret)
    assert SECRET["secure"] not in repr(stack) and SECRET["secure"] not in str(key)


def test_names_a_provider_would_cut_or_refuse() -> None:
    stack = "s" * 64
    with pytest.raises(StackError) as raised:
        read_stack(stack, valid_config())
    assert raised.value.problems == [
        f"sites[2].name: Lambda names of this site, like {stack}-lambda-use1-node-1, take 83 "
        "characters, past Lambda's 60; shorten the site or the stack name",
        f"sites[3]: Nebius host names of this site, like {stack}-nebius-eun1-node-1, take 83 "
        "characters, past Nebius's 63; shorten the site or the stack name",
        f'sites[6]: the stack name "{stack}" labels every object of this Kubernetes site, and a '
        "label value is at most 63 letters, digits, '-', '_' and '.'; use a shorter stack name",
    ]
    read_stack("s" * 40, valid_config())  # 40 + "-lambda-use1-node-1" fits in 60


def test_a_recipe_picks_espeak_ng_for_its_simulated_speech() -> None:
    config = valid_config()
    recipe(config, 0).update(simulate={"speech": "espeak-ng"})
    speech = [r.simulate.speech for r in read_stack("t", config).recipes]
    assert speech[0] == "espeak-ng"
    assert set(speech[1:]) <= {"tone"}


def test_a_recipe_sets_its_simulated_capacity_and_engine() -> None:
    config = valid_config()
    given = {
        "engine": "sglang",
        "slots": 8,
        "itl_growth": 0.5,
        "queue_limit": 0,
        "speech_slots": 1,
        "transcription_slots": 3,
    }
    recipe(config, 0).update(simulate=given)
    recipes = read_stack("t", config).recipes
    assert recipes[0].simulate == SimulatedServer(**given)  # type: ignore[arg-type]
    # Unset: the capacity of one GPU, never unbounded slots.
    assert recipes[1].simulate == SimulatedServer()
    assert (SimulatedServer().slots, SimulatedServer().queue_limit) == (32, None)


def test_key_scopes_reach_the_haproxy_config() -> None:
    config = valid_config()
    config["denv:balancer"]["api_key_digests"] = [
        KEY_A,
        {"digest": KEY_B, "pools": ["side"], "rate": 5},
        {"digest": "ef" * 32, "rate": 9},
    ]
    stack = read_stack("t", config)
    assert stack.balancer.api_key_digests == (KEY_A, KEY_B, "ef" * 32)
    settings = balancer_settings(stack)
    pools = [
        BalancerPool(name, (BalancerTier(1, ("s",), (server(f"{name}.s.n.0", "10.0.0.1"),)),))
        for name in ("voice", "side", "rtx")
    ]
    files = render_haproxy_config(pools, settings, MAP_DIR).files
    assert files["api_keys.map"].splitlines()[1:] == [
        f"{KEY_A} *",
        f"{KEY_B} side",
        f"{'ef' * 32} *",
    ]
    assert files["key_rates.map"].splitlines()[1:] == [f"{KEY_B} 5", f"{'ef' * 32} 9"]


def test_a_recipe_engine_is_auto_unless_named_or_none() -> None:
    config = valid_config()
    recipe(config, 0).update(engine="none")
    recipe(config, 1).update(engine="sglang")
    engines = [r.engine for r in read_stack("t", config).recipes]
    assert engines[:2] == [None, "sglang"]
    assert set(engines[2:]) == {"auto"}


def test_balancer_timers_reach_the_haproxy_config() -> None:
    config = valid_config()
    timers = {"connect_timeout_ms": 300, "check_timeout_ms": 1500, "check_inter_ms": 3000}
    config["denv:balancer"]["timers"] = timers
    settings = balancer_settings(read_stack("t", config))
    assert (settings.connect_timeout_ms, settings.check_timeout_ms) == (300, 1500)
    assert (settings.check_inter_ms, settings.agent_inter_ms) == (3000, AGENT_INTER_MS)
    default = balancer_settings(read_stack("t", valid_config()))
    assert (default.connect_timeout_ms, default.check_timeout_ms) == (80, 500)


@pytest.mark.parametrize(("given", "read"), [(None, MAX_CONCURRENCY), (2, 2), (256, 256)])
def test_a_recipe_states_what_one_replica_admits(given: int | None, read: int) -> None:
    config = valid_config()
    if given is not None:
        recipe(config, 0)["max_concurrency"] = given
    stack = read_stack("t", config)
    assert stack.recipes[0].max_concurrency == read
    assert MAX_CONCURRENCY == 32  # the documented default (docs/stacks.md)


@pytest.mark.parametrize(
    ("given", "first_token_ms", "queue_ms"),
    [({}, None, 80), ({"queue_budget_ms": 300}, None, 300), ({}, 250, 50), ({}, 5000, 80)],
)
def test_a_recipe_states_how_long_a_request_may_wait_for_a_slot(
    given: dict[str, int], first_token_ms: int | None, queue_ms: int
) -> None:
    config = valid_config()
    recipe(config, 0).update(given)
    if first_token_ms is not None:
        recipe(config, 0)["first_token_timeout_ms"] = first_token_ms
    stack = read_stack("t", config)
    pools = balancer_pools(stack, place_replicas(stack), lambda r: ("10.0.0.1", 8000, 8101))
    assert [p.queue_timeout_ms for p in pools if p.name == stack.recipes[0].name] == [queue_ms]


@pytest.mark.parametrize(
    ("balancer_site", "admin_cidrs", "metrics_bind"),
    [
        ("office", None, "127.0.0.1:8405"),  # joined, no firewall: loopback only
        ("office", ["198.51.100.0/24"], "0.0.0.0:8405"),  # the host firewall admits the admins
        ("hetzner-fsn", None, "0.0.0.0:8405"),  # the Robot firewall admits no stats port
        ("aws-use1", ["198.51.100.0/24"], "0.0.0.0:8405"),
        ("local", None, "0.0.0.0:8405"),  # the local runner binds loopback itself
    ],
)
def test_metrics_of_an_unguarded_balancer_host_listen_on_loopback(
    balancer_site: str, admin_cidrs: list[str] | None, metrics_bind: str
) -> None:
    config = valid_config()
    for s in config["denv:sites"]:
        if s["name"] == balancer_site and admin_cidrs is not None:
            s["admin_cidrs"] = admin_cidrs
    config["denv:balancer"]["sites"] = [balancer_site]
    rendered = render_haproxy_config([VOICE], balancer_settings(read_stack("t", config)), MAP_DIR)
    assert f"    bind {metrics_bind}\n" in rendered.haproxy_cfg
    assert "    bind 0.0.0.0:8080\n" in rendered.haproxy_cfg  # the endpoint is for everyone
