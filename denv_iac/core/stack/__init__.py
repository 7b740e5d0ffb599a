"""Stack specs: the validated, Pulumi-free model of sites, recipes and the balancer."""
