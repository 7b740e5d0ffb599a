"""The tail bench's bookkeeping: targets in turn, figures against direct."""

from benchmarks.tail_bench import Targets, figures_of


def test_each_target_takes_its_ports_in_turn() -> None:
    targets = Targets({"direct": [1, 2], "endpoint": [3]})
    assert [targets.port("direct") for _ in range(4)] == [2, 1, 2, 1]
    assert [targets.port("endpoint") for _ in range(2)] == [3, 3]
    assert targets.names == ("direct", "endpoint")


def test_figures_are_added_over_direct_and_set_beside_nginx() -> None:
    times = {
        "direct": [50.0] * 98 + [60.0] * 2,
        "endpoint": [51.0] * 98 + [65.0] * 2,
        "nginx": [50.5] * 98 + [62.0] * 2,
    }
    figures = figures_of("one", times)
    assert figures["one_endpoint_added_p50_ms"] == 1.0
    assert figures["one_endpoint_added_p99_ms"] == 5.0
    assert figures["one_nginx_added_p99_ms"] == 2.0
    assert figures["one_endpoint_minus_nginx_p99_ms"] == 3.0
    assert figures["one_endpoint_ratio_p50"] == 51.0 / 50.0
