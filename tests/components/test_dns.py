"""Route 53 in front of the balancer hosts: a health check and a weighted record per host."""

from tests.components import stacks
from tests.components.harness import cluster_outputs, run_program

CHECK = "aws:route53/healthCheck:HealthCheck"
RECORD = "aws:route53/record:Record"


def test_each_balancer_host_gets_a_tcp_health_check_and_an_equal_weighted_record() -> None:
    args = stacks.multicloud()
    args["balancer"]["dns"] = {"zone_id": "Z0123456789ABC", "name": "llm.example.com", "ttl": 20}
    run = run_program(lambda: cluster_outputs(args), preview=False)
    checks = {r.name: r.inputs for r in run.of_type(CHECK)}
    records = {r.name: r.inputs for r in run.of_type(RECORD)}
    assert sorted(checks) == ["prod-balancer-aws-use1-health", "prod-balancer-hetzner-fsn-health"]
    assert sorted(records) == ["prod-balancer-aws-use1-dns", "prod-balancer-hetzner-fsn-dns"]
    addresses = dict(
        zip(("hetzner-fsn", "aws-use1"), run.outputs["balancer_addresses"], strict=True)
    )
    for site, address in addresses.items():
        check = checks[f"prod-balancer-{site}-health"]
        assert (check["type"], check["ipAddress"], check["port"]) == ("TCP", address, 443)
        record = records[f"prod-balancer-{site}-dns"]
        assert record["name"] == "llm.example.com" and record["zoneId"] == "Z0123456789ABC"
        assert (record["type"], record["ttl"], record["records"]) == ("A", 20, [address])
        assert record["setIdentifier"] == site
        assert record["healthCheckId"] == f"prod-balancer-{site}-health-id"
        assert record["weightedRoutingPolicies"] == [{"weight": 100}]
    assert run.outputs["endpoint"] == "https://llm.example.com"


def test_no_records_without_dns() -> None:
    run = run_program(lambda: cluster_outputs(stacks.multicloud()), preview=True)
    assert run.of_type(CHECK) == [] and run.of_type(RECORD) == []
