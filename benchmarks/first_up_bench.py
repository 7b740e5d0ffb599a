"""A fleet's first `pulumi up` under the dynamic provider's four worker threads: a model.

Pulumi runs every Python dynamic resource's create, update, delete, check and diff in one
provider process whose gRPC server has a pool of four threads (`pulumi/dynamic/__main__.py`,
`ThreadPoolExecutor(max_workers=4)`, pulumi 3.272); `pulumi up --parallel` (unbounded by
default) does not reach it. A Lambda instance's create holds a thread from its launch until the
instance is active (`lambda_api.LambdaClient.wait_active`), and a node's deploy holds one for
the whole deploy, so a fleet's creates queue four at a time.

The model replays that queue: each node's launch (paced by `lambda_api.PACER`, one launch per
12 s, then polled every `poll_s` until booted), then its deploy once its instance is up, each
taking the first free thread in the order they became ready, as the gRPC server's queue does.
Inputs are stated with the figures; none is measured on a Lambda account here.
"""

import heapq
import math
from dataclasses import dataclass

from denv_iac.lambda_api import DEFAULT_RETRY, LAUNCH_INTERVAL_S

PYTHON_DYNAMIC_THREADS = 4
# The node deploy's provider `create` on a fresh VM with the image's driver kept out of it
# (docs/node.md, "join: provider create on a fresh VM": 162-247 s; 231 s in a whole `make vm`),
# and the 8-GPU HGX stand-in's, MIG and fabric manager included (295-334 s alone).
DEPLOY_S = {"1-GPU node": 231.0, "8-GPU node": 334.0}
# From launch to `active` with an address: not published by Lambda and not measured here.
BOOT_S = (300.0, 600.0)


@dataclass(frozen=True)
class FirstUp:
    nodes: int
    threads: int | None  # None: as many as there are operations
    boot_s: float
    deploy_s: float
    launch_interval_s: float = LAUNCH_INTERVAL_S
    poll_s: float = DEFAULT_RETRY.poll_s
    # False: the create returns once launched and the boot is waited for outside the provider's
    # threads (a design, not built: see docs/components.md, "A fleet's first up").
    boot_in_thread: bool = True


def makespan_s(run: FirstUp) -> float:
    """Seconds from the first launch to the last node deployed."""
    threads = run.threads or 2 * run.nodes
    free = [0.0] * threads  # when each thread is next free
    heapq.heapify(free)
    ready = [(0.0, 0, i) for i in range(run.nodes)]  # (ready at, kind 0 launch/1 deploy, node)
    heapq.heapify(ready)
    next_launch, done = 0.0, 0.0
    while ready:
        at, kind, node = heapq.heappop(ready)
        start = max(at, heapq.heappop(free))
        if kind == 0:
            launched = max(start, next_launch)
            next_launch = launched + run.launch_interval_s
            booted = launched + math.ceil(run.boot_s / run.poll_s) * run.poll_s
            end = booted if run.boot_in_thread else launched
            heapq.heappush(ready, (booted, 1, node))
        else:
            end = start + run.deploy_s
            done = max(done, end)
        heapq.heappush(free, end)
    return done


def run() -> dict[str, object]:
    figures: dict[str, object] = {}
    for label, deploy_s in DEPLOY_S.items():
        for boot_s in BOOT_S:
            key = f"20 x {label}, boot {boot_s / 60:.0f} min"
            capped = makespan_s(FirstUp(20, PYTHON_DYNAMIC_THREADS, boot_s, deploy_s))
            free = makespan_s(FirstUp(20, None, boot_s, deploy_s))
            outside = makespan_s(
                FirstUp(20, PYTHON_DYNAMIC_THREADS, boot_s, deploy_s, boot_in_thread=False)
            )
            figures[key] = (
                f"{capped / 60:.0f} min with 4 threads, {free / 60:.0f} min unbounded "
                f"({capped / free:.1f}x); boot waited outside the threads: {outside / 60:.0f} min"
            )
    return figures


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key:34} {value}")
