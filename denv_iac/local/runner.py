"""`denv local up`: the whole data plane of a stack on this machine.

Simulated replicas (or the recipe's own command, see denv_iac.local.command_replica), one real
`denv-agent --simulate` per node and a real HAProxy, all on 127.0.0.1 unless each site is given
a Host of its own (a network namespace, see denv_iac.local.netns). Run state lives in
`.denv/<stack>/`, with `state.json` for scripts (denv_iac.local.run_state): the endpoint, the
admin socket, and each replica's id, address, port, agent port and pid.
Everything started is recorded there by pid so that `denv local down` stops exactly that
(denv_iac.local.stopping).
"""

import dataclasses
import functools
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from denv_agent.engine_metrics import ENGINE_NAMES

from denv_iac.core.agent_config import AgentConfig, AgentReplica, agent_config_toml, recipe_probe
from denv_iac.core.balancer import BalancerPool, BalancerSettings, render_haproxy_config
from denv_iac.core.balancer.client_secrets import key_map
from denv_iac.core.balancer.files import relocate_maps
from denv_iac.core.dataplane import balancer_pools
from denv_iac.core.endpoint import balancer_settings
from denv_iac.core.placement import PlacedReplica, place_replicas
from denv_iac.core.stack.model import RecipeSpec, StackSpec
from denv_iac.core.stack.reader import StackError
from denv_iac.haproxy.files import write_config
from denv_iac.haproxy.runtime import HaproxyProcess, stats_command
from denv_iac.local.command_replica import CommandConfig, CommandReplica
from denv_iac.local.processes import (
    LOOPBACK,
    REPLICA_MARK,
    Host,
    RestartBackoff,
    endpoint_in_use,
    free_port,
    wait_for_port,
)
from denv_iac.local.replica_model import ReplicaSimConfig
from denv_iac.local.replica_sim import ReplicaProcess
from denv_iac.local.run_state import STATE_FILE, AgentState, ReplicaState, RunState, write_private

Progress = Callable[[str], None]
# What a local replica runs: the simulator, or the recipe's own command.
ReplicaConfig = ReplicaSimConfig | CommandConfig
LocalReplica = ReplicaProcess | CommandReplica


def check_local_only(stack: StackSpec) -> None:
    remote = [s.name for s in stack.sites if s.kind != "local"]
    if remote:
        raise StackError(
            [
                f"--stack: {stack.name} has sites that are not local ({', '.join(remote)}); "
                "`denv local up` runs local sites only: use a stack like stacks/Pulumi.local.yaml"
            ]
        )


def local_agent_config(
    node: str,
    gpus: int,
    state: AgentState,
    token: str,
    state_file: Path,
    replicas: list[ReplicaState],
    recipes: dict[str, RecipeSpec],
) -> str:
    """A simulated node's agent config: fast intervals, the node's GPUs simulated."""
    intervals = {
        "gpu_poll_s": 0.1,
        "health_s": 0.25,
        "health_timeout_s": 0.5,
        "probe_s": 1.0,
        "metrics_s": 0.25,
    }
    entries = []
    for replica in replicas:
        recipe = recipes[replica.pool]
        # A recipe without a command runs the simulated replica, whose engine is known.
        probe = recipe_probe(recipe, recipe.agent_engine(simulated=not recipe.command))
        entries.append(
            AgentReplica(
                id=replica.id,
                health_url=f"{replica.url}{recipe.health_path}",
                gpu=replica.gpu,
                # The simulated replica serves the recipe's name.
                probe=None if probe is None else dataclasses.replace(probe, model=recipe.name),
                metrics_url=f"{replica.url}{recipe.metrics_path}",
            )
        )
    return agent_config_toml(
        AgentConfig(
            node=node,
            state_file=str(state_file),
            control_token=token,
            agent_check=f"{state.address}:{state.agent_port}",
            http=f"{state.address}:{state.http_port}",
            replicas=tuple(entries),
            tables={"intervals": intervals, "simulate": {"gpus": gpus}},
        )
    )


class LocalCluster:
    """Starts and stops one stack's local data plane.

    Each site runs on its Host in `hosts` (loopback when absent), HAProxy on `balancer`.
    """

    def __init__(
        self,
        stack: StackSpec,
        directory: Path,
        port: int | None = None,
        hosts: Mapping[str, Host] | None = None,
        balancer: Host = LOOPBACK,
        project: Path | None = None,
    ) -> None:
        check_local_only(stack)
        # Where a recipe's command runs (relative paths in it start there).
        self.project = project
        self.stack = stack
        self.directory = directory
        self.port = port or stack.balancer.port
        self.hosts = dict(hosts or {})
        self.balancer = balancer
        self.placement = place_replicas(stack)
        self._replicas: dict[str, LocalReplica] = {}
        self._agents: list[subprocess.Popen[bytes]] = []
        self._agent_commands: list[list[str]] = []
        self._haproxy: HaproxyProcess | None = None
        self._extra_balancers: list[HaproxyProcess] = []
        self.state: RunState | None = None
        # Held while a process is (re)started or stopped, so a supervisor never races a repair
        # or a shutdown; `_stopping` keeps it from restarting what down() stops.
        self._lock = threading.RLock()
        self._stopping = False
        self._backoff: dict[str, RestartBackoff] = {}
        # One token per run of the stack: the agents' control API and the replicas' fault route.
        self._token = secrets.token_hex(16)

    def up(self, progress: Progress = lambda _: None) -> RunState:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "logs").mkdir(exist_ok=True)
        if endpoint_in_use(self.port, self.balancer.address):
            raise StackError(
                [
                    f"--port: {self.balancer.address}:{self.port} is taken; stop what uses it, run "
                    "`denv local down`, or pass --port"
                ]
            )
        try:
            replicas = self._start_replicas(progress)
            agents = self._start_agents(replicas, progress)
            self.state = self._start_haproxy(replicas, agents, progress)
        except BaseException:
            self.down()
            raise
        self._save_state()
        return self.state

    def _save_state(self) -> None:
        assert self.state is not None
        write_private(self.directory / STATE_FILE, self.state.to_json())

    def host_of(self, site: str) -> Host:
        return self.hosts.get(site, LOOPBACK)

    def replica_config(self, recipe: RecipeSpec, replica: PlacedReplica) -> ReplicaConfig:
        """What the replica of `recipe` runs on its site's host: the recipe's command, or the
        simulated replica when it has none."""
        if recipe.command:
            config = command_config(recipe, replica.id, self.host_of(replica.site).address)
            return dataclasses.replace(
                config, workdir=None if self.project is None else str(self.project)
            )
        sim = recipe.simulate
        return ReplicaSimConfig(
            replica.id,
            self.host_of(replica.site).address,
            0,
            sim.ttft_ms,
            sim.itl_ms,
            sim.tokens,
            sim.speech,
            engine=sim.engine,
            model=recipe.model_names[0],
            slots=sim.slots,
            itl_growth=sim.itl_growth,
            queue_limit=sim.queue_limit,
            speech_slots=sim.speech_slots,
            transcription_slots=sim.transcription_slots,
            control_token=self._token,
        )

    def _start_replicas(self, progress: Progress) -> list[ReplicaState]:
        recipes = {r.name: r for r in self.stack.recipes}
        for replica in self.placement.replicas:
            self._replicas[replica.id] = self._spawn_replica(recipes[replica.pool], replica)
        agent_ports = {node: free_port() for node in self._nodes()}
        states = []
        for replica in self.placement.replicas:
            process = self._replicas[replica.id]
            port = process.wait_ready()
            agent_port = agent_ports[f"{replica.site}/{replica.node}"]
            states.append(_replica_state(replica, process, port, agent_port))
            progress(f"replica {replica.id} ready on {process.config.host}:{port}")
        return states

    def _spawn_replica(self, recipe: RecipeSpec, replica: PlacedReplica) -> LocalReplica:
        """Start the replica's process on its site's host; wait_ready() then gives its port."""
        log = self.directory / "logs" / f"{replica.id}.log"
        config = self.replica_config(recipe, replica)
        process = replica_process(config, log, self.host_of(replica.site).prefix)
        process.spawn()
        return process

    def _nodes(self) -> list[str]:
        return [f"{n.site}/{n.name}" for n in self.placement.nodes]

    def _start_agents(self, replicas: list[ReplicaState], progress: Progress) -> list[AgentState]:
        agents = []
        for node in self.placement.nodes:
            key = f"{node.site}/{node.name}"
            mine = [r for r in replicas if f"{r.site}/{r.node}" == key]
            if mine:
                agents.append(self._spawn_node_agent(key, mine[0].agent_port, mine))
        for state in agents:
            wait_for_port(state.agent_port, f"agent of {state.node}", state.address)
            progress(f"agent of {state.node} answering on {state.address}:{state.agent_port}")
        return agents

    def _spawn_node_agent(
        self, node: str, agent_port: int, replicas: list[ReplicaState]
    ) -> AgentState:
        """Start the agent of a node (`site/node`), answering for `replicas`, supervised."""
        site, name = node.split("/", 1)
        path = self.directory / f"agent-{site}-{name}.toml"
        host = self.host_of(site)
        state = AgentState(node, agent_port, free_port(), 0, str(path), host.address)
        self._write_agent_config(state, replicas)
        command = [
            *host.prefix,
            *(sys.executable, "-m", "denv_agent", "--config", str(path), "--simulate"),
        ]
        process = self._spawn_agent(command, site, name)
        self._agents.append(process)
        self._agent_commands.append(command)
        state.pid = process.pid
        return state

    def _write_agent_config(self, agent: AgentState, replicas: list[ReplicaState]) -> None:
        """The agent's config file, answering for `replicas` (those of its node)."""
        site, node = agent.node.split("/", 1)
        placed = next(n for n in self.placement.nodes if (n.site, n.name) == (site, node))
        path = Path(agent.config)
        path.write_text(
            local_agent_config(
                agent.node,
                placed.gpu_count,
                agent,
                self._token,
                self.directory / f"agent-{site}-{node}.state.json",
                replicas,
                {r.name: r for r in self.stack.recipes},
            )
        )
        path.chmod(0o600)

    def add_replica(self, replica: PlacedReplica) -> ReplicaState:
        """Start a replica the stack now places (a canary brought in), and have its node's agent
        answer for it: its config written again, then restarted (its drains live in its state
        file), or started on a node that had none. Not yet in the balancer: rebalance() puts it
        there."""
        with self._lock:
            assert self.state is not None
            recipe = next(r for r in self.stack.recipes if r.name == replica.pool)
            process = self._spawn_replica(recipe, replica)
            try:
                port = process.wait_ready()
            except BaseException:
                process.stop()
                raise
            self._replicas[replica.id] = process
            node = f"{replica.site}/{replica.node}"
            index = next((i for i, a in enumerate(self.state.agents) if a.node == node), None)
            agent_port = free_port() if index is None else self.state.agents[index].agent_port
            state = _replica_state(replica, process, port, agent_port)
            self.state.replicas.append(state)
            mine = [r for r in self.state.replicas if f"{r.site}/{r.node}" == node]
            if index is None:  # a node that had no replica: its agent starts now
                agent = self._spawn_node_agent(node, agent_port, mine)
                self.state.agents.append(agent)
                wait_for_port(agent_port, f"agent of {node}", agent.address)
            else:
                self._write_agent_config(self.state.agents[index], mine)
                self._agents[index].terminate()
                self._agents[index].wait(5)
                self._restart_agent(index)
            self._save_state()
            return state

    def _spawn_agent(self, command: list[str], site: str, node: str) -> subprocess.Popen[bytes]:
        with (self.directory / "logs" / f"agent-{site}-{node}.log").open("ab") as log:
            return subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def _start_haproxy(
        self, replicas: list[ReplicaState], agents: list[AgentState], progress: Progress
    ) -> RunState:
        pools = self._balancer_pools(replicas)
        socket_path = self.directory / "haproxy.sock"
        prometheus = free_port()
        # The stack's settings, timers included, as `denv plan` shows them; only where HAProxy
        # listens and keeps its files is local (plain HTTP: no certificate is installed here).
        # Realtime client secrets, when the stack has them, are signed with a key of this run.
        stack_settings = balancer_settings(self.stack)
        settings = dataclasses.replace(
            stack_settings,
            client_secret_key_file=(
                None if stack_settings.client_secret_key_file is None else self._client_secret_key()
            ),
            bind_address=self.balancer.address,
            port=self.port,
            tls_cert_path=None,
            stats_socket=str(socket_path),
            prometheus_port=prometheus,
            prometheus_address=None,
            state_file=str(self.directory / "haproxy.state"),
        )
        self._pools, self._settings = pools, settings
        config_path = self._write_balancer_config()
        self._haproxy = HaproxyProcess(
            config_path,
            socket_path,
            self.directory / "logs" / "haproxy.log",
            command_prefix=self.balancer.prefix,
        )
        self._haproxy.start()
        assert self._haproxy.pid is not None
        address = self.balancer.address
        progress(f"balancer on http://{address}:{self.port}")
        return RunState(
            self.stack.name,
            f"http://{address}:{self.port}",
            str(socket_path),
            f"http://{address}:{prometheus}/metrics",
            self._haproxy.pid,
            self._token,
            replicas,
            agents,
        )

    def _balancer_pools(self, replicas: list[ReplicaState]) -> tuple[BalancerPool, ...]:
        """What the balancer serves: the stack's pools over the running replicas."""
        by_id = {r.id: r for r in replicas}

        def locate(replica: PlacedReplica) -> tuple[str, int, int]:
            state = by_id[replica.id]
            return self._server_address(state), state.port, state.agent_port

        return balancer_pools(self.stack, self.placement, locate)

    def rebalance(self) -> bool:
        """Render the balancer's config again from the stack and placement held now, and reload
        HAProxy without a gap when it changed (a canary's share, its replicas retired); True
        when it did."""
        with self._lock:
            assert self.state is not None and self._haproxy is not None
            pools = self._balancer_pools(self.state.replicas)
            if pools == self._pools:
                return False
            self._pools = pools
            self._write_balancer_config()
            self._save_server_state()
            self._haproxy.reload()
            return True

    def _save_server_state(self) -> None:
        """What HAProxy knows of each server (health, drains), for the worker a reload starts
        to begin from: without it every server starts anew, `UP 1/2` until its first check."""
        if self._settings.state_file is not None:
            state = stats_command(Path(self._settings.stats_socket), "show servers state")
            write_private(Path(self._settings.state_file), state)

    def retire_replica(self, replica_id: str) -> None:
        """Stop a replica the stack no longer places (a canary retired or promoted), once the
        balancer no longer sends it anything; it is not restarted again."""
        with self._lock:
            assert self.state is not None
            self._replicas.pop(replica_id).stop()
            self._backoff.pop(f"replica {replica_id}", None)
            self.state.replicas = [r for r in self.state.replicas if r.id != replica_id]
            self._save_state()

    def _server_address(self, replica: ReplicaState) -> str:
        """Where HAProxy sends the replica's requests and agent checks: where it listens,
        unless something stands in between."""
        return replica.address

    def _client_secret_key(self) -> str:
        """A key of this run that signs realtime client secrets, readable by its owner alone."""
        path = self.directory / "client-secret.map"
        path.unlink(missing_ok=True)
        path.touch(mode=0o600)
        path.write_text(key_map(secrets.token_urlsafe(32)))
        return str(path)

    def _write_balancer_config(self) -> Path:
        maps = str(self.directory / "haproxy")
        rendered = relocate_maps(render_haproxy_config(self._pools, self._settings, maps), maps)
        return write_config(rendered, Path(maps))

    @property
    def balancer_settings(self) -> BalancerSettings:
        return self._settings

    def reload_balancer(self, settings: BalancerSettings) -> None:
        """Render the config again with new settings and reload HAProxy without a gap."""
        assert self._haproxy is not None
        self._settings = settings
        self._write_balancer_config()
        self._haproxy.reload()

    def restart_replica(self, replica_id: str, config: ReplicaConfig | None = None) -> None:
        """Start a replica again on its old port, as a supervisor would after a crash; with
        `config`, running that from now on (a rollout), else what it ran."""
        with self._lock:
            assert self.state is not None
            state = next(r for r in self.state.replicas if r.id == replica_id)
            old = self._replicas[replica_id]
            old.stop()
            config = dataclasses.replace(config or old.config, port=state.port)
            process = replica_process(config, old.log_path, old.command_prefix)
            self._replicas[replica_id] = process
            process.spawn()
            process.wait_ready()
            assert process.pid is not None
            state.pid = process.pid
            state.mark, state.group = _marks(process)
            self._save_state()

    def adopt(self, stack: StackSpec) -> None:
        """Take `stack` as the one running, once a rollout has applied it to every replica."""
        with self._lock:
            self.placement = place_replicas(stack, previous=[r.id for r in self.placement.replicas])
            self.stack = stack

    def supervise(self) -> list[str]:
        """Restart every replica, agent and balancer that died, with backoff; one line each.

        What systemd's Restart= does on a node and a balancer host, for the local runner: a
        replica that crashed comes back on its port, an agent with its drains (they live in its
        state file), HAProxy with its config.
        """
        lines: list[str] = []
        with self._lock:
            if self._stopping or self.state is None:
                return lines
            now = time.monotonic()
            for replica in self.state.replicas:
                process = self._replicas[replica.id]
                if not process.running:
                    lines += self._restart(
                        f"replica {replica.id}",
                        now,
                        functools.partial(self.restart_replica, replica.id),
                    )
            for index, agent in enumerate(self.state.agents):
                if self._agents[index].poll() is not None:
                    lines += self._restart(
                        f"agent of {agent.node}", now, functools.partial(self._restart_agent, index)
                    )
            if self._haproxy is not None and not self._haproxy.running:
                lines += self._restart("balancer", now, self._restart_haproxy)
            if lines:
                self._save_state()
        return lines

    def _restart(self, what: str, now: float, restart: Callable[[], None]) -> list[str]:
        backoff = self._backoff.setdefault(what, RestartBackoff())
        if not backoff.due(now):
            return []
        backoff.restarted(now)
        try:
            restart()
        except (OSError, RuntimeError) as error:
            return [f"{what} died; restart failed ({error}); next try in {backoff.wait_s:.1f} s"]
        return [f"{what} died; restarted (restart {backoff.restarts})"]

    def _restart_agent(self, index: int) -> None:
        assert self.state is not None
        state = self.state.agents[index]
        site, node = state.node.split("/", 1)
        process = self._spawn_agent(self._agent_commands[index], site, node)
        self._agents[index] = process
        state.pid = process.pid
        wait_for_port(state.agent_port, f"agent of {state.node}", state.address)

    def _restart_haproxy(self) -> None:
        assert self._haproxy is not None and self.state is not None
        self._haproxy.stop()
        self._haproxy.start()
        assert self._haproxy.pid is not None
        self.state.haproxy_pid = self._haproxy.pid

    def supervise_until(
        self, stop: threading.Event, say: Progress, interval_s: float = 0.1
    ) -> None:
        """Supervise until `stop` is set: what the foreground `denv local up` does."""
        while not stop.wait(interval_s):
            for line in self.supervise():
                say(line)

    def add_balancer(self) -> tuple[str, HaproxyProcess]:
        """A second HAProxy with the same pools on another port, polling the agents itself
        (no shared state), as a second balancer site would. Stopped by down()."""
        assert self._haproxy is not None
        directory = self.directory / f"balancer-{len(self._extra_balancers) + 2}"
        directory.mkdir(exist_ok=True)
        settings = dataclasses.replace(
            self._settings,
            port=free_port(),
            stats_socket=str(directory / "haproxy.sock"),
            prometheus_port=free_port(),
            state_file=str(directory / "haproxy.state"),
        )
        maps = str(directory)
        rendered = relocate_maps(render_haproxy_config(self._pools, settings, maps), maps)
        process = HaproxyProcess(
            write_config(rendered, directory),
            Path(settings.stats_socket),
            directory / "log",
            command_prefix=self.balancer.prefix,
        )
        process.start()
        self._extra_balancers.append(process)
        return f"http://{self.balancer.address}:{settings.port}", process

    def down(self) -> None:
        with self._lock:
            self._stopping = True
            self._down()

    def _down(self) -> None:
        for balancer in [*self._extra_balancers, self._haproxy]:
            if balancer is not None:
                balancer.stop()
        for process in self._agents:
            if process.poll() is None:
                process.terminate()
        for process in self._agents:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for replica in self._replicas.values():
            replica.stop()
        state_file = self.directory / STATE_FILE
        if state_file.exists():
            state_file.unlink()


@contextmanager
def supervised(cluster: LocalCluster, say: Progress = lambda _: None) -> Iterator[RunState]:
    """The cluster up and supervised as `denv local up` runs it (whatever dies is restarted),
    for a test or a benchmark; stopped, and everything it started with it, on the way out."""
    state = cluster.up()
    stop = threading.Event()
    supervisor = threading.Thread(target=cluster.supervise_until, args=(stop, say), daemon=True)
    supervisor.start()
    try:
        yield state
    finally:
        stop.set()
        supervisor.join(5)
        cluster.down()


def command_config(recipe: RecipeSpec, replica_id: str, host: str) -> CommandConfig:
    """How a recipe's command runs as a local replica: on a free port of `host`, ready within
    the recipe's cold-start budget; for an engine named in the recipe, once its metrics read."""
    family = recipe.agent_engine(simulated=False)
    names = ENGINE_NAMES.get(family or "")
    return CommandConfig(
        replica_id=replica_id,
        recipe=recipe.name,
        command=recipe.command,
        host=host,
        port=free_port(),
        health_path=recipe.health_path,
        metrics_path=recipe.metrics_path,
        metrics_names=(names.running,) if names is not None else (),
        env=recipe.env,
        ready_timeout_s=float(recipe.cold_start_budget_s),
    )


def replica_process(
    config: ReplicaConfig, log: Path | None, prefix: tuple[str, ...]
) -> LocalReplica:
    if isinstance(config, CommandConfig):
        return CommandReplica(config, log, prefix)
    return ReplicaProcess(config, log, prefix)


def _marks(process: LocalReplica) -> tuple[str, bool]:
    """What state.json records to find the process again: its cmdline mark, its group."""
    if isinstance(process, CommandReplica):
        return process.config.mark, True
    return REPLICA_MARK, False


def _replica_state(
    replica: PlacedReplica, process: LocalReplica, port: int, agent_port: int
) -> ReplicaState:
    """What the run state records of a started replica."""
    assert process.pid is not None
    mark, group = _marks(process)
    return ReplicaState(
        replica.id,
        replica.pool,
        replica.site,
        replica.node,
        replica.gpu,
        process.config.host,
        port,
        agent_port,
        process.pid,
        mark,
        group,
    )
