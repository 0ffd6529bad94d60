"""Optional header fields (shared/wire/messages/): typed and checked on arrival like the required ones, filled in
with their default when absent, and unknown fields left as they always were."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch
from cmemi.shared.wire import messages, protocol, schema
from cmemi.shared.wire.header import header as make_header
from cmemi.shared.wire.protocol import ProtocolError

RUN = "r1"
GOOD = {int: 1, float: 1.5, str: "x", bool: True, bytes: b"x", dict: {}, list: [], type(None): None, object: "any"}
POOL = [None, True, 1, 1.5, "x", b"x", [], {}]

OPTIONAL = [(mtype, name) for mtype, fields in schema.SCHEMAS.items() for name, f in fields.items() if not f.required]
DEFAULTED = [(m, n) for m, n in OPTIONAL if schema.SCHEMAS[m][n].default is not messages.ABSENT]
NO_DEFAULT = [(m, n) for m, n in OPTIONAL if schema.SCHEMAS[m][n].default is messages.ABSENT]
TYPED = [(m, n) for m, n in OPTIONAL if schema.SCHEMAS[m][n].types != (object,)]


def minimal(mtype: str, **extra: Any) -> dict[str, Any]:
    """A header of `mtype` with its required fields only (each a valid value), plus `extra`."""
    return make_header(mtype, RUN, {**{k: GOOD[types[0]] for k, types in schema.required(mtype).items()}, **extra})


def parsed(header: dict[str, Any]) -> dict[str, Any]:
    return protocol.parse(msgpack.packb(header), RUN)[0]


def test_the_declaration_has_the_optional_fields_the_handlers_read() -> None:
    assert len(OPTIONAL) >= 35 and len(DEFAULTED) >= 25 and len(NO_DEFAULT) >= 5
    assert schema.SCHEMAS["grad"]["ahead"] == schema.Field((bool,), required=False, default=False)
    assert schema.SCHEMAS["pull"]["have"].default == -1 and schema.SCHEMAS["grad"]["stage"].default == 0


@pytest.mark.parametrize("mtype, name", TYPED)
def test_a_wrong_typed_optional_field_is_dropped_naming_it(mtype: str, name: str) -> None:
    field = schema.SCHEMAS[mtype][name]
    wrong = [v for v in POOL if not field.accepts(v)]
    assert wrong, f"{mtype}.{name} accepts every value: declare it Any"
    for value in wrong:
        with pytest.raises(ProtocolError) as err:
            parsed(minimal(mtype, **{name: value}))
        assert err.value.reason == "bad_field"
        assert f"{mtype} field {name!r} has type {type(value).__name__}, expected " in str(err.value)


@pytest.mark.parametrize("mtype, name", OPTIONAL)
def test_a_right_typed_optional_field_arrives_as_sent(mtype: str, name: str) -> None:
    value = GOOD[schema.SCHEMAS[mtype][name].types[0]]
    assert parsed(minimal(mtype, **{name: value}))[name] == value


@pytest.mark.parametrize("mtype, name", DEFAULTED)
def test_an_absent_optional_field_reads_its_default(mtype: str, name: str) -> None:
    h = parsed(minimal(mtype))
    assert h[name] == schema.SCHEMAS[mtype][name].default and type(h[name]) is type(schema.SCHEMAS[mtype][name].default)


@pytest.mark.parametrize("mtype, name", NO_DEFAULT)
def test_an_absent_optional_field_without_default_stays_absent(mtype: str, name: str) -> None:
    assert name not in parsed(minimal(mtype))  # its presence says something: `"shm" in h`


def test_typed_reads_replace_the_ad_hoc_ones() -> None:
    h = parsed(minimal("grad"))
    assert h["ahead"] is False and h["lease"] == b"" and h["stage"] == 0 and h["inner"] is None and "shm" not in h
    assert h.get("ahead") is not True and h.get("stage", 0) == 0  # the services' reads of today read the same
    w = parsed(minimal("work", last=True, base=3))
    assert w["last"] is True and w["base"] == 3 and w["downlink"] is None and w["codec"] is None


def test_a_mutable_default_is_never_shared() -> None:
    first, second = parsed(minimal("welcome")), parsed(minimal("welcome"))
    first["shards"].append("tcp://x:1")
    assert second["shards"] == [] and schema.SCHEMAS["welcome"]["shards"].default == []


def test_bool_is_not_an_int_and_float_takes_an_int() -> None:
    with pytest.raises(ProtocolError, match="'stage' has type bool"):
        parsed(minimal("grad", stage=True))
    assert parsed(minimal("work", scale=2))["scale"] == 2


def test_unknown_fields_are_kept_unchecked_as_before() -> None:
    h = parsed(minimal("want", zzz=[1, {"a": b"b"}], reask_typo="x"))
    assert h["zzz"] == [1, {"a": b"b"}] and h["reask_typo"] == "x" and h["reask"] == 0


def test_any_fields_are_left_to_their_reader() -> None:
    for value in POOL:  # a slot descriptor is checked by shm_reader.Reader (shm_bad), part 0's `of` by transfer (bad_part)
        assert parsed(minimal("grad", shm=value))["shm"] == value
        assert parsed(minimal("part", of=value))["of"] == value


def test_decode_and_recv_fill_in_defaults_too() -> None:
    fields = {k: v for k, v in minimal("grad").items() if k not in ("type", "proto", "run", "tensors")}
    msg = protocol.decode([bytes(f) for f in protocol.encode("grad", RUN, fields, {"w": torch.ones(2)})], RUN)
    assert msg.header["ahead"] is False and msg.header["holds"] is None and torch.equal(msg.tensors["w"], torch.ones(2))


def test_a_header_reads_as_its_typed_dict() -> None:
    h = parsed(minimal("work"))
    work = messages.KINDS["work"]
    assert schema.of(h, work) is h
    with pytest.raises(TypeError, match="a 'work' header read as Grad"):
        schema.of(h, messages.Grad)
