"""The pure core: the stack model, placement, the rollout rule, the rendered configurations.

Nothing here does I/O or imports Pulumi, pyinfra or a network client (`tests/test_layers.py`
holds it to that), so every rule runs in a table-driven test and in `denv plan` alike.
"""
