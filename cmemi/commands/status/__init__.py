"""`cmemi status`: what a run is doing now. One module per job:

- `cli`: the command line, `--watch`, the JSON output.
- `report`: one report, from the run's Redis when it answers, else from its files (with a note saying why).
- `live`: the report of a running run, from its Redis keys.
- `files`: the report of a run that ended (or whose Redis is gone), from RUN_DIR's files; the metrics readers.
- `render`: the human-readable table of a report.
- `target`: where to look (cluster.json, --redis/--run, config.yaml) and the one user-facing error.
- `values`: loose values from Redis hashes and JSON lines, read the same way by both sources.
"""
