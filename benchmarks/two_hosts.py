"""Training across two simulated machines: a Spark standalone worker in each of two network namespaces.

The cluster is the tests' (tests/spark/netns_cluster.py: veth links to a bridge, one core per host, root
needed). Between machines the workers' steps go over the links, never through shared memory, so this is
the path P4 measures on loopback, here inside a whole training run. An MLP ``features``-``hidden``-
``hidden``-10 with Adam trains on generated rows, both strategies, 2 workers of batch 32, after two
small runs have left the executors' warm workers up. Prints each run's steady epoch (median of the
epochs after the first two), the whole call, the workers' summed seconds of synchronising and what
summed their steps, as one JSON line; run it from a checkout to measure that checkout's code.

    PYTHONPATH=. python benchmarks/two_hosts.py [--features 1024] [--hidden 2048] [--rows 2048] [--epochs 6]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()

    from tests.spark.netns_cluster import BRIDGE_IP, NetnsCluster, why_not_possible
    from tests.spark_helpers import spark_session

    why = why_not_possible()
    if why:
        print(f"cannot build the two hosts: {why}", file=sys.stderr)
        return 2
    os.environ["PYTHONPATH"] = str(ROOT)  # the executors on both hosts import this checkout's nbdist
    size = {"features": args.features, "hidden": args.hidden, "rows": args.rows, "epochs": args.epochs}
    with tempfile.TemporaryDirectory(prefix="nbdist-two-hosts-") as tmp:
        cluster = NetnsCluster(Path(tmp)).start()
        spark = None
        try:
            spark = spark_session(cluster.master_url, **{"spark.driver.host": BRIDGE_IP,
                                                         "spark.driver.bindAddress": BRIDGE_IP,
                                                         "spark.executor.memory": "1g"})
            from big_model import SPARK_WARM_WAIT, distributed, warm_up

            warm_up("spark")  # two small runs: the first leaves the executors' warm workers up
            runs = []
            for _ in range(args.repeats):
                for strategy in ("averaging", "allreduce"):
                    time.sleep(SPARK_WARM_WAIT)  # the executors' next warm workers import meanwhile
                    runs.append({"strategy": strategy, **distributed(size, strategy, "spark")})
                    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        finally:
            if spark is not None:
                spark.stop()
            cluster.close()
    params = args.features * args.hidden + args.hidden * args.hidden + args.hidden * 10
    print(json.dumps({"size": size, "parameters": params, "runs": runs, "load_average": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
