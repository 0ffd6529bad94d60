"""The wire: what goes over ZeroMQ between CMEMI processes, and how it is checked on receipt.

- header      the torch-free core: protocol version and the header every message starts with
- messages/   every message's header declared once: its fields, their types, what an absent optional reads as
- schema      the run-time side of messages: each declared field as protocol.check_header checks it
- protocol    every message encoded, and validated on receipt against its type's declaration
- transfer    a message bigger than the cap cut into parts, and sent (or streamed from files)
- sendq       a server loop's sends handed to ZeroMQ as its socket takes them, never waiting on the peer
- assembly    parts reassembled into messages, every range and checksum checked as it arrives
- landing     where a part's frames come from (a whole message, a socket) and land (tensors, a sink)
- limits      the cap on one ZeroMQ message and the bound on one logical message, from the model's size
- layout      flat buffers: named tensors in one contiguous buffer per dtype
- state       training state <-> plain metadata and a flat dict of tensors
- security    CurveZMQ encryption and authentication, a role for every peer
- samehost    ipc:// beside tcp:// for peers on the same host
"""
