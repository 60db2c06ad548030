"""Override lists shared by the integration tests (imported as a sibling module, like parallel_harness)."""

#: tiny_vlm with every degree 1: one rank per module on disjoint CPU slots (the reference plan).
ALL_ONE = [
    "placement=disaggregated",
    "modules.vision.gpus=1",
    "modules.vision.parallel.sp=1",
    "modules.llm.gpus=1",
    "modules.llm.parallel.tp=1",
]
