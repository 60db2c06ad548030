"""N:M routing between modules, for any number of producers: each producer's data-parallel replicas
and the consumer's (the loss module's) divide one another, whatever the producers' between
themselves (they never route to each other)."""

from __future__ import annotations

import pytest

from dhp.plan.search import apply
from dhp.validation import load_config
from dhp.validation.validate import validate

pytestmark = pytest.mark.unit


def _issues(audio_dp: int, vision_dp: int, llm_dp: int) -> list:
    gpus = audio_dp + vision_dp + llm_dp
    cfg = apply(
        load_config("tiny_qwen2_5_omni", []),
        [
            "placement=disaggregated",
            f"cluster.gpus_per_node={gpus}",
            f"train.global_batch_size={6 * llm_dp}",
            "train.micro_batch_size=6",
            *(
                f"modules.{m}.{k}"
                for m, dp in (("audio", audio_dp), ("vision", vision_dp), ("llm", llm_dp))
                for k in (f"gpus={dp}", f"parallel.dp={dp}", "parallel.sp=1", "parallel.tp=1")
            ),
            "modules.llm.parallel.sequence_parallel=false",
        ],
    )
    return [i for i in validate(cfg) if "N:M routing" in i.rule]


def test_a_producer_whose_replicas_do_not_divide_the_consumers_is_refused_by_name() -> None:
    (issue,) = _issues(2, 1, 3)
    assert issue.path == "modules.audio.parallel" and issue.value == {"audio": 2, "llm": 3}
    assert "audio (2) and llm (3) must divide one another" in issue.rule


def test_producers_need_not_divide_each_other() -> None:
    assert _issues(2, 3, 6) == []  # 2 | 6 and 3 | 6; audio's 2 and vision's 3 never meet
    assert len(_issues(2, 4, 3)) == 2  # neither producer divides the LLM's 3: both named
