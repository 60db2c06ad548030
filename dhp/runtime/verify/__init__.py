"""Verify: ``dhp verify``, a plan run beside the unsplit transformers model, compared step by step.

Owns the side-by-side run and its report (``compare``) and the reference's trainable parameters
(``reference_trainable``: the plan's freeze, LoRA and parameter-group choices, translated to the
reference's parameter names, with its optimizer).

The top room of ``dhp.runtime``: it may import every other room (it drives ``loop``'s Trainer);
none imports it (``lint-imports``, contract ``runtime-rooms``).
"""
