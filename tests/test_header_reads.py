"""Every field a service reads from a message header is declared in shared/wire/messages/.

An AST scan of services/ and cmemi/ (tests/helpers/header_reads.py) finds each string key read from a decoded
header and fails naming file:line and the field when the message type it is read from (or, where the source does
not say, every type) does not declare it: a new optional field is declared, typed and checked on arrival, never
left to a comment.
"""

from __future__ import annotations

from pathlib import Path

from cmemi.shared.wire import schema

from tests.helpers.header_reads import scan, scan_source, undeclared

ROOT = Path(__file__).resolve().parents[1]
KNOWN = frozenset(schema.SCHEMAS)
DECLARED = {mtype: set(fields) for mtype, fields in schema.SCHEMAS.items()}

# helpers handed one message type's header (handlers named `_on_<type>` need no entry)
HANDLERS = {qual: frozenset(types) for qual, types in {
    "LeaseWork.run": {"work"}, "LeaseWork._parameters": {"work"}, "LeaseWork._compute": {"work"},
    "LeaseWork._after": {"work"}, "Intake.receive": {"work"}, "Intake._misfit": {"work"},
    "Intake.from_slot": {"work"}, "Intake.apply_change": {"work"}, "Intake.take_pieces": {"work"},
    "Replicas.hold": {"inner"}, "SliceLanding._change": {"slice"},
    "GradIntake.take": {"grad"}, "GradIntake._refusal": {"grad"}, "GradIntake._inner_state": {"grad"}, "GradIntake._accepted": {"grad"}, "Admission.hello": {"hello"},
    "ShardRoster.join": {"shard_join"}, "ShardRoster.have": {"shard_have"}, "ShardRoster.ready": {"shard_ready"},
    "ShardSlices.eval_pieces": {"shard_eval"}, "ShardSlices.final": {"shard_final"},
    "Merger.add": {"snapshot"}, "Checkpointer._spool": {"snapshot"}, "Checkpointer._restore": {"restore_req"},
}.items()}


def test_every_header_field_a_service_reads_is_declared() -> None:
    reads, functions = scan(ROOT, ("services", "cmemi"), KNOWN, HANDLERS)
    assert len(reads) > 100, f"the scan found only {len(reads)} header reads: is it still reading the services?"
    gone = sorted(set(HANDLERS) - functions)
    assert not gone, f"HANDLERS names functions that no longer exist (renamed? update the table): {gone}"
    typed = [r for r in reads if r.types is not None]
    assert len(typed) > len(reads) // 3, f"only {len(typed)} of {len(reads)} reads mapped to a message type"
    problems = undeclared(reads, DECLARED)
    assert not problems, "header fields read but not declared:\n" + "\n".join(problems)


SCRATCH = '''
class Aggregator:
    def _on_want(self, identity, msg):
        return msg.header["ahead"]  # grad's, not want's

    def _take_grad(self, identity, info, h, tensors):
        return h["ahead"], h.get("stage", 0)  # both grad's

    def helper(self, h):
        return h.get("bogus")  # nobody's

    def other(self, msg):
        if msg.type == "work" and msg.header.get("have") is not None:  # pull's, not work's
            return "lease" in msg.header  # work's
        header = msg.header
        return "nope" in header, header["type"]  # nobody's; the envelope's
'''


def test_the_scan_fails_on_an_undeclared_read_naming_file_line_and_field() -> None:
    reads, _ = scan_source(SCRATCH, "services/scratch.py", KNOWN, {"Aggregator._take_grad": frozenset({"grad"})})
    assert [(r.line, r.key, r.types and sorted(r.types)) for r in reads] == [
        (4, "ahead", ["want"]), (7, "ahead", ["grad"]), (7, "stage", ["grad"]), (10, "bogus", None),
        (13, "have", ["work"]), (14, "lease", ["work"]), (16, "nope", None), (16, "type", None)]
    problems = undeclared(reads, DECLARED)
    assert len(problems) == 4, problems
    assert problems[0].startswith("services/scratch.py:4: field 'ahead' is read from a want message")
    assert problems[1].startswith("services/scratch.py:10: field 'bogus' is read from a message header, and no")
    assert problems[2].startswith("services/scratch.py:13: field 'have' is read from a work message")
    assert problems[3].startswith("services/scratch.py:16: field 'nope'")
