"""denv-agent: per-node GPU and replica health for HAProxy agent-check, /healthz and /metrics."""

__version__ = "0.1.0"
