"""Turn the `denv:` keys of a stack's config into a validated StackSpec, or all its problems.

The sites, the recipes and the balancer are each read by a module of their own (site_reader,
recipe_reader, balancer_reader); here they are put together and checked against each other:
references, names, addresses, GPU shares, canaries and key scopes.
"""

import ipaddress
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from denv_iac.core.stack.balancer_reader import read_balancer
from denv_iac.core.stack.catalog import Catalog, load_catalog
from denv_iac.core.stack.fields import (
    Fields,
    Problems,
    listed_twice,
)
from denv_iac.core.stack.model import (
    BALANCER_HOST_KINDS,
    CANARY_SUFFIX,
    RecipeSpec,
    SiteSpec,
    StackSpec,
    canary_recipe,
)
from denv_iac.core.stack.overlay_reader import overlay_problems
from denv_iac.core.stack.ports import stack_port_problems
from denv_iac.core.stack.recipe_reader import read_recipe
from denv_iac.core.stack.site_reader import read_site
from denv_iac.core.stack.values import (
    LABEL_VALUE,
    LAMBDA_NAME_LENGTH,
    lambda_full_name,
    nebius_host_problem,
)

CONFIG_KEYS = ("denv:sites", "denv:recipes", "denv:balancer")


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
    sites = tuple(read_site(problems, p, raw, catalog) for p, raw in root.items("sites"))
    recipes = tuple(read_recipe(problems, p, raw) for p, raw in root.items("recipes"))
    balancer_fields = Fields(problems, "balancer", root.raw.get("balancer", {}))
    root.known.add("balancer")
    balancer = read_balancer(balancer_fields)
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


def _check_references(problems: Problems, stack: StackSpec, catalog: Catalog) -> None:
    site_names = [s.name for s in stack.sites]
    for dup in listed_twice(site_names):
        problems.add("sites", f'site name "{dup}" is used twice; give each site its own name')
    for i, site in enumerate(stack.sites):
        for dup in listed_twice([n.name for n in site.nodes]):
            problems.add(f"sites[{i}].nodes", f'node name "{dup}" is used twice; rename one')
    recipe_names = [r.name for r in stack.recipes]
    for dup in listed_twice(recipe_names):
        problems.add("recipes", f'recipe name "{dup}" is used twice; give each recipe its own name')
    for dup in listed_twice([m for r in stack.recipes for m in r.model_names]):
        problems.add(
            "recipes", f'model name "{dup}" is routed to two recipes; a model needs one pool'
        )
    by_name = {s.name: s for s in stack.sites}
    for i, recipe in enumerate(stack.recipes):
        path = f"recipes[{i}]"
        for dup in listed_twice(list(recipe.sites)):
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
