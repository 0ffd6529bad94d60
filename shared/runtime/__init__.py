"""What every CMEMI process does, whatever its role.

- service     start-up: flags, config, Redis, log; the ROUTER socket a server binds
- startup     when this process reached each stage of its start
- log         structlog setup: JSON lines, service and worker bound once
- metrics     Prometheus metrics, declared once, served by each process
- exits       every exit code and what a supervisor does on seeing it
- lifeline    dying with `cmemi up`, or with the parent
- zygote      asking `cmemi up`'s zygote for a process, and how it ended
- prebuilt    the model and dataset the zygote built once, taken by the first process call that would build them
- proctitle   this process's command line, as ps and pgrep read it
- atomic      files that are the old version or the new one, never half
- links       the options of every socket that may cross hosts: a dead link given up in seconds, re-dialled fast
- records     checksummed records appended to a file: the step log's segments and a server's state spool
"""
