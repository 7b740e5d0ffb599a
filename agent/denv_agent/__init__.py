"""denv-agent: GPU and replica health for the balancer."""

__version__ = "0.1.0"
