"""`denv local roll`: roll a changed stack file onto a running local stack, replica by replica.

The plan is denv_iac.core.rollout's. Each step, for one replica: check that the rest of its pool
holds `min_warm` ready in HAProxy -> drain it through its node's agent (the agent's verdict is
what every balancer polls, so the drain holds across reloads and balancers; a drain set on the
admin socket alone is undone by the agent's next `up ready`) -> wait until HAProxy shows it
draining, then until it holds no session on any backend (tier and twins: streams, speech and
realtime sessions), bounded by `drain_timeout_s`, past which what is left is cut, counted and
named -> restart it on its port with the new config -> wait until it is warm (health 200, then a
first token from a request sent to it directly) within `cold_start_budget_s` -> undrain -> wait
until HAProxy counts it UP again -> the next. A replica that never becomes warm is started again
with its old config and put back, and the roll stops with one line naming it.
"""

import csv
import io
import json
import os
import secrets
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from denv_agent.control import ControlFailed, drain, undrain

from denv_iac.core.balancer.tiers import TWIN_SUFFIXES
from denv_iac.core.drain import drain_plan
from denv_iac.core.placement import place_replicas
from denv_iac.core.rollout import (
    REPLICA_FIELDS,
    ROLLOUT_FIELDS,
    RolloutPlan,
    RolloutRefused,
    RolloutStep,
    changed_fields,
    min_warm_problem,
    plan_rollout,
)
from denv_iac.core.stack.model import RecipeSpec, StackSpec
from denv_iac.core.stack.reader import StackError
from denv_iac.haproxy.runtime import stats_command
from denv_iac.local.run_state import ReplicaState, write_private
from denv_iac.local.runner import LocalCluster, ReplicaConfig
from denv_iac.waits import wait_until, wait_until_or_last

Progress = Callable[[str], None]
# What a local roll applies: what the simulated replica runs (model names, ports and health
# paths are in the balancer's and agents' configs too: a restart of the stack applies those).
# A canary's share and its retirement: the balancer's weights and servers, reloaded.
LOCAL_FIELDS = (
    tuple(f for f in REPLICA_FIELDS if f not in ("models", "port", "health_path"))
    + tuple(ROLLOUT_FIELDS)
    + ("canary",)
)
# How long HAProxy may take to show a drain or an undrain the agent reports (agent-inter is
# 200 ms; two passing health checks put a restarted replica back UP).
BALANCER_SEES_S = 10.0
POLL_S = 0.05


class RollStopped(RuntimeError):
    """The roll stopped; the message is one line naming the replica and why."""


@dataclass(frozen=True)
class StepResult:
    replica: str
    drain_s: float  # until no session was left (or the bound)
    restart_s: float  # until the new process listened
    warm_s: float  # until its first token, then back UP in the balancer
    cut: int = 0  # sessions still open past drain_timeout_s

    @property
    def seconds(self) -> float:
        return self.drain_s + self.restart_s + self.warm_s


@dataclass
class RollReport:
    steps: list[StepResult] = field(default_factory=list)
    unchanged: tuple[str, ...] = ()
    seconds: float = 0.0
    # Canary replicas the change no longer places: drained, left out of the balancer, stopped.
    retired: list[StepResult] = field(default_factory=list)
    # Canary replicas the change brings in: started, warm, then put in the balancer.
    started: list[StepResult] = field(default_factory=list)
    reweighted: bool = False  # the balancer was reloaded with other weights or servers

    @property
    def cut(self) -> int:
        return sum(s.cut for s in (*self.steps, *self.retired))

    def cut_on(self) -> dict[str, int]:
        """The replicas whose sessions outlived drain_timeout_s, and how many each."""
        return {s.replica: s.cut for s in (*self.steps, *self.retired) if s.cut}

    def line(self) -> str:
        if not (self.steps or self.retired or self.started or self.reweighted):
            return "nothing to roll: every replica runs the stack file's config"
        where = ", ".join(f"{replica} {n}" for replica, n in self.cut_on().items())
        done = []
        if self.steps:
            done.append(
                f"rolled {len(self.steps)} replica(s) in {self.seconds:.1f} s "
                f"({', '.join(f'{s.replica} {s.seconds:.1f} s' for s in self.steps)})"
            )
        if self.started:
            started = (f"{s.replica} (warm in {s.seconds:.1f} s)" for s in self.started)
            done.append(f"started {', '.join(started)}")
        if self.retired:
            retired = (f"{s.replica} (drained in {s.drain_s:.1f} s)" for s in self.retired)
            done.append(f"retired {', '.join(retired)}")
        if self.reweighted:
            done.append("balancer reloaded with the new weights")
        return f"{'; '.join(done)}; {len(self.unchanged)} unchanged; {self.cut} session(s) cut" + (
            f" past drain_timeout_s ({where})" if where else ""
        )


def local_problems(before: StackSpec, after: StackSpec, plan: RolloutPlan) -> list[str]:
    """What a local roll cannot apply, one line each (the stack must be restarted for it)."""
    how = "a local roll restarts replicas only; `denv local down` then `denv local up` apply it"
    problems = [f"denv:{part}: changed; {how}" for part in _changed_parts(before, after)]
    old = {r.name: r for r in before.recipes}
    for recipe in after.recipes:
        if recipe.name not in old and recipe.canary_of:
            continue  # a canary brought in: its replicas are started
        if recipe.name not in old:
            problems.append(f"recipes[{recipe.name}]: new; {how}")
            continue
        for name in changed_fields(old[recipe.name], recipe):
            if name not in LOCAL_FIELDS:
                problems.append(f"recipes[{recipe.name}].{name}: changed; {how}")
    problems += [f"recipes: {name} removed; {how}" for name in _gone(before, after)]
    canary = retiring_replicas(before, plan) + starting_replicas(after, plan)
    moved = [r for r in plan.added + plan.removed if r not in canary]
    if not problems and moved:
        problems.append(f"placement: replicas {', '.join(moved)} move; {how}")
    return problems


def starting_replicas(after: StackSpec, plan: RolloutPlan) -> tuple[str, ...]:
    """Replicas of a canary that the change places anew (the canary brought in, or given more
    replicas): a local roll starts them, waits until they are warm, then puts them in the
    balancer."""
    canaries = {r.name for r in after.recipes if r.canary_of}
    return tuple(r for r in plan.added if r.split(".", 1)[0] in canaries)


def retiring_replicas(before: StackSpec, plan: RolloutPlan) -> tuple[str, ...]:
    """Replicas of a canary that the change no longer places (the canary retired, promoted, or
    given fewer replicas): a local roll drains them, leaves them out of the balancer and stops
    them."""
    canaries = {r.name for r in before.recipes if r.canary_of}
    return tuple(r for r in plan.removed if r.split(".", 1)[0] in canaries)


def _changed_parts(before: StackSpec, after: StackSpec) -> list[str]:
    return [
        part
        for part, old, new in (
            ("sites", before.sites, after.sites),
            ("balancer", before.balancer, after.balancer),
        )
        if old != new
    ]


def _gone(before: StackSpec, after: StackSpec) -> list[str]:
    """Recipes the change removes; a canary's pool goes with its canary block, retired."""
    names = {r.name for r in after.recipes}
    return [r.name for r in before.recipes if r.name not in names and not r.canary_of]


def plan_local_roll(cluster: LocalCluster, after: StackSpec) -> RolloutPlan:
    """The plan for rolling `after` onto the running stack; RolloutRefused with one line per
    problem when it cannot be applied locally."""
    before = cluster.stack
    placed_before = cluster.placement.replicas
    placed_after = place_replicas(after, previous=[r.id for r in placed_before]).replicas
    plan = plan_rollout(before, placed_before, after, placed_after)
    problems = local_problems(before, after, plan)
    if problems:
        raise RolloutRefused("\n".join(problems))
    return plan


def server_rows(show_stat: str) -> list[dict[str, str]]:
    """Every server row of `show stat`, the twins' too."""
    rows = csv.DictReader(io.StringIO(show_stat.removeprefix("# ")))
    return [r for r in rows if r["svname"] not in ("FRONTEND", "BACKEND")]


def sessions_on(rows: Sequence[Mapping[str, str]], server: str) -> int:
    """Sessions the server holds on every backend it is in: streams, speech, realtime."""
    return sum(int(r["scur"] or 0) for r in rows if r["svname"] == server)


def ready_servers(rows: Sequence[Mapping[str, str]]) -> set[str]:
    """Servers HAProxy sends new requests to: UP on their tier backend, not draining."""
    return {
        r["svname"] for r in rows if r["status"] == "UP" and not r["pxname"].endswith(TWIN_SUFFIXES)
    }


def tier_status(rows: Sequence[Mapping[str, str]], server: str) -> str:
    return next(
        (
            r["status"]
            for r in rows
            if r["svname"] == server and not r["pxname"].endswith(TWIN_SUFFIXES)
        ),
        "",
    )


def roll(
    cluster: LocalCluster, after: StackSpec, progress: Progress = lambda _: None
) -> RollReport:
    """Roll `after` onto the running cluster; RolloutRefused before anything changed,
    RollStopped when a step failed (the replicas not yet rolled, and the failed one with its old
    config, keep serving; the cluster keeps its old stack, so a roll asked again restarts the
    pool's replicas afresh)."""
    plan = plan_local_roll(cluster, after)
    report = RollReport(unchanged=plan.unchanged)
    started = time.monotonic()
    recipes = {r.name: r for r in after.recipes}
    for step in plan.steps:
        progress(f"rolling {step.replica} ({', '.join(step.changed)} changed)")
        result = _Step(cluster, step, recipes[step.pool], progress).run()
        report.steps.append(result)
        progress(f"{step.replica} rolled in {result.seconds:.1f} s")
    report.seconds = time.monotonic() - started
    before = cluster.stack
    cluster.adopt(after)
    # Canary replicas brought in: started, warm, and only then in the balancer.
    for replica in starting_replicas(after, plan):
        report.started.append(_start(cluster, before, replica, recipes[replica.split(".")[0]]))
    # Retired canary replicas: drained (their sessions end where they started), then left out
    # of the balancer with the new weights, then stopped.
    old = {r.name: r for r in before.recipes}
    retiring = retiring_replicas(before, plan)
    for replica in retiring:
        pool = replica.split(".", 1)[0]
        progress(f"retiring {replica} (canary of {old[pool].canary_of})")
        step = RolloutStep(pool, replica, ("canary",))
        report.retired.append(_Step(cluster, step, old[pool], progress).drain())
    report.reweighted = cluster.rebalance()
    for replica in retiring:
        cluster.retire_replica(replica)
    return report


def _start(
    cluster: LocalCluster, before: StackSpec, replica_id: str, recipe: RecipeSpec
) -> StepResult:
    """Start a canary replica the change brings in and wait until it is warm; RollStopped, with
    the stack put back as it was, when it never is."""
    t0 = time.monotonic()
    placed = next(r for r in cluster.placement.replicas if r.id == replica_id)
    try:
        state = cluster.add_replica(placed)
        t1 = time.monotonic()
        wait_warm(state, recipe, t0 + recipe.cold_start_budget_s)
    except (RuntimeError, OSError) as error:
        if any(r.id == replica_id for r in cluster.state.replicas):  # type: ignore[union-attr]
            cluster.retire_replica(replica_id)
        cluster.adopt(before)
        raise RollStopped(
            f"replica {replica_id} of the canary of {recipe.canary_of} never became warm"
            f" ({error}); the roll stopped, the canary left out of the balancer"
        ) from None
    return StepResult(replica_id, 0.0, t1 - t0, time.monotonic() - t1)


class _Step:
    def __init__(
        self, cluster: LocalCluster, step: RolloutStep, recipe: RecipeSpec, progress: Progress
    ) -> None:
        assert cluster.state is not None
        self.cluster, self.step, self.recipe, self.progress = cluster, step, recipe, progress
        self.state = cluster.state
        self.replica = next(r for r in self.state.replicas if r.id == step.replica)
        self.agent = self.state.agent_of(f"{self.replica.site}/{self.replica.node}")
        self.socket = Path(self.state.admin_socket)

    def rows(self) -> list[dict[str, str]]:
        return server_rows(stats_command(self.socket, "show stat"))

    def run(self) -> StepResult:
        members = [r.id for r in self.state.replicas if r.pool == self.step.pool]
        others = sorted(ready_servers(self.rows()) & set(members) - {self.replica.id})
        problem = min_warm_problem(self.step.pool, self.replica.id, others, self.recipe.min_warm)
        if problem:
            raise RollStopped(problem)
        drained = self.drain()
        t1 = time.monotonic()
        placed = next(r for r in self.cluster.placement.replicas if r.id == self.replica.id)
        old_config = self.cluster.replica_config(self._old_recipe(), placed)
        try:
            self.cluster.restart_replica(
                self.replica.id, self.cluster.replica_config(self.recipe, placed)
            )
            t2 = time.monotonic()
            warm_by = t1 + self.recipe.cold_start_budget_s
            wait_warm(self.replica, self.recipe, warm_by)
        except (RuntimeError, OSError) as error:
            self._put_back(old_config)
            raise RollStopped(
                f"replica {self.replica.id} never became warm with the new config "
                f"({error}); the roll stopped and it serves its old config again, with the "
                "replicas not yet rolled"
            ) from None
        self._control(undrain)
        self._until(lambda rows: tier_status(rows, self.replica.id) == "UP", "undrain")
        return StepResult(
            self.replica.id, drained.drain_s, t2 - t1, time.monotonic() - t2, drained.cut
        )

    def drain(self) -> StepResult:
        """Take the replica out of rotation for good: drained, its sessions waited for (bounded
        by drain_timeout_s, past which what is left is counted as cut)."""
        t0 = time.monotonic()
        self._control(drain)
        self._until(lambda rows: tier_status(rows, self.replica.id).startswith("DRAIN"), "drain")
        cut = self._wait_sessions()
        return StepResult(self.replica.id, time.monotonic() - t0, 0.0, 0.0, cut)

    def _old_recipe(self) -> RecipeSpec:
        return next(r for r in self.cluster.stack.recipes if r.name == self.step.pool)

    def _put_back(self, config: ReplicaConfig) -> None:
        try:
            self.cluster.restart_replica(self.replica.id, config)
            wait_warm(
                self.replica,
                self._old_recipe(),
                time.monotonic() + self._old_recipe().cold_start_budget_s,
            )
        except (RuntimeError, OSError) as error:
            raise RollStopped(
                f"replica {self.replica.id} never became warm with the new config, nor with its "
                f"old one again ({error}); the roll stopped with it drained, the replicas not "
                "yet rolled serving: `denv local down` then `denv local up` start it afresh"
            ) from None
        self._control(undrain)

    def _control(self, action: Callable[..., object]) -> None:
        try:
            action(self.agent.url, self.state.control_token, self.replica.id)
        except ControlFailed as error:
            raise RollStopped(
                f"replica {self.replica.id}: the agent of {self.agent.node}: {error}"
            ) from None

    def _until(self, done: Callable[[list[dict[str, str]]], bool], what: str) -> None:
        def not_shown(rows: list[dict[str, str]]) -> RollStopped:
            return RollStopped(
                f"replica {self.replica.id}: HAProxy did not show the {what} within "
                f"{BALANCER_SEES_S:.0f} s (status {tier_status(rows, self.replica.id)})"
            )

        wait_until(
            self.rows, done, timeout_s=BALANCER_SEES_S, interval_s=POLL_S, timed_out=not_shown
        )

    def _wait_sessions(self) -> int:
        # The recipe's drain plan (denv_iac.core.drain) gives the bound. Its settle time is
        # waited already (the roll saw HAProxy show the drain), and its quiet rule is HAProxy's
        # own: scur counts sessions, never an idle connection HAProxy keeps for reuse.
        plan = drain_plan([self.recipe], settle_s=0)
        left = wait_until_or_last(
            lambda: sessions_on(self.rows(), self.replica.id),
            lambda sessions: sessions == 0,
            timeout_s=plan.bound_s,
            interval_s=POLL_S,
        )
        if left:
            self.progress(
                f"replica {self.replica.id}: {left} session(s) still open after "
                f"drain_timeout_s {plan.bound_s} s: cut"
            )
        return left


def wait_warm(replica: ReplicaState, recipe: RecipeSpec, deadline: float) -> None:
    """Health 200, then a first token from a streamed request sent to the replica itself, both
    before `deadline`; RuntimeError saying which did not come."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    # Not poll_until: each request is bounded by the time left to `deadline`, which the
    # first-token read below shares and which may have passed before the first try.
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"health {recipe.health_path} not 200 within cold_start_budget_s")
        try:
            with opener.open(f"{replica.url}{recipe.health_path}", timeout=min(left, 1.0)):
                break
        except (urllib.error.URLError, OSError):
            time.sleep(POLL_S)
    body = {
        "model": recipe.model_names[0],
        "messages": [{"role": "user", "content": "warm?"}],
        "stream": True,
        "max_tokens": 1,
    }
    request = urllib.request.Request(
        f"{replica.url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        left = max(deadline - time.monotonic(), 0.01)
        with opener.open(request, timeout=left) as response:
            while time.monotonic() < deadline:
                line = response.readline()
                if not line:
                    break
                if line.startswith(b"data: {"):
                    return
    except (urllib.error.URLError, OSError) as error:
        raise RuntimeError(
            f"no first token within cold_start_budget_s {recipe.cold_start_budget_s} s: {error}"
        ) from None
    raise RuntimeError(f"no first token within cold_start_budget_s {recipe.cold_start_budget_s} s")


# `denv local roll` asks the supervising `denv local up` to roll (the processes are its children,
# and it restarts whatever dies, so it alone may replace them): a request file holding a nonce,
# SIGUSR1, and a result file answering that nonce.
ROLL_REQUEST = "roll-request"
ROLL_RESULT = "roll-result.json"
ROLL_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class RollAnswer:
    """A roll's outcome as lines, the last the summary or the reason it stopped (prefixed
    `error: `), and the exit status of `denv local roll`: 0 rolled, 1 stopped, 2 refused."""

    lines: tuple[str, ...]
    code: int = 0

    @property
    def problems(self) -> list[str]:
        return [line.removeprefix("error: ") for line in self.lines if line.startswith("error: ")]


def roll_once(cluster: LocalCluster, load: Callable[[], StackSpec], say: Progress) -> RollAnswer:
    """One roll of the stack file as it is now, for the supervisor."""
    lines: list[str] = []

    def tell(line: str) -> None:
        lines.append(line)
        say(line)

    code = 2
    try:
        tell(roll(cluster, load(), tell).line())
        code = 0
    except StackError as error:
        lines += [f"error: {problem}" for problem in error.problems]
    except RolloutRefused as error:
        lines += [f"error: {problem}" for problem in str(error).splitlines()]
    except RollStopped as error:
        lines.append(f"error: {error}")
        code = 1
    answer = RollAnswer(tuple(lines), code)
    for problem in answer.problems:
        say(f"error: {problem}")
    return answer


def serve_roll_requests(
    cluster: LocalCluster,
    load: Callable[[], StackSpec],
    asked: threading.Event,
    stop: threading.Event,
    say: Progress,
) -> None:
    """Roll each time `asked` is set (by ROLL_SIGNAL), until `stop`; answers in ROLL_RESULT."""
    while not stop.is_set():
        if not asked.wait(0.2):
            continue
        asked.clear()
        request = cluster.directory / ROLL_REQUEST
        nonce = request.read_text().strip() if request.exists() else ""
        answer = roll_once(cluster, load, say)
        result = json.dumps({"nonce": nonce, "lines": answer.lines, "code": answer.code})
        write_private(cluster.directory / ROLL_RESULT, result + "\n")


def ask_roll(directory: Path, supervisor: int, timeout_s: float) -> RollAnswer:
    """Ask the supervising process to roll and wait for its answer."""
    nonce = secrets.token_hex(8)
    write_private(directory / ROLL_REQUEST, nonce + "\n")
    os.kill(supervisor, ROLL_SIGNAL)
    result = directory / ROLL_RESULT

    def read() -> Any:
        # Not there yet, or half written: no answer so far.
        try:
            return json.loads(result.read_text())
        except (OSError, ValueError):
            return {}

    def answered(answer: Any) -> bool:
        return bool(answer.get("nonce") == nonce)

    answer = wait_until_or_last(read, answered, timeout_s=timeout_s, interval_s=0.1)
    if answered(answer):
        return RollAnswer(tuple(str(line) for line in answer["lines"]), int(answer["code"]))
    return RollAnswer(
        (
            f"error: no answer from the supervising `denv local up` (pid {supervisor}) within "
            f"{timeout_s:.0f} s; its terminal shows how far the roll got",
        ),
        1,
    )


def roll_bound_s(stack: StackSpec) -> float:
    """The longest a roll of `stack` may take: each replica drained, restarted and warmed."""
    placed = place_replicas(stack).replicas
    recipes = {r.name: r for r in stack.recipes}
    return 30.0 + sum(
        recipes[r.pool].drain_timeout_s
        + 2 * recipes[r.pool].cold_start_budget_s
        + 2 * BALANCER_SEES_S
        for r in placed
    )
