"""denv-iac: one cluster, one endpoint, warm GPU replicas across providers."""

__version__ = "0.1.0"
