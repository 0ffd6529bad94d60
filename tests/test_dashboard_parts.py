"""`cmemi dashboard`'s parts on their own, in process: the incremental JSON-lines reader (a line being written, a
file replaced or cut, the bound on rows), the access rule (no token on loopback, a token compared in constant time
elsewhere, the Host check) and the status report's cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cmemi.commands.dashboard import access as access_module
from cmemi.commands.dashboard.access import Access, host_name, is_loopback
from cmemi.commands.dashboard.snapshot import (
    FILES_RECHECK_S,
    Dashboard,
    checkpoints,
    curve_point,
    finite,
    timeline_event,
)
from cmemi.commands.dashboard.tail import JsonlTail
from tests.test_status_plot import write_run_files


def lines(*rows: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_tail_reads_only_what_was_appended_since_the_last_read(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == 0 and tail.since(0, None)["rows"] == []  # not written yet
    path.write_text(lines({"step": 1}, {"step": 2}) + '{"step": 3, "lo')  # the aggregator is writing line 3
    assert tail.read() == 2 and tail.offset == path.stat().st_size
    # the bytes already read are not read again: a change there (the same length) is not seen
    text = path.read_text()
    path.write_text(text.replace('{"step": 1}', '{"step": 9}'))
    with open(path, "a") as f:
        f.write('ss": 0.5}\n' + lines({"step": 4}))
    assert tail.read() == 2
    assert [r["step"] for r in tail.rows] == [1, 2, 3, 4] and tail.rows[2] == {"step": 3, "loss": 0.5}
    assert tail.read() == 0  # nothing new: nothing read
    part = tail.since(2, tail.generation)
    assert part == {"generation": 0, "start": 2, "rows": [{"step": 3, "loss": 0.5}, {"step": 4}], "total": 4}
    assert tail.since(2, tail.generation + 1)["start"] == 0  # another generation: everything again
    assert tail.since(99, tail.generation)["start"] == 0  # a count the server never gave: everything again
    with open(path, "a") as f:
        f.write("not json\n[1, 2]\n" + lines({"step": 5}))
    assert tail.read() == 1 and tail.rows[-1] == {"step": 5}  # a torn line and a non-object are skipped


def test_tail_starts_over_on_a_new_file_or_a_shorter_one(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(lines(*({"step": s} for s in range(1, 6))))
    tail = JsonlTail(path)
    tail.read()
    assert tail.generation == 0 and len(tail.rows) == 5
    replacement = tmp_path / "new.jsonl"  # `cmemi up --overwrite`: a new file under the same name
    replacement.write_text(lines({"step": 1}, {"step": 2}, {"step": 3}, {"step": 4}, {"step": 5}, {"step": 6}))
    os.replace(replacement, path)
    assert tail.read() == 6 and tail.generation == 1 and [r["step"] for r in tail.rows] == [1, 2, 3, 4, 5, 6]
    with open(path, "r+") as f:  # the same file cut shorter
        f.truncate(len(lines({"step": 1})))
    assert tail.read() == 1 and tail.generation == 2 and tail.rows == [{"step": 1}]


def test_tail_keeps_every_other_row_past_its_limit(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(lines(*({"step": s} for s in range(10))))
    tail = JsonlTail(path, keep=lambda r: r if r["step"] != 3 else None, limit=8)
    assert tail.read() == 9
    assert [r["step"] for r in tail.rows] == [0, 2, 5, 7, 9] and tail.generation == 1


def test_curve_points_and_timeline_events_keep_what_the_page_draws() -> None:
    step = {"step": 4, "loss": 1.5, "lr": 0.1, "bytes_in": 10, "codec_s": 0.0, "t": 5.0}
    assert curve_point(step) == {"step": 4, "loss": 1.5, "lr": 0.1, "t": 5.0}
    assert curve_point({"step": 10, "eval": {"accuracy": 0.9}, "t": 6.0}) == {"step": 10, "eval": {"accuracy": 0.9}, "t": 6.0}
    assert curve_point({"note": "x"}) is None
    assert timeline_event({"t": 1, "kind": "died", "id": "w0"}) is not None
    assert timeline_event({"t": 1, "kind": "first_grad_accepted"}) is None and timeline_event({"kind": "died"}) is None
    assert finite({"a": [float("nan"), 1.0], "b": float("inf"), "c": "x"}) == {"a": [None, 1.0], "b": None, "c": "x"}


def test_checkpoints_are_listed_from_the_directory(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for name in ("step-00000020", "step-00000010", ".tmp-step-00000030", "step-x"):
        (root / name).mkdir(parents=True)
    (root / "step-00000010" / "model.safetensors").write_bytes(b"x" * 100)
    (root / "step-00000010" / "meta.json").write_bytes(b"{}")
    listed = checkpoints(tmp_path)
    assert [(c["step"], c["bytes"]) for c in listed] == [(10, 102), (20, 0)]
    assert checkpoints(tmp_path / "nowhere") == []


def test_loopback_needs_no_token_anywhere_else_a_token_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.3.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("example.com")
    assert host_name("127.0.0.1:8765") == "127.0.0.1" and host_name("[::1]:80") == "::1" and host_name(None) == ""
    local = Access.for_host("127.0.0.1")
    assert local.token is None and local.allows(None) and local.query() == ""
    assert local.host_allowed("localhost:8765") and not local.host_allowed("attacker.example:8765")
    remote = Access.for_host("0.0.0.0")
    assert remote.token and len(remote.token) >= 40 and Access.for_host("0.0.0.0").token != remote.token
    compared: list[tuple[bytes, bytes]] = []
    real = access_module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(access_module.hmac, "compare_digest", spy)
    assert remote.allows(remote.token) and not remote.allows(remote.token[:-1]) and not remote.allows(None)
    assert len(compared) == 2  # both real comparisons went through hmac.compare_digest (None never compares)
    assert remote.host_allowed("my-host:8765")  # with a token any Host is fine: the token is the check
    assert remote.query() == f"?token={remote.token}"


def test_the_status_report_is_read_at_most_every_status_every_and_from_unchanged_files_seldom(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run_files(run_dir)
    now = [0.0]
    calls: list[int] = []

    from cmemi.commands.status.report import collect

    def counting(target, n):
        calls.append(n)
        return collect(target, n)

    d = Dashboard(run_dir, report=counting, clock=lambda: now[0])
    assert d.status()["report"]["state"] == "completed" and len(calls) == 1
    now[0] += 0.2
    d.state()
    assert len(calls) == 1  # within status_every: the same report
    now[0] += 5
    d.state()
    assert len(calls) == 1  # a completed run from unchanged files: not read again
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"t": 2e6, "kind": "died", "role": "worker", "id": "w0"}) + "\n")
    now[0] += 5
    d.state()
    assert len(calls) == 2
    (run_dir / "summary.json").unlink()  # a run that stopped without ending: its Redis may answer again
    now[0] += 5
    assert d.status()["report"]["state"] == "stopped" and len(calls) == 3
    now[0] += FILES_RECHECK_S / 2
    d.status()
    assert len(calls) == 3  # its files unchanged: the same report for a while
    now[0] += FILES_RECHECK_S
    d.status()
    assert len(calls) == 4  # ... then read again
    empty = Dashboard(tmp_path / "nothing", clock=lambda: now[0])
    (tmp_path / "nothing").mkdir()
    st = empty.status()
    assert st["report"] is None and "cluster.json not found" in st["error"]  # status's own one-line reason
