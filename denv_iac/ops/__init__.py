"""Operating tools: what the CLI runs against a live endpoint or stack (status, load, alerts)."""
