"""Actors: one module's ranks as Ray actors, and what a failed call on a rank means.

Owns the actor group (``actor_group``: placement-group bundles, one actor per rank, calls issued
and collected per each worker method's contract, a failed or hung rank named), the contracts
themselves (``dispatch``), what a rank is built from (``spec``), the part of every rank that is not
about a model (``base_worker``: identity, its torch.distributed world, how its process began), the
failures of rank calls (``failures``: infrastructure or code, the test-only fault hook, the
traceback file of a failed attempt) and every rank's Python stack read on a hang (``stacks``).

May import ``handoff`` and ``launch`` (a rank's spec names its links and bridge; a rank may be
forked from its node's server); never ``loop`` or ``verify`` (``lint-imports``, contract
``runtime-rooms``).
"""
