"""The Robot firewall of Hetzner GEX boxes, as a dynamic resource over Robot's webservice.

The firewall filters each box's switch port, statelessly: it sees packets, not connections.
So besides the site's ingress rows (`denv_iac.core.ingress.site_ingress_rules`: SSH from
the admin CIDRs, WireGuard's UDP port from the balancer hosts when the overlay is on, their
replica and agent ports when it is off) it must accept the replies to
the node's own traffic (package mirrors, model downloads, DNS, NTP): TCP segments with ACK set
and UDP datagrams to the ephemeral ports, and ICMP (path MTU discovery). Robot keeps at most 10
input rules, so each source's ports are merged into as few ranges as cover exactly them. The
overlay's UDP port is opened to the balancer hosts by a rule of its own; WireGuard's default,
51820, lies among the ephemeral ports that replies need open to anyone, so a UDP port opened
to some sources only is first shut to every other one there (a discard rule before the
replies), or the reply rule would let anyone reach it.
IPv4 only (`filter_ipv6` off): IPv6 and an IPv6 admin CIDR are left to the node's nftables,
which narrow everything again on the node. Outgoing, one rule accepts everything
(`robot_firewall.OUTPUT_RULES`): since Hetzner's 2023 change a firewall without output rules
discards all the box sends, SSH replies included. The node deploy of each box waits for its
firewall (`SiteNodes.ready`), so the deploy never races a switch port being reconfigured.

The webservice user and password are secret inputs, kept in the resource's state as secrets:
the engine hands `delete` and `read` only the state, and they must reach Robot too.
"""

import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import pulumi
import pulumi.dynamic as dynamic

from denv_iac.components.dynamic_resource import DynamicResource
from denv_iac.components.joined import HetznerSite
from denv_iac.components.naming import child_name
from denv_iac.components.site import SiteContext, SiteNodes
from denv_iac.core.ingress import node_overlay_access, site_ingress_rules
from denv_iac.core.robot_firewall import OUTPUT_RULES, robot_rules, site_robot_problems
from denv_iac.core.stack.model import SiteSpec
from denv_iac.core.stack.reader import StackError
from denv_iac.robot_api import RobotApiError, RobotClient

USER, PASSWORD = "robot_user", "robot_password"
INPUTS = ("address", "rules", "output_rules")


def _state(props: Mapping[str, Any]) -> dict[str, Any]:
    return {key: props[key] for key in (USER, PASSWORD, *INPUTS) if key in props}


class RobotFirewallProvider(dynamic.ResourceProvider):
    """The whole firewall of one box, found by its address; deleting it disables it."""

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__()
        self._transport, self._sleep = transport, sleep

    def _client(self, props: Mapping[str, Any]) -> RobotClient:
        return RobotClient(
            str(props[USER]), str(props[PASSWORD]), transport=self._transport, sleep=self._sleep
        )

    def _set(self, props: Mapping[str, Any], number: int, active: bool) -> None:
        with self._client(props) as robot:
            robot.set_firewall(
                number,
                status="active" if active else "disabled",
                whitelist_hos=True,  # Hetzner's own services (rescue system, monitoring)
                filter_ipv6=False,
                rules=list(props["rules"]) if active else [],
                output_rules=list(props.get("output_rules") or ()) if active else [],
            )

    def create(self, props: dict[str, Any]) -> dynamic.CreateResult:
        with self._client(props) as robot:
            number = robot.server_number(str(props["address"]))
        self._set(props, number, active=True)
        return dynamic.CreateResult(str(number), {**_state(props), "server_number": number})

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> dynamic.DiffResult:
        changes = [key for key in (USER, PASSWORD, *INPUTS) if olds.get(key) != news.get(key)]
        return dynamic.DiffResult(
            changes=bool(changes), replaces=[key for key in changes if key == "address"]
        )

    def update(self, id_: str, olds: dict[str, Any], news: dict[str, Any]) -> dynamic.UpdateResult:
        # A firewall set before output rules existed gets them here: its state has none.
        if any(olds.get(key) != news.get(key) for key in ("rules", "output_rules")):
            self._set(news, int(id_), active=True)
        return dynamic.UpdateResult({**_state(news), "server_number": int(id_)})

    def read(self, id_: str, props: dict[str, Any]) -> dynamic.ReadResult:
        try:
            with self._client(props) as robot:
                firewall = robot.firewall(int(id_))
        except RobotApiError as e:
            if e.status == 404:
                return dynamic.ReadResult("", {})
            raise
        active = firewall.status == "active"
        found = {
            "rules": list(firewall.input_rules) if active else [],
            "output_rules": list(firewall.output_rules) if active else [],
        }
        return dynamic.ReadResult(id_, {**_state(props), **found, "server_number": int(id_)})

    def delete(self, id_: str, props: dict[str, Any]) -> None:
        self._set(props, int(id_), active=False)


class RobotFirewall(DynamicResource, module="hetzner", name="RobotFirewall"):
    """The Robot firewall of one GEX box: its rules, set whole and in order."""

    server_number: pulumi.Output[int]

    def __init__(
        self,
        resource_name: str,
        props: Mapping[str, pulumi.Input[Any]],
        opts: pulumi.ResourceOptions | None = None,
        provider: RobotFirewallProvider | None = None,
    ) -> None:
        # The credentials are secret inputs; their copies in the state must stay secrets.
        secret = pulumi.ResourceOptions(additional_secret_outputs=[USER, PASSWORD])
        super().__init__(
            provider or RobotFirewallProvider(),
            resource_name,
            {**props, "server_number": None},
            pulumi.ResourceOptions.merge(opts, secret),
        )


def hetzner_site(
    name: str, site: SiteSpec, context: SiteContext, opts: pulumi.ResourceOptions
) -> SiteNodes:
    """Cluster's builder of a Hetzner site: its boxes, each with its Robot firewall when the
    site has Robot webservice credentials (without them, the node's nftables alone filter).
    A box's node deploy waits for its firewall: set while the deploy runs, the switch port
    would drop its SSH session for the 30 s or so Robot takes."""
    component = HetznerSite(name, {"nodes": context["nodes"]}, opts)
    ready: dict[str, list[pulumi.Resource]] = {}
    secrets = context["secrets"]
    if USER in secrets and PASSWORD in secrets:
        balancers = context["balancer_addresses"]
        hosts = sorted(balancers)
        overlay = node_overlay_access(context["spec"], site.name)
        rows = site_ingress_rules(site, context["spec"].recipes, tuple(hosts), overlay)
        problems = site_robot_problems(context["spec"], site)
        if problems:
            raise StackError(problems)
        rules = pulumi.Output.all(*(balancers[h] for h in hosts)).apply(
            lambda addresses: robot_rules(rows, dict(zip(hosts, addresses, strict=True)))
        )
        for node in context["nodes"]:
            firewall = RobotFirewall(
                child_name(name, "robot-firewall", node.name),
                {
                    USER: secrets[USER],
                    PASSWORD: secrets[PASSWORD],
                    "address": node.address,
                    "rules": rules,
                    "output_rules": list(OUTPUT_RULES),
                },
                pulumi.ResourceOptions(parent=component),
            )
            ready[node.name] = [firewall]
    return SiteNodes(component, component.node_addresses, ready=ready)
