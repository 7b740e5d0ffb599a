"""`denv-agent`: run the agent, or drain / undrain / clear faults on a running one."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from denv_agent import control
from denv_agent.agent import Agent
from denv_agent.config import AgentConfig, ConfigError, load
from denv_agent.nvml_api import real_nvml
from denv_agent.nvml_double import for_config
from denv_agent.process import announce_ready

DEFAULT_CONFIG = "/etc/denv/agent.toml"
log = logging.getLogger("denv_agent")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="denv-agent",
        description="GPU and replica health for HAProxy agent-check, /healthz and /metrics.",
    )
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"agent config (default {DEFAULT_CONFIG})"
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="simulated GPUs instead of NVML, scriptable through POST /control/simulate",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    commands = parser.add_subparsers(dest="command", metavar="{drain,undrain,clear-faults}")
    for name, text in (("drain", "stop new requests"), ("undrain", "take requests again")):
        sub = commands.add_parser(name, help=f"{text}: the whole node, or --replica ID")
        sub.add_argument("--replica", help="one replica id (default: every replica on the node)")
    sub = commands.add_parser("clear-faults", help="forget sticky GPU faults after a repair")
    sub.add_argument("--gpu", type=int, help="one GPU index (default: every GPU and the node)")
    for sub in commands.choices.values():
        sub.add_argument("--config", default=argparse.SUPPRESS, help="agent config")
        sub.add_argument("--url", help="control endpoint (default: from the config's listen.http)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load(Path(args.config))
        if args.command is None:
            return _run(config, simulate=args.simulate, log_level=args.log_level)
        return _control(config, args)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2


def _control(config: AgentConfig, args: argparse.Namespace) -> int:
    try:
        url = args.url or control.control_url(config)
        if args.command == "clear-faults":
            control.clear_faults(url, config.control_token, args.gpu)
            print(f"faults cleared on {'every gpu' if args.gpu is None else f'gpu {args.gpu}'}")
            return 0
        action = control.drain if args.command == "drain" else control.undrain
        result = action(url, config.control_token, args.replica)
    except control.ControlFailed as e:
        print(f"denv-agent: {e}", file=sys.stderr)
        return 1
    drains = result["drains"]
    replicas = ", ".join(drains["replicas"]) or "none"
    print(f"node drained: {'yes' if drains['node'] else 'no'}; drained replicas: {replicas}")
    return 0


def _run(config: AgentConfig, *, simulate: bool, log_level: str) -> int:
    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s denv-agent %(levelname)s %(message)s",
    )
    simulator = for_config(config) if simulate else None
    agent = Agent(config, simulator or real_nvml(), simulator=simulator)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        agent.start()
    except OSError as e:
        print(f"denv-agent: cannot listen: {e}; check listen.* in the config", file=sys.stderr)
        return 1
    assert agent.agent_check is not None and agent.http is not None
    # Written whatever the log level: tools that start the agent wait for this line.
    announce_ready(sys.stderr, config.node, agent.agent_check.address, agent.http.address)
    if simulator is not None:
        log.info("simulating %d gpu(s); faults: POST /control/simulate", len(simulator.gpus))
    stop.wait()
    log.info("stopping")
    if simulator is not None:
        simulator.close()  # wake pollers parked in a simulated slow call
    agent.stop()
    return 0
