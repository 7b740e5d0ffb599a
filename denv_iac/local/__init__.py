"""The data plane on one machine: the local runner and the simulated replica."""
