"""The real-engine suite: llama.cpp's llama-server serving a small model on the CPU, behind the
endpoint as stacks/Pulumi.local-llama.yaml puts it (scripts/llama_server.py builds it once)."""
