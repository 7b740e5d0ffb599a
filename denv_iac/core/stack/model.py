"""The validated model of a stack: sites, recipes, the balancer. Plain data, no Pulumi."""

from dataclasses import dataclass, field, replace
from typing import Literal

SITE_KINDS = (
    "aws",
    "lambda",
    "nebius",
    "hetzner",
    "joined",
    "kubernetes",
    "local",
)
# Sites whose machines the deploy reaches over SSH; a local site's nodes are this machine.
SSH_SITE_KINDS = ("aws", "hetzner", "joined", "lambda", "nebius")
# Where a balancer can run: a machine made for it (aws, hetzner) or a listed node (joined, local).
BALANCER_HOST_KINDS = ("aws", "hetzner", "joined", "local")
# Where the balancer runs on a machine made for it, reached with the site's key.
MADE_BALANCER_HOST_KINDS = ("aws", "hetzner")
Survive = Literal["node", "site"]
WHOLE_GPU = "whole"
# Silence budgets that fit voice: a turn whose replica has said nothing for a second is better
# retried (before its first byte) or cut (after it) than left waiting on a frozen GPU process.
FIRST_TOKEN_TIMEOUT_MS = 1000
STALL_TIMEOUT_MS = 1000
# What one replica admits at once without queueing, when the recipe does not say: a chat model
# on one GPU decodes tens of sequences together (vLLM's --max-num-seqs bounds it). The balancer
# sends a replica no more than this and queues the rest itself (see docs/balancer.md), so set
# it to what the engine runs at once: the engine's own limit, or 1-4 for a speech server.
MAX_CONCURRENCY = 32
# The balancer's timers, for replicas on a data-centre network.
# How often the agent's verdict (GPU faults, drains) is asked for: it is a fault's way out.
AGENT_INTER_MS = 200
CHECK_INTER_MS = 1000
# How long a health check may wait for its answer. Without it a check may take `inter`, so a
# replica that hangs is found later, and one that answers again waits for the check that hung
# to give up before it can come back.
CHECK_TIMEOUT_MS = 500
# Also the wait before retrying a refused connect, i.e. what a replica that just died costs the
# next request: keep it small, but above the round trip to every site.
CONNECT_TIMEOUT_MS = 80
# How long a rollout waits for a drained replica's streams and realtime sessions to end before it
# restarts the replica anyway (and names what it cut): a voice call of a couple of minutes.
DRAIN_TIMEOUT_S = 120
# A connection to a drained replica that moved no byte either way for this long carries no work
# the drain must wait for: HAProxy keeps an idle connection to a drained server for reuse (2.6:
# one per server, for minutes, `used_conn_cur` 0 and `scur` 0), and a server that never closes
# idle keep-alive connections holds it open. A started stream silent past its budget is cut by
# the balancer; realtime clients ping every 20-30 s; a request still waiting for its first
# byte is retried on another replica when its connection closes. Raised to a pool's
# longest silence budget where that is longer.
QUIET_CONNECTION_S = 40
# How long a replica may take from start to serving: weights loaded, kernels compiled.
COLD_START_BUDGET_S = 900
# How long a model server is given to stop once asked (SIGTERM, then SIGKILL), after its drain.
SERVER_STOP_S = 30


@dataclass(frozen=True)
class Secret:
    """A value Pulumi keeps encrypted (`secure:` in stack config). Never printed."""

    ciphertext: str

    def __repr__(self) -> str:
        return "Secret(<redacted>)"

    __str__ = __repr__


@dataclass(frozen=True)
class NodeSpec:
    """A machine that already exists: a local simulated node, a joined host, a Hetzner GEX box."""

    name: str
    gpu: str  # GPU model name from the catalog
    gpu_count: int
    address: str = ""  # SSH/data-plane address; empty for local nodes (127.0.0.1)
    ssh_user: str = "root"
    server_model: str = ""  # Hetzner GEX model, when the node is one
    # No inbound path from the internet (an office or lab behind NAT): the node dials out to the
    # balancer hosts over the overlay and keeps its NAT mapping open; joined nodes only.
    behind_nat: bool = False


@dataclass(frozen=True)
class SiteSpec:
    name: str
    kind: str  # one of SITE_KINDS
    nodes: tuple[NodeSpec, ...] = ()  # existing machines (local, joined, hetzner)
    # Sites that create machines: which offering, where, and at most how many.
    region: str = ""
    offering: str = ""  # AWS instance type, Lambda instance type, Nebius "platform/preset"
    max_nodes: int = 0
    gpu: str = ""  # the GPU model of created nodes (resolved from the offering, or declared on k8s)
    gpus_per_node: int = 0
    price_per_gpu_hour: float | None = None  # overrides the catalog's list price
    admin_cidrs: tuple[str, ...] = ()
    ssh_private_key: Secret | None = None
    api_key: Secret | None = None  # Lambda Cloud
    kubeconfig: Secret | None = None  # Kubernetes
    # Hetzner: the Robot webservice user that manages the GEX boxes' firewall (none: no Robot
    # firewall is set, and the node's nftables alone filter).
    robot_user: Secret | None = None
    robot_password: Secret | None = None
    # Hetzner: the name of an SSH key already in the Hetzner Cloud project that holds the site's
    # public key; the balancer host is made with it and no key is uploaded ("": one is).
    hcloud_ssh_key: str = ""
    namespace: str = ""
    # Kubernetes: the GPU operator's MIG strategy as installed on the cluster ("" when unstated).
    mig_strategy: str = ""
    project_id: str = ""  # Nebius parent project
    subnet_id: str = ""  # Nebius / AWS subnet, optional on AWS
    image: str = ""  # AMI SSM parameter, Nebius image family
    cache_size_gb: int = 500
    # The round trip from the balancer to the site's replicas, in ms, as `denv status` measures
    # it: the connect timeout of the tiers that use the site follows it (see
    # balancer.model.connect_timeout_for). None: unknown, the stack's timers.connect_timeout_ms.
    # A local site runs on the balancer's own machine: 0.
    round_trip_ms: float | None = None

    @property
    def creates_nodes(self) -> bool:
        return self.kind in ("aws", "lambda", "nebius", "kubernetes")


# The GPU operator's MIG strategies: `mixed` offers each profile as nvidia.com/mig-<profile>,
# `single` (its default) offers MIG slices as nvidia.com/gpu.
MIG_STRATEGIES = ("mixed", "single")

# What answers /v1/audio/speech on a simulated replica: a tone paced like tokens, or espeak-ng's
# real synthesized speech (Debian's espeak-ng, on the CPU).
SIMULATED_SPEECH = ("tone", "espeak-ng")
# Engines whose Prometheus metrics the node agent reads (queue, running, generated tokens)
# (llama.cpp's llama-server: with --metrics), and those whose names a simulated replica serves
# at /metrics (llama.cpp runs for real on a CPU: it needs no stand-in).
ENGINES = ("vllm", "sglang", "tgi", "llamacpp")
SIMULATED_ENGINES = ("vllm", "sglang", "tgi")
# A recipe's `engine` by default: the agent reads `metrics_path` and knows the engine by its
# metric names (any of ENGINES), so a zombie engine is taken out within 2 s on nodes
# too, with no setting; a server that serves none of them is left to its health checks.
AUTO_ENGINE = "auto"
# `engine: none`: the agent reads no metrics.
NO_ENGINE = "none"


@dataclass(frozen=True)
class SimulatedServer:
    """How the local runner's simulated replica behaves for a recipe.

    The capacity defaults are those of one GPU: an LLM decodes a few tens of sequences at once
    (vLLM's `--max-num-seqs` is bounded by the KV cache long before its default), a TTS server
    synthesizes a couple of requests at once, a speech-to-text server a few.
    """

    ttft_ms: int = 40
    itl_ms: int = 10
    tokens: int = 16
    speech: str = SIMULATED_SPEECH[0]
    engine: str = SIMULATED_ENGINES[0]
    slots: int = 32  # chat sequences decoding at once; the rest wait in a FIFO queue
    # Each running sequence past the first adds this share of itl_ms to the time between tokens.
    itl_growth: float = 0.02
    queue_limit: int | None = None  # requests waiting past which new ones get a 503; None: no limit
    speech_slots: int = 2
    transcription_slots: int = 4


# A canary's pool is its recipe's name with this suffix: the replicas of the new version run as
# a pool of their own on nodes and sites, and serve in the recipe's pool at the balancer.
CANARY_SUFFIX = "-canary"
# What a canary may run differently from its recipe: the fields that make a replica's version.
CANARY_FIELDS = ("image", "command", "env", "simulate")


@dataclass(frozen=True)
class CanarySpec:
    """A new version run beside a recipe's: `replicas` of it, taking `share` of new sessions.

    Each field given replaces the recipe's whole field (`env` replaces every plain variable;
    the recipe's `secure:` ones stay); None keeps the recipe's. Promotion copies the given
    fields into the recipe and drops the block.
    """

    share: float  # fraction of new sessions, 0 < share < 1
    replicas: int = 1
    image: str | None = None
    command: tuple[str, ...] | None = None
    env: tuple[tuple[str, str], ...] | None = None
    simulate: SimulatedServer | None = None


@dataclass(frozen=True)
class RecipeSpec:
    name: str
    share: str  # WHOLE_GPU or a MIG profile such as "1g.10gb"
    tiers: tuple[tuple[str, ...], ...]  # site names by preference; sites in one tuple share a tier
    min_warm: int
    spare: int = 1
    survive: Survive = "node"
    gpu_models: tuple[str, ...] = ()  # GPU models allowed; empty = any
    models: tuple[str, ...] = ()  # OpenAI `model` names routed to this pool (default: its name)
    command: tuple[str, ...] = ()  # model server command; empty = the simulator on local sites
    image: str = ""  # container image on nodes and Kubernetes
    port: int = 8000
    health_path: str = "/health"
    cold_start_budget_s: int = COLD_START_BUDGET_S
    drain_timeout_s: int = DRAIN_TIMEOUT_S
    ttft_budget_ms: int | None = None
    # How long a request may wait for its first response byte before the balancer retries it on
    # another replica, and how long a started stream may stay silent before it is cut.
    first_token_timeout_ms: int = FIRST_TOKEN_TIMEOUT_MS
    stall_timeout_ms: int = STALL_TIMEOUT_MS
    # Requests one replica takes at once; the balancer queues the rest, then spills or sheds.
    max_concurrency: int = MAX_CONCURRENCY
    # How long a request may wait in the balancer for a slot; a full tier that would not start
    # it within this refuses it at once. None: a share of first_token_timeout_ms (see
    # balancer.model.default_queue_budget_ms).
    queue_budget_ms: int | None = None
    cache_dirs: tuple[str, ...] = ("/var/cache/denv/hf", "/var/cache/denv/compile")
    session_affinity: bool = True
    env: tuple[tuple[str, str], ...] = ()
    # Env values given as `secure:`: each stays a Pulumi secret to the node's 0600 env file or
    # the site's Kubernetes Secret, and is never printed.
    secret_env: tuple[tuple[str, Secret], ...] = ()
    simulate: SimulatedServer = field(default_factory=SimulatedServer)
    # Whose metrics the node agent reads at metrics_path: one of ENGINES, or AUTO_ENGINE (the
    # agent tells by the names it finds); None (`engine: none`): it reads none.
    engine: str | None = AUTO_ENGINE
    metrics_path: str = "/metrics"
    canary: CanarySpec | None = None
    # Set on a canary's own pool (see canary_recipe): the recipe whose new version it runs.
    canary_of: str = ""

    def agent_engine(self, simulated: bool) -> str | None:
        """The engine the agent watches: the recipe's; on a simulated replica, unless the
        recipe names one, the simulator's own."""
        if simulated and self.engine == AUTO_ENGINE:
            return self.simulate.engine
        return self.engine

    @property
    def is_mig(self) -> bool:
        return self.share != WHOLE_GPU

    @property
    def replicas_wanted(self) -> int:
        return self.min_warm + self.spare

    @property
    def sites(self) -> tuple[str, ...]:
        return tuple(s for tier in self.tiers for s in tier)

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.models or (self.name,)


@dataclass(frozen=True)
class DnsSpec:
    zone_id: str
    name: str
    ttl: int = 30


# The overlay's defaults: a private range far from the usual office and cloud subnets, and
# WireGuard's registered port.
OVERLAY_CIDR = "10.99.0.0/16"
WIREGUARD_PORT = 51820


@dataclass(frozen=True)
class OverlaySpec:
    """The WireGuard overlay between balancer hosts and the nodes they reach over SSH."""

    enabled: bool = True
    cidr: str = OVERLAY_CIDR
    port: int = WIREGUARD_PORT  # UDP, on every member's public address


@dataclass(frozen=True)
class BalancerTimers:
    """How fast the balancer gives up on a replica: a connect or a health check past its
    timeout takes the replica out of rotation until two checks pass again."""

    connect_timeout_ms: int = CONNECT_TIMEOUT_MS
    check_timeout_ms: int = CHECK_TIMEOUT_MS
    check_inter_ms: int = CHECK_INTER_MS
    agent_inter_ms: int = AGENT_INTER_MS


@dataclass(frozen=True)
class KeyScope:
    """What one API key may use, for a key that may not use everything: the pools (recipe
    names) it reaches, and at most `rate` requests a second on each balancer host."""

    digest: str  # the key's SHA-256 hex digest, as in api_key_digests
    pools: tuple[str, ...] | None = None  # None: every pool
    rate: int | None = None  # requests a second; None: no bound


@dataclass(frozen=True)
class BalancerSpec:
    sites: tuple[str, ...]  # where HAProxy instances run
    port: int = 8080
    api_key_digests: tuple[str, ...] = ()  # SHA-256 hex digests of accepted API keys
    # The keys above that are limited to some pools or to a rate; any other key uses every pool.
    key_scopes: tuple[KeyScope, ...] = ()
    tls_certificate: Secret | None = None
    # Signs the short-lived realtime client secrets the endpoint mints for browsers and apps.
    client_secret_key: Secret | None = None
    prometheus_port: int = 8405
    dns: DnsSpec | None = None
    overlay: OverlaySpec = OverlaySpec()
    timers: BalancerTimers = BalancerTimers()


@dataclass(frozen=True)
class StackSpec:
    name: str
    sites: tuple[SiteSpec, ...]
    recipes: tuple[RecipeSpec, ...]
    balancer: BalancerSpec

    def site(self, name: str) -> SiteSpec:
        return next(s for s in self.sites if s.name == name)

    @property
    def pools(self) -> tuple[RecipeSpec, ...]:
        """The pools the endpoint serves: every recipe but the canaries' own pools, which
        serve inside their recipe's."""
        return tuple(r for r in self.recipes if not r.canary_of)

    def canary_pool(self, pool: str) -> RecipeSpec | None:
        """The canary pool of a recipe, when it has one."""
        return next((r for r in self.recipes if r.canary_of == pool), None)


def replica_version(recipe: RecipeSpec) -> tuple[object, ...]:
    """What tells two versions of a recipe's replicas apart: the fields a canary may change."""
    return (
        recipe.image,
        recipe.command,
        recipe.env,
        recipe.secret_env,
        recipe.simulate,
    )


def canary_recipe(recipe: RecipeSpec, canary: CanarySpec) -> RecipeSpec:
    """The pool that runs a recipe's canary: the recipe with the canary's fields, `replicas`
    replicas none of which is a warm minimum (a canary may go down without the recipe's pool
    falling short), serving the recipe's model names."""
    return replace(
        recipe,
        name=f"{recipe.name}{CANARY_SUFFIX}",
        min_warm=0,
        spare=canary.replicas,
        models=recipe.model_names,
        canary=None,
        canary_of=recipe.name,
        image=recipe.image if canary.image is None else canary.image,
        command=recipe.command if canary.command is None else canary.command,
        env=recipe.env if canary.env is None else canary.env,
        simulate=recipe.simulate if canary.simulate is None else canary.simulate,
    )
