"""The Qwen3-style base: what Qwen3-VL and Qwen3.5 share beside the Qwen3 encoder (``qwen3_vision``).

Not a family (no ``family.py``): the pieces a Qwen3-style family is declared on. Torch-free, read by
the planner: ``arch.py`` (numbers, flavours, validation, ``Qwen3Arch``), ``decoder.py`` (the Qwen3
decoder's numbers, counts, typed blocks and axes: ``Qwen3DecoderArch``) and ``config.py`` (numbers <->
transformers' ``text_config``). With torch: ``tp.py`` (the decoder's TP styles), ``base_family.py``
(``Qwen3Family``: the graph, SP cut, configs, ``build_module``, checkpoint keys, runtime plans) and
``llm.py`` (the LLM module: embedding, DeepStack placement, M-RoPE positions, the loss and the router's
load-balancing loss). Importing the package loads nothing heavy.
"""

from __future__ import annotations

from dhp.models.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "Qwen3Arch": "dhp.models.qwen3_base.arch",
        "Qwen3DecoderArch": "dhp.models.qwen3_base.decoder",
        "Qwen3Family": "dhp.models.qwen3_base.base_family",
        "LLMModule": "dhp.models.qwen3_base.llm",
        "ROUTER_AUX_LOSS": "dhp.models.qwen3_base.llm",
    },
)
