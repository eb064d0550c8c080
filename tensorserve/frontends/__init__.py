"""Many cores for one GPU: ``tensorserve serve --frontends N``.

    clients ──▶ front-end processes 1..N              the scheduler process (one)
                (SO_REUSEPORT on the same ports)
                HTTP, gRPC, decode, validate  ──▶     registry, models, one scheduler per
                (process.py, remote.py)               model on one loop (hub.py): admit,
                                              ◀──     form, pad, dispatch, un-pad, answer
                one message per loop iteration each way, on a socket pair
                (protocol.py: a msgpack header and raw arrays, never pickled)

    supervisor.py  the scheduler process: checks and reserves the ports, loads
                   the models, starts, watches and restarts the front ends,
                   drains them on SIGTERM
    hub.py         its end of every front end: requests into the schedulers,
                   replies out, answers about the models, the front ends' reports
    intake.py      what one front end's message admits: one path per request,
                   runs of one-item requests queued whole
    requests.py    a front end's request there: its items' reply slots
                   (``ReplySlot``, delivered a batch at a time), answered once
                   all are in
    records.py     the "infer" entries by name (``Request``, ``Run``): msgspec
                   structs that cross as the same msgpack arrays
    table.py       what every front end is told: the model table, and which
                   models' latency targets a request would miss now
    process.py     a front-end process: the one-process server's app and
                   shutdown, on a data plane that asks the scheduler process
    remote.py      its end of the socket: the models as the infer path sees them
    report.py      its request metrics, on their way to the one exporter
    protocol.py    the messages, and the outbox that gathers a loop iteration's

docs/architecture.md, "Many cores", tells why, and what it measured.
"""
