"""Reading a stack's `denv:recipes`: each recipe's GPU share, tiers of sites, budgets, engine,
image, command and env, its simulated server (`simulate:`), and its canary (`canary:`).
"""

import re
from dataclasses import replace

from denv_iac.core.stack.fields import (
    Fields,
    Problems,
    describe,
    finite,
    listed_twice,
    shown_number,
)
from denv_iac.core.stack.model import (
    AUTO_ENGINE,
    CANARY_FIELDS,
    COLD_START_BUDGET_S,
    DRAIN_TIMEOUT_S,
    ENGINES,
    FIRST_TOKEN_TIMEOUT_MS,
    MAX_CONCURRENCY,
    NO_ENGINE,
    SIMULATED_ENGINES,
    SIMULATED_SPEECH,
    STALL_TIMEOUT_MS,
    WHOLE_GPU,
    CanarySpec,
    RecipeSpec,
    SimulatedServer,
    canary_recipe,
    replica_version,
)
from denv_iac.core.stack.values import (
    IMAGE,
    IMAGE_RULE,
    MODEL_NAME,
)


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


def read_recipe(problems: Problems, path: str, raw: object) -> RecipeSpec:
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
    for dup in listed_twice([d.rstrip("/") for d in recipe.cache_dirs]):
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
    elif not finite(value):
        f.problem("share", f"expected a number, got {describe(value)}; {CANARY_SHARE_RULE}")
    elif not 0 < value < 1:
        shown = shown_number(value) if isinstance(value, int) else str(value)
        f.problem("share", f"{shown} is out of range; {CANARY_SHARE_RULE}")
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
