"""The soak: a real server with one toy model, steady good callers and every
kind of bad request we know, classified by what each client saw.

Two scenarios share the model, the requests and the server harness
(``benchmarks/soak.py --scenario faults|overload`` runs either):

    faults     good callers with and without one bad request per interval
               that reaches the model: a poisoned item, a padded batch out of
               memory, an item too large even alone, a deadline that cannot be
               met, a caller that leaves, a worker killed (process isolation).
               The invariant: 0 lost, 0 hung, 0 good items failed.
    overload   bad traffic the model never sees or that the queue must refuse:
               a flood past the queue, deadlines that expire, callers that
               leave, oversized, malformed and trickled bodies, and a SIGTERM
               in the middle of a flood (behind a load balancer, and not).

Modules: ``model`` (the toy model and its repository) · ``requests`` (good
bodies and every bad one, and the statuses they get) · ``faults`` ·
``overload``.
"""
