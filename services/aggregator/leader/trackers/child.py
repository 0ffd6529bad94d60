"""The trackers' own process (`python -m cmemi.services.aggregator.leader.trackers.child`), started by the leader
(hub.py): the trackers' packages run here, not in the leader, because in the leader's process their work holds
its interpreter lock. Measured on the 2-core dev machine, a 300-step digits run's median step time with the
three trackers on threads of the leader was about twice a plain run's, and with the same tracker work in a
process of its own close to a plain run's (the commands are in docs/guides/trackers.md).

stdin: JSON lines from the leader — first {"config", "run_dir", "params"}, then records `["scalars", step, values,
t]` or `["event", step, kind, text, count, stream id]`, then `["close", timeout]`; each record goes to every tracker's writer
(writer.py) without waiting. stdout: one JSON line at the end, summary.json's tracker fields. End of input without
`close` closes too. The process dies with its leader (argv[1] is the leader's pid; PR_SET_PDEATHSIG): a SIGKILLed
leader's successor opens the same tracker runs again (base.state_file), and two processes writing one run — or
migrating one MLflow SQLite store at once, which fails with "duplicate column name" — must never overlap; what the
dead leader's process had not written yet is lost with it. Logs go to RUN_DIR/logs/trackers.log under `cmemi up`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from cmemi.services.aggregator.leader.trackers import registry
from cmemi.services.aggregator.leader.trackers.writer import TrackerWriter, finish_all
from cmemi.shared.config.loading import config_from_dict
from cmemi.shared.runtime.lifeline import die_with_parent
from cmemi.shared.runtime.log import setup_logging


def main() -> None:
    die_with_parent(int(sys.argv[1]) if len(sys.argv) > 1 else None)
    log = setup_logging("trackers")
    first = json.loads(sys.stdin.readline())
    cfg = config_from_dict(first["config"])
    writers = [TrackerWriter(registry.make(name), Path(first["run_dir"]), cfg, first["params"], log)
               for name in cfg.metrics.loggers]
    timeout = cfg.metrics.logger_timeout
    for line in sys.stdin:
        record = json.loads(line)
        if record[0] == "close":
            timeout = float(record[1])
            break
        for w in writers:
            w.put(*record)
    sys.stdout.write(json.dumps(finish_all(writers, timeout, log)) + "\n")
    sys.stdout.flush()
    os._exit(0)  # an abandoned tracker's thread (and its package's exit hooks) must not hold the exit


if __name__ == "__main__":
    main()
