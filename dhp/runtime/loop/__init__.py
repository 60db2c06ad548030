"""Loop: the training run, from ``dhp train`` down to one rank's step.

Owns the run (``train``: attempts, run dir, step loop; ``sweep``: ``dhp train -m``), the
supervisor that decides what follows a failed or stopped attempt (``supervisor``: restart, give
up, stop on a signal, stop on a deterministic error) and the signals' handling (``interrupts``),
the run dir, its data and length (``rundirs``, ``run_start``, ``run_length``, ``horizon``), the LR
schedule (``schedule``), checkpoints (``checkpointing``), evaluation (``eval_loop``, ``evaluation``),
the progress display (``progress``), the driver's step over the module graph (``driver`` with
``driver_start`` and ``driver_step``) and the rank actor it drives (``worker``: ``ModuleWorker``,
composed of ``worker_build``, ``worker_step``, ``worker_handoff``, ``worker_checkpoint`` and
``eval_worker``).

May import ``actors``, ``handoff`` and ``launch``; never ``verify`` (``lint-imports``, contract
``runtime-rooms``). A Ray rank process imports only ``worker`` and what it imports (never the
driver, the data loader or the planner's renderer).
"""
