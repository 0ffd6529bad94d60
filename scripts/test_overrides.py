"""The second compose/stack file of compose-test and swarm-test: every CMEMI service's command with the test's
`--set` overrides appended (so the reference run and every service train the same run).

    python3 scripts/test_overrides.py OUT CONFIG [--stack] [--shards] -- --set train.steps=4000 ...

--stack: a `docker stack deploy` file (it needs a version); --shards: also `shard1`
(docker-compose.shards.yml, docker/stack.shards.yml). Plain python3, no CMEMI import: it runs on the host.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("config")
    p.add_argument("--stack", action="store_true")
    p.add_argument("--shards", action="store_true")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, overrides = p.parse_args(argv[:cut]), argv[cut + 1:]
    services = {"coordinator": ["coordinator", "--supervise", "none"], "aggregator": ["aggregator"],
                "checkpointer": ["checkpointer"], "worker": ["worker"]}
    if args.shards:
        services["shard1"] = ["aggregator", "--shard", "1"]
    with open(args.out, "w") as f:
        f.write(('version: "3.8"\n' if args.stack else "") + "services:\n")
        for svc, (role, *extra) in services.items():
            f.write(f"  {svc}:\n    command: {json.dumps([role, '--config', args.config, *extra, *overrides])}\n")


if __name__ == "__main__":
    main()
