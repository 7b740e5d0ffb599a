"""Turn the `denv:` keys of a stack's config into a validated StackSpec, or all its problems."""

import ipaddress
import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from denv_iac.core.catalog import Catalog, load_catalog
from denv_iac.core.stack.fields import Fields, Problems, describe, is_secret
from denv_iac.core.stack.model import (
    AUTO_ENGINE,
    BALANCER_HOST_KINDS,
    CANARY_FIELDS,
    CANARY_SUFFIX,
    COLD_START_BUDGET_S,
    DRAIN_TIMEOUT_S,
    ENGINES,
    FIRST_TOKEN_TIMEOUT_MS,
    MAX_CONCURRENCY,
    MIG_STRATEGIES,
    NO_ENGINE,
    SIMULATED_ENGINES,
    SIMULATED_SPEECH,
    SITE_KINDS,
    STALL_TIMEOUT_MS,
    WHOLE_GPU,
    BalancerSpec,
    BalancerTimers,
    CanarySpec,
    DnsSpec,
    KeyScope,
    NodeSpec,
    OverlaySpec,
    RecipeSpec,
    Secret,
    SimulatedServer,
    SiteSpec,
    StackSpec,
    canary_recipe,
    replica_version,
)
from denv_iac.core.stack.overlay import overlay_problems, read_overlay
from denv_iac.core.stack.ports import stack_port_problems
from denv_iac.core.stack.values import (
    HOST_NAME,
    HOST_RULE,
    IMAGE,
    IMAGE_RULE,
    LABEL_VALUE,
    LAMBDA_NAME_LENGTH,
    MODEL_NAME,
    USER_NAME,
    USER_RULE,
    is_host,
    lambda_full_name,
    nebius_host_problem,
    nebius_image_family,
)

CONFIG_KEYS = ("denv:sites", "denv:recipes", "denv:balancer")
DIGEST = re.compile(r"^[0-9a-f]{64}$")
SSH_KEY_HOW = "set it with 'pulumi config set --secret' (see docs/stacks.md)"
_CLIENT_SECRET_HOW = (
    "set 32 or more random characters with 'pulumi config set --secret'"
    " (e.g. from `openssl rand -base64 32`; see docs/balancer.md)"
)
ROBOT_FIELDS = ("robot_user", "robot_password")
# How each provider writes its region names, so that a typo fails here, not in the provider's API.
REGION_FORMATS = {
    "aws": (re.compile(r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d$"), "us-east-1"),
    "lambda": (re.compile(r"^[a-z]+(-[a-z]+)+-\d$"), "us-east-1"),
    "nebius": (re.compile(r"^[a-z]{2}-[a-z]+\d$"), "eu-north1"),
}
HETZNER_LOCATIONS = ("fsn1", "nbg1", "hel1", "ash", "hil", "sin")
PROVIDER_OF_KIND = {"aws": "aws", "lambda": "lambda", "nebius": "nebius", "hetzner": "hetzner"}


class StackError(Exception):
    """A stack that cannot be built. `problems` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def read_stack(name: str, config: Mapping[str, Any], catalog: Catalog | None = None) -> StackSpec:
    """Validate a stack's config (the `config:` mapping of Pulumi.<stack>.yaml)."""
    catalog = catalog or load_catalog()
    problems = Problems()
    for key in config:
        if not isinstance(key, str):
            # YAML reads `1:` or `true:` as a number or a boolean, never a config key.
            problems.add(str(key), "config keys are names like denv:sites; quote this one")
        elif key.startswith("denv:") and key not in CONFIG_KEYS:
            problems.add(key, f"unknown config key; use one of {', '.join(CONFIG_KEYS)}")
    denv = {k.removeprefix("denv:"): v for k, v in config.items() if isinstance(k, str)}
    root = Fields(problems, "", denv)
    sites = tuple(_read_site(problems, p, raw, catalog) for p, raw in root.items("sites"))
    recipes = tuple(_read_recipe(problems, p, raw) for p, raw in root.items("recipes"))
    balancer_fields = Fields(problems, "balancer", root.raw.get("balancer", {}))
    root.known.add("balancer")
    balancer = _read_balancer(balancer_fields)
    # References are checked even when fields were bad, so one run reports everything.
    stack = StackSpec(name, sites, recipes, balancer)
    _check_references(problems, stack, catalog)
    _check_canaries(problems, stack)
    if problems:
        raise StackError(problems.lines)
    canaries = tuple(canary_recipe(r, r.canary) for r in recipes if r.canary is not None)
    return replace(stack, recipes=recipes + canaries)


def _check_canaries(problems: Problems, stack: StackSpec) -> None:
    """A canary's pool is named after its recipe, and runs where Kubernetes is not (yet)."""
    names = {recipe.name: index for index, recipe in enumerate(stack.recipes)}
    kinds = {site.name: site.kind for site in stack.sites}
    for index, recipe in enumerate(stack.recipes):
        if recipe.canary is None:
            continue
        pool = f"{recipe.name}{CANARY_SUFFIX}"
        if pool in names:
            problems.add(
                f"recipes[{names[pool]}].name",
                f'"{pool}" is the name of the pool of recipes[{index}].canary; rename this recipe',
            )
        on_kubernetes = [s for s in recipe.sites if kinds.get(s) == "kubernetes"]
        if on_kubernetes:
            problems.add(
                f"recipes[{index}].canary",
                f"a canary runs on nodes and local sites, not yet on Kubernetes sites"
                f" ({', '.join(on_kubernetes)}); list only other sites, or remove canary",
            )


def _read_node(problems: Problems, path: str, raw: object, kind: str, catalog: Catalog) -> NodeSpec:
    f = Fields(problems, path, raw)
    name = f.name()
    address = f.text("address", "" if kind == "local" else None, example="203.0.113.10")
    if address and not is_host(address):
        f.problem("address", f'"{address}" is not an IP address or host name; {HOST_RULE}')
    ssh_user = "root" if kind == "local" else f.text("ssh_user", "root")
    if ssh_user and not USER_NAME.fullmatch(ssh_user):
        f.problem("ssh_user", f'"{ssh_user}" is not a login name; {USER_RULE}')
    if kind == "hetzner":
        if f.flag("behind_nat", False):
            f.problem("behind_nat", "a Hetzner box has a public address; remove behind_nat")
        model = f.text("server_model", example="GEX130")
        offering = catalog.offering("hetzner", model) if model else None
        if model and offering is None:
            f.problem(
                "server_model",
                f'"{model}" is unknown; use one of {catalog.offering_names("hetzner")}',
            )
        f.finish()
        if offering is None:
            return NodeSpec(name, "", 0, address, ssh_user)
        return NodeSpec(name, offering.gpu, offering.gpu_count, address, ssh_user, model)
    gpu = _gpu_model(f, "gpu", catalog)
    count = f.integer("gpus", None, 1, 16)
    # Only a joined machine can sit behind NAT: every other kind has a public address.
    behind_nat = f.flag("behind_nat", False) if kind == "joined" else False
    f.finish()
    return NodeSpec(name, gpu, count, address, ssh_user, behind_nat=behind_nat)


def _gpu_model(f: Fields, key: str, catalog: Catalog) -> str:
    gpu = f.text(key, example="H100")
    if gpu and catalog.gpu(gpu) is None:
        f.problem(key, f'GPU model "{gpu}" is unknown; use one of {catalog.gpu_names()}')
        return ""
    return gpu


def _read_site(problems: Problems, path: str, raw: object, catalog: Catalog) -> SiteSpec:
    f = Fields(problems, path, raw)
    name = f.name()
    kind = f.choice("kind", SITE_KINDS)
    price = f.number("price_per_gpu_hour")
    cache_size_gb = f.integer("cache_size_gb", 500, 10, 65536)
    round_trip = f.number("round_trip_ms")
    if round_trip is not None and round_trip > ROUND_TRIP_LIMIT_MS:
        f.problem(
            "round_trip_ms",
            f"{round_trip:g} is past {ROUND_TRIP_LIMIT_MS} ms, more than any link on Earth;"
            " give the round trip in milliseconds, as `denv status` shows it",
        )
    if round_trip is None and kind == "local":
        round_trip = 0.0  # the balancer's own machine
    common: dict[str, Any] = {
        "price_per_gpu_hour": price,
        "cache_size_gb": cache_size_gb,
        "round_trip_ms": round_trip,
    }
    site = SiteSpec(name, kind or "local", **common)
    if kind in ("local", "joined", "hetzner"):
        nodes = tuple(_read_node(problems, p, n, kind, catalog) for p, n in f.items("nodes"))
        extra: dict[str, Any] = {"nodes": nodes}
        if kind != "local":
            extra["ssh_private_key"] = f.secret("ssh_private_key", required=True, how=SSH_KEY_HOW)
            extra["admin_cidrs"] = _cidrs(f)
        if kind == "hetzner":
            extra["region"] = f.choice("location", HETZNER_LOCATIONS, "fsn1")
            extra.update(_robot_credentials(f))
            extra["hcloud_ssh_key"] = f.text("hcloud_ssh_key", "")
        site = SiteSpec(name, kind, **common, **extra)
    elif kind in ("aws", "lambda", "nebius"):
        site = _read_cloud_site(f, name, kind, catalog, common)
    elif kind == "kubernetes":
        site = SiteSpec(
            name,
            kind,
            **common,
            kubeconfig=f.secret("kubeconfig", required=True, how=SSH_KEY_HOW),
            namespace=_namespace(f),
            gpu=_gpu_model(f, "gpu", catalog),
            gpus_per_node=f.integer("gpus_per_node", None, 1, 16),
            max_nodes=f.integer("max_nodes", None, 1, 1000),
            mig_strategy=f.choice("mig_strategy", MIG_STRATEGIES, ""),
        )
    if kind:  # with the kind unknown, which keys belong is unknown too
        f.finish()
    return site


# A round trip longer than this is a unit mistake (seconds for milliseconds), not a link.
ROUND_TRIP_LIMIT_MS = 2000


def _robot_credentials(f: Fields) -> dict[str, Secret | None]:
    """The Robot webservice user of a Hetzner site: both secrets, or neither."""
    found = {key: f.secret(key, required=False, how=SSH_KEY_HOW) for key in ROBOT_FIELDS}
    given = [key for key in ROBOT_FIELDS if f.has(key)]
    if len(given) == 1:
        (missing,) = set(ROBOT_FIELDS) - set(given)
        f.problem(
            missing,
            f"missing; {given[0]} is set, and the Robot firewall needs both: "
            f"set {missing} too, or remove {given[0]}",
        )
    return found


# Namespaces Kubernetes itself runs in: a site creates and owns its namespace, and deleting the
# stack would delete it.
SYSTEM_NAMESPACES = ("default", "kube-node-lease", "kube-public", "kube-system")


def _namespace(f: Fields) -> str:
    namespace = f.name("namespace") if f.has("namespace") else "denv"
    if namespace in SYSTEM_NAMESPACES:
        f.problem(
            "namespace",
            f'"{namespace}" belongs to Kubernetes; the site creates and owns its namespace, so '
            "give one of its own, e.g. denv",
        )
    return namespace


def _read_cloud_site(
    f: Fields, name: str, kind: str, catalog: Catalog, common: dict[str, Any]
) -> SiteSpec:
    region = _region(f, kind)
    if kind == "nebius":
        platform = f.text("platform", example="gpu-h100-sxm")
        preset = f.text("preset", example="1gpu-16vcpu-200gb")
        given, offering_name, key = bool(platform and preset), f"{platform}/{preset}", "preset"
    else:
        offering_name, key = f.text("instance_type", example="p5.48xlarge"), "instance_type"
        given = bool(offering_name)
    offering = catalog.offering(kind, offering_name)
    if given and offering is None:
        f.problem(
            key,
            f'"{offering_name}" is not a GPU offering we know on {kind}; '
            f"use one of {catalog.offering_names(kind)}",
        )
    extra: dict[str, Any] = {
        "region": region,
        "offering": offering_name,
        "max_nodes": f.integer("max_nodes", None, 1, 1000),
        "gpu": offering.gpu if offering else "",
        "gpus_per_node": offering.gpu_count if offering else 0,
        "admin_cidrs": _cidrs(f),
        "ssh_private_key": f.secret("ssh_private_key", required=True, how=SSH_KEY_HOW),
    }
    if kind == "aws":
        extra["subnet_id"] = f.text("subnet_id", "")
        extra["image"] = f.text(
            "ami_parameter",
            "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id",
        )
    if kind == "lambda":
        extra["api_key"] = f.secret("api_key", required=True, how=SSH_KEY_HOW)
    if kind == "nebius":
        extra["project_id"] = f.text("project_id", example="project-e00example")
        extra["subnet_id"] = f.text("subnet_id", example="vpcsubnet-e00example")
        gpu = offering.gpu if offering else ""
        extra["image"] = f.text("image_family", nebius_image_family(gpu))
    return SiteSpec(name, kind, **common, **extra)


def _region(f: Fields, kind: str) -> str:
    pattern, example = REGION_FORMATS[kind]
    region = f.text("region", example=example)
    if region and not pattern.fullmatch(region):
        f.problem("region", f'"{region}" is not a region name on {kind}; write it like {example}')
    return region


def _cidrs(f: Fields) -> tuple[str, ...]:
    cidrs = f.text_list("admin_cidrs")
    # Each block becomes firewall rules named after it: one block twice would be one name twice.
    seen: dict[ipaddress.IPv4Network | ipaddress.IPv6Network, int] = {}
    for index, cidr in enumerate(cidrs):
        try:
            network = ipaddress.ip_network(cidr)
        except ValueError:
            f.problem("admin_cidrs", f'"{cidr}" is not a CIDR block; write it like 198.51.100.0/24')
            continue
        if network in seen:
            first = seen[network]
            f.problem(
                f"admin_cidrs[{index}]",
                f'"{cidr}" is the block of admin_cidrs[{first}] ("{cidrs[first]}"); list each '
                "block once",
            )
        seen.setdefault(network, index)
    return cidrs


def _read_tiers(f: Fields) -> tuple[tuple[str, ...], ...]:
    tiers: list[tuple[str, ...]] = []
    for path, entry in f.items("sites"):
        names = entry if isinstance(entry, list) else [entry]
        if not names or not all(isinstance(n, str) and n for n in names):
            f.problems.add(path, "expected a site name, or a list of site names that share a tier")
            continue
        if not all(f.one_line(path.removeprefix(f"{f.path}."), n) for n in names):
            continue
        tiers.append(tuple(names))
    return tuple(tiers)


def _read_recipe(problems: Problems, path: str, raw: object) -> RecipeSpec:
    f = Fields(problems, path, raw)
    name = f.name()
    share = f.text("gpu", WHOLE_GPU)
    if share != WHOLE_GPU and not re.fullmatch(r"\d+g\.\d+gb", share):
        f.problem(
            "gpu", f'"{share}" is not a GPU share; use "whole" or a MIG profile like "1g.10gb"'
        )
    min_warm = f.integer("min_warm", None, 1, 10000)
    spare = f.integer("spare", 1, 0, 10000)
    survive = f.choice("survive", ("node", "site"), "node")
    tiers = _read_tiers(f)
    sim = f.child("simulate")
    simulate = SimulatedServer()
    if sim is not None:
        simulate = _read_simulate(sim)
        sim.finish()
    health_path = f.text("health_path", "/health")
    if health_path and not re.fullmatch(r"/[A-Za-z0-9._~/-]*", health_path):
        f.problem("health_path", f'"{health_path}" is not a URL path; write it like /health')
    models = f.text_list("models")
    for model in models:
        if not MODEL_NAME.fullmatch(model):
            f.problem(
                "models",
                f'"{model}" has characters a model name may not have; '
                "use letters, digits and . _ : / -",
            )
    # Left out: no budget. 0 is refused rather than read as "none".
    ttft_budget = f.integer("ttft_budget_ms", 0, 1, 600_000) or None
    first_token_timeout = f.integer("first_token_timeout_ms", FIRST_TOKEN_TIMEOUT_MS, 50, 600_000)
    stall_timeout = f.integer("stall_timeout_ms", STALL_TIMEOUT_MS, 50, 3_600_000)
    queue_budget = f.integer("queue_budget_ms", 0, 1, 600_000) or None
    if queue_budget is not None and queue_budget >= first_token_timeout:
        f.problem(
            "queue_budget_ms",
            f"{queue_budget} leaves no time for the first token within first_token_timeout_ms"
            f" ({first_token_timeout}); make it smaller, e.g. {first_token_timeout // 5}",
        )
    _check_simulated_pace(f, simulate, stall_timeout)
    env, secret_env = f.env("env")
    recipe = RecipeSpec(
        name=name,
        share=share,
        tiers=tiers,
        min_warm=min_warm,
        spare=spare,
        survive="site" if survive == "site" else "node",
        gpu_models=f.text_list("gpu_models"),
        models=models,
        command=f.text_list("command", list_example='[vllm, serve, "$MODEL"]'),
        image=_image(f),
        port=f.integer("port", 8000, 1, 65535),
        health_path=health_path,
        cold_start_budget_s=f.integer("cold_start_budget_s", COLD_START_BUDGET_S, 10, 86400),
        drain_timeout_s=f.integer("drain_timeout_s", DRAIN_TIMEOUT_S, 1, 86400),
        ttft_budget_ms=ttft_budget,
        first_token_timeout_ms=first_token_timeout,
        stall_timeout_ms=stall_timeout,
        max_concurrency=f.integer("max_concurrency", MAX_CONCURRENCY, 1, 100_000),
        queue_budget_ms=queue_budget,
        cache_dirs=f.text_list("cache_dirs") or RecipeSpec.cache_dirs,
        session_affinity=f.flag("session_affinity", True),
        env=env,
        secret_env=secret_env,
        simulate=simulate,
        engine=_engine(f),
        metrics_path=_metrics_path(f),
    )
    for cache_dir in recipe.cache_dirs:
        if not cache_dir.startswith("/"):
            f.problem("cache_dirs", f'"{cache_dir}" is not an absolute path; start it with /')
        elif not cache_dir.strip("/"):
            f.problem(
                "cache_dirs",
                f'"{cache_dir}" would mount a volume over the whole container; '
                "name a folder, e.g. /root/.cache/huggingface",
            )
    for dup in _duplicates([d.rstrip("/") for d in recipe.cache_dirs]):
        f.problem("cache_dirs", f'"{dup}" is listed twice; one volume mounts at each path')
    canary_fields = f.child("canary")
    if canary_fields is not None:
        recipe = replace(recipe, canary=_read_canary(canary_fields, recipe))
    f.finish()
    return recipe


def _read_canary(f: Fields, recipe: RecipeSpec) -> CanarySpec:
    """`canary:` the new version (the fields of CANARY_FIELDS it runs differently), its
    `replicas` and the `share` of new sessions it takes."""
    before = len(f.problems.lines)
    f.known.update(CANARY_FIELDS)  # each may be left out
    share = _canary_share(f)
    replicas = f.integer("replicas", 1, 1, 10000)
    sim = f.child("simulate")
    simulate = None
    if sim is not None:
        simulate = _read_simulate(sim)
        sim.finish()
        _check_simulated_pace(f, simulate, recipe.stall_timeout_ms)
    env = _canary_env(f, recipe) if f.has("env") else None
    command = None
    if f.has("command"):
        command = f.text_list("command", list_example='[vllm, serve, "$MODEL"]')
    canary = CanarySpec(
        share=share,
        replicas=replicas,
        image=_image(f) if f.has("image") else None,
        command=command,
        env=env,
        simulate=simulate,
    )
    f.finish()
    if not f.ok or len(f.problems.lines) > before:
        return canary
    if replica_version(canary_recipe(recipe, canary)) == replica_version(recipe):
        given = [name for name in CANARY_FIELDS if f.has(name)]
        what = f"same {', '.join(given)}" if given else "it names none of the fields"
        f.problems.add(
            f.path,
            f"runs what the recipe runs ({what}); give the {', '.join(CANARY_FIELDS)} the new"
            " version differs in, or remove canary",
        )
    if not recipe.session_affinity:
        f.problems.add(
            f.path,
            "needs session_affinity: true (the share is of new sessions, placed by the"
            " balancer's weighted hash; least connections ignores weights while replicas are"
            " idle); set session_affinity: true or remove canary",
        )
    return canary


def _canary_env(f: Fields, recipe: RecipeSpec) -> tuple[tuple[str, str], ...]:
    """A canary's plain env; its secrets are the recipe's `secure:` values, which it keeps."""
    env, secret_env = f.env("env")
    secrets = {name for name, _ in recipe.secret_env}
    for name, _ in secret_env:
        f.problem(
            f"env.{name}",
            "a canary runs with the recipe's secure: values and holds none of its own; put it"
            " in the recipe's env as secure:, or give the canary a plain value",
        )
    for name, _ in env:
        if name in secrets:
            f.problem(
                f"env.{name}",
                "is a secure: value of the recipe's env, which the canary runs with; remove it"
                " here, or remove it from the recipe's env",
            )
    return env


CANARY_SHARE_RULE = "give the fraction of new sessions it takes, above 0 and below 1 (0.1 = 10 %)"


def _canary_share(f: Fields) -> float:
    f.known.add("share")
    value = f.raw.get("share")
    if value is None:
        if f.ok:
            f.problem("share", f"missing; {CANARY_SHARE_RULE}, e.g. share: 0.1")
    elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        f.problem("share", f"expected a number, got {describe(value)}; {CANARY_SHARE_RULE}")
    elif not 0 < value < 1:
        f.problem("share", f"{value} is out of range; {CANARY_SHARE_RULE}")
    else:
        return float(value)
    return 0.0


def _engine(f: Fields) -> str | None:
    """`auto` (the default), an engine of ENGINES, or `none` (None: no metrics read)."""
    engine = f.choice("engine", (AUTO_ENGINE, *ENGINES, NO_ENGINE), AUTO_ENGINE) or AUTO_ENGINE
    return None if engine == NO_ENGINE else engine


def _metrics_path(f: Fields) -> str:
    path = f.text("metrics_path", "/metrics")
    if not re.fullmatch(r"/[A-Za-z0-9._~/-]*", path):
        f.problem("metrics_path", f'"{path}" is not a URL path; write it like /metrics')
    return path


def _image(f: Fields) -> str:
    image = f.text("image", "")
    if image and not IMAGE.fullmatch(image):
        f.problem("image", f'"{image}" is not a container image; {IMAGE_RULE}')
    return image


def _read_simulate(sim: Fields) -> SimulatedServer:
    default = SimulatedServer()
    growth = sim.number("itl_growth")
    if growth is not None and growth > 10:
        sim.problem("itl_growth", f"{growth} is out of range; use a number from 0 to 10")
        growth = None
    queue_limit = sim.integer("queue_limit", -1, 0, 1_000_000)  # -1: not set, no bound
    return SimulatedServer(
        ttft_ms=sim.integer("ttft_ms", default.ttft_ms, 0, 600_000),
        itl_ms=sim.integer("itl_ms", default.itl_ms, 0, 60_000),
        tokens=sim.integer("tokens", default.tokens, 1, 100_000),
        speech=sim.choice("speech", SIMULATED_SPEECH, default.speech),
        engine=sim.choice("engine", SIMULATED_ENGINES, default.engine),
        slots=sim.integer("slots", default.slots, 1, 100_000),
        itl_growth=default.itl_growth if growth is None else growth,
        queue_limit=None if queue_limit < 0 else queue_limit,
        speech_slots=sim.integer("speech_slots", default.speech_slots, 1, 10_000),
        transcription_slots=sim.integer(
            "transcription_slots", default.transcription_slots, 1, 10_000
        ),
    )


def _check_simulated_pace(f: Fields, simulate: SimulatedServer, stall_timeout_ms: int) -> None:
    """A simulated replica slower than the stall budget would have every stream cut."""
    gap_ms = max(simulate.ttft_ms, simulate.itl_ms)
    if gap_ms >= stall_timeout_ms:
        f.problem(
            "simulate",
            f"a {gap_ms} ms pause between tokens reaches stall_timeout_ms ({stall_timeout_ms}),"
            " so the balancer would cut every stream; raise stall_timeout_ms or lower"
            " simulate.ttft_ms / itl_ms",
        )


def _read_balancer(f: Fields) -> BalancerSpec:
    sites = f.text_list("sites", required=True)
    if f.has("sites") and f.raw["sites"] == []:
        f.problem("sites", "is empty; name the site or sites that run the balancer")
    digests, key_scopes = _read_api_keys(f)
    dns_fields = f.child("dns")
    dns = None
    if dns_fields is not None:
        dns = DnsSpec(
            dns_fields.text("zone_id", example="Z0123456789ABC"),
            dns_fields.text("name", example="llm.example.com"),
            dns_fields.integer("ttl", 30, 5, 86400),
        )
        if dns.name and not HOST_NAME.fullmatch(dns.name):
            dns_fields.problem("name", f'"{dns.name}" is not a DNS name; {HOST_RULE}')
        dns_fields.finish()
    overlay_fields = f.child("overlay")
    overlay = read_overlay(overlay_fields) if overlay_fields is not None else OverlaySpec()
    timers_fields = f.child("timers")
    timers = _read_timers(timers_fields) if timers_fields is not None else BalancerTimers()
    balancer = BalancerSpec(
        sites=sites,
        port=f.integer("port", 8080, 1, 65535),
        api_key_digests=digests,
        key_scopes=key_scopes,
        tls_certificate=f.secret("tls_certificate", required=False, how=SSH_KEY_HOW),
        client_secret_key=f.secret("client_secret_key", required=False, how=_CLIENT_SECRET_HOW),
        prometheus_port=f.integer("prometheus_port", 8405, 1, 65535),
        dns=dns,
        overlay=overlay,
        timers=timers,
    )
    if balancer.client_secret_key is not None and not balancer.api_key_digests:
        f.problem(
            "client_secret_key",
            "client secrets are minted with an API key and none is listed;"
            " add api_key_digests (see `denv key digest`) or remove client_secret_key",
        )
    if balancer.port == balancer.prometheus_port:
        f.problem("prometheus_port", f"{balancer.port} is also the endpoint port; pick another")
    f.finish()
    return balancer


def _read_api_keys(f: Fields) -> tuple[tuple[str, ...], tuple[KeyScope, ...]]:
    """`api_key_digests`: each entry a key's digest (the key may use every pool), or a mapping
    of its `digest`, the `pools` it may use and the `rate` it may send (requests a second)."""
    raw = f.raw.get("api_key_digests")
    f.known.add("api_key_digests")
    entries = (
        [(f.at("api_key_digests"), raw)]
        if isinstance(raw, str)
        else list(f.items("api_key_digests", required=False))
    )
    digests: list[str] = []
    scopes: list[KeyScope] = []
    for path, entry in entries:
        if isinstance(entry, Mapping) and not is_secret(entry):
            scope = _read_key_scope(Fields(f.problems, path, entry))
            digest = scope.digest
            if scope.pools is not None or scope.rate is not None:
                scopes.append(scope)
        elif isinstance(entry, str) and entry.strip():
            digest = entry if f.one_line("api_key_digests", entry) else ""
        else:
            f.problems.add(
                path,
                f"expected a key's digest, or a mapping of digest, pools and rate, got"
                f" {describe(entry)}",
            )
            continue
        if digest and digest in digests:
            f.problems.add(path, f"key {digest[:12]}... is listed twice; give each key one entry")
        digests.append(digest)
    if any(digest and not DIGEST.fullmatch(digest) for digest in digests):
        f.problem(
            "api_key_digests",
            "entries must be SHA-256 hex digests (64 lower-case hex "
            "characters); compute one with `denv key digest`",
        )
    return tuple(digest for digest in digests if digest), tuple(scopes)


def _read_key_scope(f: Fields) -> KeyScope:
    digest = f.text("digest", example="<output of `denv key digest`>")
    f.known.update(("pools", "rate"))  # both may be left out
    pools = f.text_list("pools") if f.has("pools") else None
    if f.raw.get("pools", ()) in ([], None):
        f.problem("pools", "is empty; list the recipes this key may use, or leave pools out")
    rate = f.integer("rate", 0, 1, 1_000_000) if f.has("rate") else None
    f.finish()
    return KeyScope(digest, pools or None, rate or None)


def _check_key_scopes(problems: Problems, stack: StackSpec) -> None:
    """A key's pools are recipes of this stack; the key is named by its entry and digest."""
    recipes = [recipe.name for recipe in stack.recipes]
    paths = {
        digest: f"balancer.api_key_digests[{i}]"
        for i, digest in enumerate(stack.balancer.api_key_digests)
    }
    for scope in stack.balancer.key_scopes:
        for pool in scope.pools or ():
            if pool not in recipes:
                problems.add(
                    f"{paths.get(scope.digest, 'balancer.api_key_digests')}.pools",
                    f'key {scope.digest[:12]}... may use pool "{pool}", which no recipe names;'
                    f" use one of {', '.join(recipes)}",
                )


def _read_timers(f: Fields) -> BalancerTimers:
    """The balancer's timers: each from 1 ms to a minute; a check's timeout within its
    interval, since a check still waiting when the next is due delays the verdict."""
    default = BalancerTimers()
    timers = BalancerTimers(
        connect_timeout_ms=f.integer("connect_timeout_ms", default.connect_timeout_ms, 1, 60000),
        check_timeout_ms=f.integer("check_timeout_ms", default.check_timeout_ms, 1, 60000),
        check_inter_ms=f.integer("check_inter_ms", default.check_inter_ms, 10, 60000),
        agent_inter_ms=f.integer("agent_inter_ms", default.agent_inter_ms, 10, 60000),
    )
    if timers.check_timeout_ms > timers.check_inter_ms:
        f.problem(
            "check_timeout_ms",
            f"{timers.check_timeout_ms} exceeds check_inter_ms ({timers.check_inter_ms}); a"
            " check would still wait when the next is due: lower it or raise check_inter_ms",
        )
    f.finish()
    return timers


def _duplicates(names: list[str]) -> list[str]:
    return sorted(n for n, c in Counter(names).items() if c > 1 and n)


def _check_references(problems: Problems, stack: StackSpec, catalog: Catalog) -> None:
    site_names = [s.name for s in stack.sites]
    for dup in _duplicates(site_names):
        problems.add("sites", f'site name "{dup}" is used twice; give each site its own name')
    for i, site in enumerate(stack.sites):
        for dup in _duplicates([n.name for n in site.nodes]):
            problems.add(f"sites[{i}].nodes", f'node name "{dup}" is used twice; rename one')
    recipe_names = [r.name for r in stack.recipes]
    for dup in _duplicates(recipe_names):
        problems.add("recipes", f'recipe name "{dup}" is used twice; give each recipe its own name')
    for dup in _duplicates([m for r in stack.recipes for m in r.model_names]):
        problems.add(
            "recipes", f'model name "{dup}" is routed to two recipes; a model needs one pool'
        )
    by_name = {s.name: s for s in stack.sites}
    for i, recipe in enumerate(stack.recipes):
        path = f"recipes[{i}]"
        for dup in _duplicates(list(recipe.sites)):
            problems.add(f"{path}.sites", f'site "{dup}" is listed twice; list each site once')
        for gpu in recipe.gpu_models:
            if catalog.gpu(gpu) is None:
                problems.add(
                    f"{path}.gpu_models",
                    f'GPU model "{gpu}" is unknown; use one of {catalog.gpu_names()}',
                )
        for site_name in recipe.sites:
            listed = by_name.get(site_name)
            if listed is None:
                problems.add(
                    f"{path}.sites",
                    f'site "{site_name}" is not defined; define it under '
                    f"denv:sites or use one of {', '.join(site_names)}",
                )
                continue
            _check_share(problems, path, recipe, listed, catalog)
    first_listed: dict[str, int] = {}
    for index, name in enumerate(stack.balancer.sites):
        if name in first_listed:
            problems.add(
                f"balancer.sites[{index}]",
                f'site "{name}" is also balancer.sites[{first_listed[name]}]; list each site once',
            )
            continue
        first_listed[name] = index
        if name not in by_name:
            problems.add(
                "balancer.sites",
                f'site "{name}" is not defined; use one of {", ".join(site_names)}',
            )
        elif by_name[name].kind not in BALANCER_HOST_KINDS:
            problems.add(
                "balancer.sites",
                f"{name}: a {by_name[name].kind} site cannot host the balancer yet; "
                f"use one of {', '.join(BALANCER_HOST_KINDS)}",
            )
    _check_key_scopes(problems, stack)
    _check_addresses(problems, stack)
    overlay_problems(problems, stack)
    _check_machine_names(problems, stack)
    _check_provider_names(problems, stack)
    for i, recipe in enumerate(stack.recipes):
        on_kubernetes = [
            s for s in recipe.sites if s in by_name and by_name[s].kind == "kubernetes"
        ]
        if on_kubernetes and recipe.name[:1].isdigit():
            problems.add(
                f"recipes[{i}].name",
                f'"{recipe.name}" names the Kubernetes Service of its pool on '
                f"{', '.join(on_kubernetes)}, which must start with a letter; rename it",
            )
    stack_port_problems(problems, stack)


def _check_provider_names(problems: Problems, stack: StackSpec) -> None:
    """Names a provider would cut or refuse: Lambda's 60 characters, Nebius host names,
    Kubernetes label values."""
    for i, site in enumerate(stack.sites):
        if site.kind == "lambda":
            names = [
                lambda_full_name(stack.name, site.name, "cache"),
                lambda_full_name(stack.name, site.name, f"node-{max(site.max_nodes - 1, 0)}"),
            ]
            longest = max(names, key=len)
            if len(longest) > LAMBDA_NAME_LENGTH:
                # Cut to 60, two sites' names could become one Lambda filesystem or instance.
                problems.add(
                    f"sites[{i}].name",
                    f"Lambda names of this site, like {longest}, take {len(longest)} characters, "
                    f"past Lambda's {LAMBDA_NAME_LENGTH}; shorten the site or the stack name",
                )
        if site.kind == "nebius":
            nodes = [n.name for n in site.nodes] or [f"node-{max(site.max_nodes - 1, 0)}"]
            problem = next(
                (p for n in nodes if (p := nebius_host_problem(stack.name, site.name, n))), ""
            )
            if problem:
                problems.add(f"sites[{i}]", problem)
        if site.kind == "kubernetes" and not LABEL_VALUE.fullmatch(stack.name):
            problems.add(
                f"sites[{i}]",
                f'the stack name "{stack.name}" labels every object of this Kubernetes site, and '
                "a label value is at most 63 letters, digits, '-', '_' and '.'; use a shorter "
                "stack name",
            )


def _check_machine_names(problems: Problems, stack: StackSpec) -> None:
    """Machines are named stack-site-node: site a-b's node c and site a's node b-c would be one."""
    owners: dict[str, str] = {}
    for i, site in enumerate(stack.sites):
        listed = [(f"sites[{i}].nodes[{j}].name", n.name) for j, n in enumerate(site.nodes)]
        created = [(f"sites[{i}].max_nodes", f"node-{k}") for k in range(site.max_nodes)]
        for path, node in listed if site.nodes else created:
            joined = f"{site.name}-{node}"
            if joined in owners:
                problems.add(
                    path,
                    f"node {node} of site {site.name} makes the machine name {joined}, as "
                    f"{owners[joined]} does; rename a site or a node",
                )
            owners.setdefault(joined, f"node {node} of site {site.name}")


def _check_addresses(problems: Problems, stack: StackSpec) -> None:
    """Two nodes on one machine: the spare that should survive the first would die with it."""
    owners: dict[str, str] = {}
    for i, site in enumerate(stack.sites):
        for j, node in enumerate(site.nodes):
            if not node.address:
                continue
            key = _canonical_host(node.address)
            if key in owners:
                problems.add(
                    f"sites[{i}].nodes[{j}].address",
                    f'"{node.address}" is also the address of {owners[key]}; a spare on the same '
                    "machine fails with it: give each node its own machine",
                )
            else:
                owners[key] = f"node {node.name} of site {site.name}"


def _canonical_host(address: str) -> str:
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        return address.lower().rstrip(".")


def site_gpu_models(site: SiteSpec) -> list[str]:
    models = [n.gpu for n in site.nodes] + ([site.gpu] if site.gpu else [])
    return sorted(set(m for m in models if m))


def _check_share(
    problems: Problems, path: str, recipe: RecipeSpec, site: SiteSpec, catalog: Catalog
) -> None:
    models = site_gpu_models(site)
    if recipe.gpu_models:
        models = [m for m in models if m in recipe.gpu_models]
        if not models and all(catalog.gpu(m) for m in recipe.gpu_models):
            problems.add(
                f"{path}.sites",
                f'site "{site.name}" has no {"/".join(recipe.gpu_models)} '
                "GPUs; remove it from this recipe or allow its GPU in gpu_models",
            )
            return
    if not recipe.is_mig:
        return
    if site.mig_strategy == "single":
        problems.add(
            f"{path}.gpu",
            f'MIG profile "{recipe.share}" on site {site.name}, whose GPU operator runs the single'
            f" MIG strategy: it never offers nvidia.com/mig-{recipe.share}, so the pods would"
            " stay Pending; reinstall the operator with --set mig.strategy=mixed and set"
            " mig_strategy: mixed, or use a whole GPU",
        )
        return
    for model in models:
        gpu = catalog.gpus[model]
        if not gpu.has_mig:
            problems.add(
                f"{path}.gpu",
                f'MIG profile "{recipe.share}" does not exist on {model} '
                f"({model} has no MIG, site {site.name}); use a whole GPU",
            )
        elif recipe.share not in gpu.mig_profiles:
            problems.add(
                f"{path}.gpu",
                f'MIG profile "{recipe.share}" does not exist on {model} '
                f"(site {site.name}); use one of {', '.join(gpu.mig_profiles)}",
            )
