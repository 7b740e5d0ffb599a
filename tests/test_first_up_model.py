"""The first-`up` model of benchmarks/first_up_bench.py, against cases worked by hand."""

import pytest

from benchmarks.first_up_bench import FirstUp, makespan_s


@pytest.mark.parametrize(
    ("run", "expected_s"),
    [
        # One node: its launch, its boot (polled every 10 s), its deploy.
        (FirstUp(1, 4, boot_s=300, deploy_s=200), 300 + 200),
        # A boot between polls is seen at the next one.
        (FirstUp(1, 4, boot_s=295, deploy_s=200), 300 + 200),
        # Four nodes, four threads: launches 12 s apart, each then boots and deploys at once.
        (FirstUp(4, 4, boot_s=300, deploy_s=200), 36 + 300 + 200),
        # Eight nodes on four threads: the second four launch only when the first four's
        # threads come free (at 300, 312, 324, 336 s), queued before any deploy; the first
        # four deploy from 600 s, the last from 836 s (the thread of the deploy begun at 636 s).
        (FirstUp(8, 4, boot_s=300, deploy_s=200), 636 + 200 + 200),
        # Unbounded: only the launch pacing is serial.
        (FirstUp(8, None, boot_s=300, deploy_s=200), 7 * 12 + 300 + 200),
        # One thread: everything in a row (each launch waits for the previous to boot).
        (FirstUp(2, 1, boot_s=300, deploy_s=200), 300 + 300 + 200 + 200),
        # The boot outside the threads: only deploys queue, four at a time: the fifth node,
        # booted at 348 s, deploys when the first deploy's thread frees at 500 s; the eighth
        # (booted at 384 s) when the fourth's does, at 536 s.
        (FirstUp(8, 4, boot_s=300, deploy_s=200, boot_in_thread=False), 536 + 200),
    ],
)
def test_the_model_matches_cases_worked_by_hand(run: FirstUp, expected_s: float) -> None:
    assert makespan_s(run) == pytest.approx(expected_s)


def test_four_threads_cost_a_twenty_node_fleet_several_times_its_unbounded_first_up() -> None:
    capped = makespan_s(FirstUp(20, 4, boot_s=300, deploy_s=231))
    free = makespan_s(FirstUp(20, None, boot_s=300, deploy_s=231))
    assert capped > 3 * free
