"""`cmemi up CONFIG`: the whole cluster on this machine, started fast, supervised, and ended at once.

- `up.py`: the command: Redis, the coordinator and through it every service, with a progress line.
- `redis_server.py`: the embedded Redis when `cluster.redis` is not set: a private redis-server on loopback.
- `run_security.py`: what `cmemi up` does to make a local run secure by default.
- `zygote.py`: one process that imports torch and the services once, then forks each service on request.
- `zygote_up.py`: `cmemi up`'s side of the zygote: start it first, hand it the run, read its verdict.
- `zygote_template.py`: a warm zygote for many runs: forks each `cmemi up` a zygote already past its imports.
- `zygote_user_code.py`: the zygote's import of the user's modules, paid once per host instead of once per process.
- `zygote_data.py`: the zygote's build of the training dataset, once per host, for the workers it forks to share.
- `zygote_check.py`: the zygote's check of the config's functions, in a forked child while the zygote builds the data.
- `launch.py`: one service started in this process, from the command line or in a child the zygote forked.
- `supervise.py`: what keeps `cmemi up` free of single points of failure, itself aside.
- `startup_report.py`: the start-up timeline of one `cmemi up`, from the command to the run's first step.
- `prometheus_targets.py`: RUN_DIR/prometheus/targets.json, the run's /metrics endpoints for Prometheus's file_sd.
- `teardown.py`: `cmemi up`'s end: everything it still holds is stopped at once, not one after another.
"""
