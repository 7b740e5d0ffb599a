"""A Kubernetes site's gateway run on 127.0.0.1 by the gateway tests: the stack it is rendered
from, and its rendered config moved onto loopback ports."""

from denv_iac.core.balancer.gateway import GATEWAY_HEALTH_PORT
from denv_iac.core.stack.model import StackSpec
from denv_iac.core.stack.ports import AGENT_PORT
from denv_iac.core.stack.reader import read_stack
from tests.stacks import EDGE, kube_site


def gateway_stack() -> StackSpec:
    """A stack with one Kubernetes site (`k8s`, one planning node) serving voice, and its
    balancer on a local site (`edge`)."""
    recipe = {"name": "voice", "min_warm": 1, "spare": 0, "sites": ["k8s"], "image": "x/y:1"}
    config = {"denv:sites": [kube_site(), EDGE], "denv:recipes": [recipe]}
    return read_stack("prod", {**config, "denv:balancer": {"sites": ["edge"]}})


def gateway_on_loopback(config: str, agent_port: int, agents_port: int, health_port: int) -> str:
    """A rendered gateway config listening on 127.0.0.1: its agent frontend on `agent_port`,
    its health port on `health_port`, and the node agents, which the cluster's headless
    Service finds, at `agents_port`."""
    config = config.replace("bind :", "bind 127.0.0.1:")
    config = config.replace(f"bind 127.0.0.1:{AGENT_PORT} ", f"bind 127.0.0.1:{agent_port} ")
    config = config.replace(f":{GATEWAY_HEALTH_PORT}\n", f":{health_port}\n")
    lines = [
        f"    server agent0 127.0.0.1:{agents_port} check inter 1s rise 1 fall 1"
        if "server-template" in line
        else line
        for line in config.splitlines()
    ]
    return "\n".join(lines) + "\n"
