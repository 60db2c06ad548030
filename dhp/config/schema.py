"""Typed schema of a dhp run.

Hydra composes YAML from ``conf/`` and ``recipes/`` onto these dataclasses in struct mode, so an
unknown key is an error. ``dhp.validation.load_config`` validates the result and returns
a frozen :class:`RunConfig`. Sub-configs are passed keyword-only to the functions that need them;
nothing reads the root config with ``.get(key, default)``.

Units: sizes in tokens/patches, memory in GiB (float) in YAML, bytes inside the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class VisionArch:
    """Architecture numbers of the vision encoder (incl. the patch merger) that most families share.

    The defaults are one published encoder's; the model family says which fields it reads and
    validates them (``dhp.models.arch.FamilyArch.validate``). Family-only numbers (e.g. a windowed
    encoder's window geometry) go into ``extra``; the family turns them into its typed architecture.
    """

    depth: int = 32
    hidden_size: int = 1280
    num_heads: int = 16
    intermediate_size: int = 3420
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    # numbers only this model family has (any keys); the family validates them (dhp.models.arch)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class AudioArch:
    """Architecture numbers of an audio encoder (mel frames -> LLM-width audio embeddings).

    ``depth`` 0: the model has no audio encoder (every vision-language family). The defaults are
    Qwen2.5-Omni's Whisper-style encoder; the model family says which fields it reads and validates
    them (``dhp.models.arch.FamilyArch.validate``). ``n_window``: half the mel frames of one attention
    chunk (attention never crosses a chunk); family-only numbers go into ``extra``.
    """

    depth: int = 0
    hidden_size: int = 1280
    num_heads: int = 20
    intermediate_size: int = 5120
    num_mel_bins: int = 128
    n_window: int = 100
    max_source_positions: int = 1500
    # numbers only this model family has (any keys); the family validates them (dhp.models.arch)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LLMArch:
    """Architecture numbers of the language model (embeddings, decoder layers, norm, lm_head).

    Validated by the model family (``dhp.models.arch.FamilyArch.validate``); family-only numbers go
    into ``extra``.
    """

    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    intermediate_size: int = MISSING
    vocab_size: int = MISSING
    tie_word_embeddings: bool = False
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 128000
    # numbers only this model family has (any keys); the family validates them (dhp.models.arch)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class SpecialTokens:
    """Token ids the model graph relies on (must agree with the tokenizer in ``model.path``)."""

    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    bos_token_id: int = 151643
    eos_token_id: int = 151645
    pad_token_id: int = 151643
    # audio placeholders (Qwen2.5-Omni's ids; only a family with an audio encoder reads them)
    audio_token_id: int = 151646
    audio_start_token_id: int = 151647
    audio_end_token_id: int = 151648


@dataclass
class ModelConfig:
    """Which model: architecture numbers (used by the planner) and where weights live.

    ``path``: a local HF directory (config.json, safetensors, tokenizer, preprocessor). When it is
    set, its config.json must agree with ``vision``/``llm``. When it is null, modules are built with
    random init from the architecture numbers (benchmarks, planning, smoke tests); a ``tiny`` model
    given real data instead reads its family's tiny checkpoint from the cache.
    """

    name: str = MISSING
    family: str = MISSING  # a folder of dhp/models (dhp.models.registry.family_names())
    path: str | None = None
    # True for a tiny random test model whose family writes a complete tiny checkpoint (tokenizer with
    # a chat template, processor; conf/model/tiny.yaml): with real data (data.kind=llava) and no path,
    # the run reads that checkpoint, written once under $DHP_CACHE_DIR by dhp.models.tiny_cache.
    tiny: bool = False
    dtype: str = "bfloat16"  # parameter/compute dtype of the model: float32 | bfloat16
    attn_implementation: str = "sdpa"  # sdpa | flash_attention_2 | eager
    vision: VisionArch = field(default_factory=VisionArch)
    audio: AudioArch = field(default_factory=AudioArch)
    llm: LLMArch = field(default_factory=LLMArch)
    tokens: SpecialTokens = field(default_factory=SpecialTokens)


@dataclass
class ClusterConfig:
    """The hardware a plan is compiled for. On CPU a "gpu" is one gloo rank (a CPU slot)."""

    name: str = MISSING
    device: str = "cuda"  # cuda | cpu
    nodes: int = 1
    gpus_per_node: int = 8
    device_memory_gib: float = 80.0
    peak_bf16_tflops: float = 989.0  # per device, dense
    intra_node_gbps: float = 450.0  # GB/s per direction (NVLink)
    inter_node_gbps: float = 50.0  # GB/s per node (IB)
    cpus_per_rank: float = 1.0  # Ray num_cpus per rank bundle (fractional on small CPU boxes)
    ray_address: str | None = None  # null: local Ray (or $RAY_ADDRESS); else join this cluster
    # Step-time model (dhp.plan.timing): achieved fractions of the peaks above, fitted by `dhp calibrate`.
    hbm_gbps: float = 3350.0  # device memory bandwidth, GB/s (optimizer step, copies)
    latency_us: float = 5.0  # per collective hop (NCCL ring step over NVLink: a few us)
    matmul_efficiency: float = 0.7  # large-GEMM fraction of peak_bf16_tflops
    attention_efficiency: float = 0.4  # flash/sdpa attention fraction of peak at long spans
    comm_efficiency: float = 0.7  # achieved fraction of the link bandwidths
    memory_efficiency: float = 0.8  # achieved fraction of hbm_gbps
    gemm_half_flops: float = 2.0e9  # a GEMM of this many FLOPs reaches half the achievable rate
    host_cores: int = 0  # CPU clusters: physical cores per node shared by the ranks (0: not shared)
    call_overhead_s: float = 0.002  # per module call (dispatch, Python), per micro-batch phase
    dispatch_overhead_s: float = 0.002  # per micro-batch, driver side (Ray calls, routing)
    # host seconds per call (dhp/plan/overheads.py); 0 on GPUs, where the host runs ahead of the
    # kernels; a CPU profile or `dhp calibrate` sets them
    block_overhead_s: float = 0.0  # op dispatch of one block's forward (a backward counts 2)
    dtensor_block_overhead_s: float = 0.0  # extra per block when its weights are TP DTensors
    fsdp_block_overhead_s: float = 0.0  # extra per FSDP-sharded block (unshard/reshard hooks)
    attention_call_overhead_s: float = 0.0  # per attention call (the encoder's window loop)
    collective_overhead_s: float = 0.0  # per collective call (gloo/NCCL setup, rendezvous)
    tensor_overhead_s: float = 0.0  # per parameter tensor in norm/clip/AdamW loops, per step
    profile: str = "defaults"  # where the efficiencies come from (defaults | calibrated: runs)
    # how the numbers above were obtained, printed beside every estimate: "built-in defaults", a
    # probe of this machine (dhp.machine), its cached profile refined by N runs, or public anchors
    provenance: str = "built-in defaults"


@dataclass
class ParallelConfig:
    """Degrees of one module's mesh. ``gpus`` of the module must equal pp*dp*fsdp*cp*sp*tp.

    Mesh axis order (outer -> inner): pp, dp, fsdp, cp, sp, tp (dhp.layout). sp and tp are mutually
    exclusive. zero: 0 = plain DP (replicated optimizer), 1 = ZeRO-1 (optimizer state sharded across
    the ranks that hold identical parameters: dp x cp x sp).
    """

    dp: int = 1
    fsdp: int = 1
    sp: int = 1
    tp: int = 1
    # context parallelism (the LLM): each of cp ranks holds 2 of the sequence's 2*cp causal-balanced
    # chunks (dhp/parallel/cp.py); needs a family that declares cp for the module
    cp: int = 1
    # expert-parallel degree of the module's MoE layers; the EP group is folded from the dp x fsdp x cp x sp ranks (docs in dhp/parallel/ep.py); 1 = no EP
    ep: int = 1
    # expert TP: 1, or tp to cut the experts' work over the TP ranks too (each routes 1/tp of the tokens;
    # an all-to-all group of ep x tp ranks); expert_fsdp: experts also FSDP-sharded over their edp ranks
    etp: int = 1
    expert_fsdp: bool = False
    zero: int = 0
    # Megatron-style sequence parallelism inside the TP group (norms/residual sharded by sequence)
    sequence_parallel: bool = False
    # pipeline parallelism (the LLM): pp stage groups, the outermost mesh axis, each holding its own
    # decoder layers (dhp.layout.stage_cut); pp_virtual stages per rank for the interleaved schedules;
    # pp_schedule one of 1f1b | gpipe | interleaved_1f1b | zero_bubble (torch.distributed.pipelining)
    pp: int = 1
    pp_virtual: int = 1
    pp_schedule: str = "1f1b"
    # decoder layers per stage (pp x pp_virtual counts summing to the layers); [] = the balanced cut
    pp_cut: list[int] = field(default_factory=list)


@dataclass
class ParamGroupConfig:
    """Optimizer settings for the parameters one FQN glob matches (``dhp.parallel.param_groups``).

    ``match``: a glob over the module's parameter FQNs, one dot-separated atom per ``*``; it also
    matches every parameter under a matching submodule (``visual.merger`` covers its weights).
    ``lr``/``weight_decay``: null = the ``train`` value. The LR schedule scales every group alike.
    """

    match: str = MISSING
    lr: float | None = None
    weight_decay: float | None = None


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the Linear/Conv submodules the ``targets`` globs match.

    ``rank`` 0 = off. With LoRA on, only the adapters of this module train (the base weights are
    frozen: no grads, no optimizer state); ``scaling = alpha / rank``. ``dropout`` on the adapter input.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=list)


@dataclass
class ModuleConfig:
    """One module = one Ray actor group with its own torch.distributed world.

    seq_len: for the vision module, the max patches of one micro-batch of one LLM data replica
    (what the data loader enforces); an encoder replica serving k LLM replicas (fewer encoder than
    LLM replicas) encodes up to k x seq_len per driver micro-batch, which the planner counts
    (``dhp.plan.memory.encoder_replica_patches``); for the LLM, the max tokens per sample
    (micro-batch rows are padded to the longest sample).
    """

    gpus: int = 1
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seq_len: int = 4096
    activation_checkpointing: str = "off"  # off | full | selective | every_n:K (dhp.config.ac)
    # tokens per chunk of the (vocab-parallel) cross-entropy; 0 = the planner's choice
    loss_chunk_tokens: int = 0
    freeze: bool = False
    mixed_precision: str = "bf16_master_fp32"  # bf16_master_fp32 | bf16 | fp32
    # parameter FQN globs to freeze (no grad, no optimizer state), e.g. ["visual.blocks.1[0-9]"]
    freeze_patterns: list[str] = field(default_factory=list)
    # per-glob optimizer settings; parameters no group matches use train.lr / train.weight_decay
    param_groups: list[ParamGroupConfig] = field(default_factory=list)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DatasetEntry:
    """One dataset (LLaVA or messages JSON/JSONL, parquet/arrow, WebDataset tars), mixed by weight.

    ``format``: ``auto`` detects it from the files (docs/DATA.md); ``image_root``: the folder image
    paths are relative to ("" = the folder of ``path``). ``text_column``/``image_column``: the
    parquet/arrow columns ("" = auto: ``messages`` or ``conversations``; ``images`` or ``image``).
    ``formatting``/``columns``/``tags``: a LLaMA-Factory ``dataset_info.json`` entry's mapping;
    ``info``: read that entry (``name``) from a ``dataset_info.json`` (docs/DATA.md).
    """

    name: str = MISSING
    path: str = ""  # the file, folder, glob or shard range ("" only with info)
    image_root: str = ""
    weight: float = 1.0
    format: str = "auto"  # auto | llava | messages | parquet | webdataset
    text_column: str = ""
    image_column: str = ""
    # LLaMA-Factory's dataset_info.json entry fields: which record keys hold what (dhp.data.records)
    formatting: str = ""  # "" | sharegpt (the only multimodal formatting)
    columns: dict[str, str] = field(default_factory=dict)  # messages, system, images, videos, audios, tools
    tags: dict[str, str] = field(default_factory=dict)  # role_tag, content_tag, user_tag, assistant_tag, ...
    info: str = ""  # a dataset_info.json: the entry `name` there gives path, formatting, columns, tags
    media_dir: str = ""  # LLaMA-Factory's name for image_root (set one of them)


@dataclass
class SyntheticData:
    """Deterministic fixed-size samples: ``images_per_sample`` images of exactly ``patches`` patches."""

    num_samples: int = 64
    patches: int = 1024
    images_per_sample: int = 1
    text_tokens: int = 128
    # > text_tokens: sample i's text length is drawn from [text_tokens, text_tokens_max] by its seed
    # (a length mix, e.g. for packing); 0: every sample has exactly text_tokens
    text_tokens_max: int = 0
    # synthetic video: each sample also holds videos_per_sample videos of video_frames frames of
    # `patches` patches each (video_frames / temporal_patch_size temporal patches): a fixed token count
    videos_per_sample: int = 0
    video_frames: int = 4
    video_fps: float = 2.0
    # synthetic audio (a model with an audio encoder): audios_per_sample audios of audio_frames mel
    # frames each (random normals), each with its encoder's token count between its two markers
    audios_per_sample: int = 0
    audio_frames: int = 400


@dataclass
class DataLengths:
    """Per-row lengths of a bounded, deterministic sample of the data, measured at plan time by
    ``dhp plan``/``dhp train`` (``dhp.data.lengths``, the counts ``dhp data check`` reports): the
    step-time estimate of a real-data run times these instead of micro-batches filled to
    ``seq_len``. Memory never reads them (it stays at the seq_len bound). Written by the CLI into
    the run's config; not a setting. ``rows`` 0: not measured (``note`` says why)."""

    rows: int = 0  # rows sampled
    of_rows: int = 0  # rows one epoch draws (dataset sizes times their weights)
    tokens: list[int] = field(default_factory=list)  # LLM tokens of each sampled row, sorted
    patches: list[int] = field(default_factory=list)  # encoder patches of each sampled row, sorted
    media: int = 0  # images + videos in the sampled rows (a video is one item of its frames)
    videos: int = 0  # videos in the sampled rows (of ``media``)
    video_frames: int = 0  # frames sampled from those videos, all of them
    note: str = ""  # why the lengths were not measured (empty when measured or not attempted)


@dataclass
class EvalDataConfig:
    """The evaluation data (``dhp.data.eval_batches``): a file of its own (``path``, any format
    ``data.path`` takes) or ``split``, a seeded share of every training dataset's records held out
    of training (the same records for a given ``train.seed``). Neither: no evaluation. Each eval pass
    reads every eval sample once, in file order, in batches of ``batch_size`` samples (0:
    ``train.global_batch_size``) shaped as a training step's."""

    path: str = ""
    format: str = "auto"
    image_root: str = ""  # the folder the eval file's media paths are relative to ("": its folder)
    split: float = 0.0  # in [0, 1): the share of each training dataset held out for evaluation
    batch_size: int = 0
    max_samples: int = 0  # > 0: evaluate only the first max_samples eval samples


@dataclass
class DataConfig:
    """Where samples come from and how they are processed. Owned by ``dhp/data``."""

    kind: str = "llava"  # llava | synthetic
    datasets: list[DatasetEntry] = field(default_factory=list)
    synthetic: SyntheticData = field(default_factory=SyntheticData)
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448
    on_bad_sample: str = "raise"  # raise | skip
    num_workers: int = 0  # local: threads per step (0: inline); ray: data actors (0: one per cluster CPU)
    shuffle: bool = True
    prefetch: bool = True  # build step k+1 in a background thread while step k trains
    # local: load/process on the driver's threads; ray: on Ray CPU workers, pixels straight to the
    # vision actors through the object store (docs/DATA.md "Engines")
    engine: str = "local"  # local | ray
    prefetch_depth: int = 2  # engine=ray: steps of samples in flight ahead of the one being built
    cpus_per_worker: float = 0.0  # engine=ray: CPUs each data actor reserves (0: unreserved)
    allow_outside_root: bool = False  # relative media paths may climb out of their dataset's media root
    restrict_media_to: list[str] = field(default_factory=list)  # allowed roots of every media path ([]: any)
    # one-line use: path (+ format) stands for datasets=[{name: <file stem>, path, format}]
    path: str = ""
    format: str = "auto"
    # sequence packing: a micro-batch's samples share LLM rows of <= max_tokens tokens, each sample
    # attending only to itself with its own M-RoPE positions (0: modules.llm.seq_len)
    packing: bool = False
    max_tokens: int = 0
    # video sampling (records with a "video" field): frames per second of the clip, at most
    # video_max_frames (rounded down to whole temporal patches); each frame's h*w within the bounds;
    # a folder of frames is taken to be recorded at video_folder_fps
    video_fps: float = 2.0
    video_max_frames: int = 16
    video_folder_fps: float = 2.0
    video_min_pixels: int = 56 * 56
    video_max_pixels: int = 112 * 112
    # audio (records with "audios", for a model with an audio encoder): one audio longer than this many
    # seconds is a bad sample (never cut); decoded to mono at the feature extractor's rate
    max_audio_seconds: float = 300.0
    # each video's own audio track is used too (the omni models' interleaved layout), for records and
    # dataset_info.json entries that do not say: the run-wide default, as LLaMA-Factory's and ms-swift's
    # training argument of that name
    use_audio_in_video: bool = False
    lengths: DataLengths = field(default_factory=DataLengths)  # measured by the CLI (above)
    eval: EvalDataConfig = field(default_factory=EvalDataConfig)
    # how conversations become text: ``checkpoint`` (model.path's own template, from
    # chat_template.jinja or tokenizer_config.json), a named template (dhp.models.chat_templates:
    # chatml, qwen2_vl) or the path of a .jinja file
    chat_template: str = "checkpoint"
    # which tokens carry the loss: ``assistant`` (the assistant turns' content and end token) or ``all``
    # (every text token; image and video positions and padding never do)
    train_on: str = "assistant"


@dataclass
class OptimizerConfig:
    """How torch's AdamW runs its update (``dhp.parallel.optim.build_optimizer``, ZeRO-1 included).

    ``impl``: ``fused`` (one kernel per step, no parameter-sized temporaries; CUDA and CPU),
    ``foreach`` (multi-tensor ops: one temporary the size of every owned parameter per step, torch's
    default on CUDA) or ``for_loop`` (one parameter at a time: up to three temporaries of the largest).
    The planner counts each one's temporaries in the optimizer phase (``dhp.plan.phases``).
    """

    impl: str = "fused"


@dataclass
class TrainConfig:
    """The optimisation loop: batch sizes, schedule, checkpoints, evaluation, logging.

    The run's length is ``steps`` or ``epochs`` (set one, the other 0): ``epochs`` passes over the
    training data make ``ceil(epochs * samples per epoch / global_batch_size)`` steps, counted when
    the data is opened. The LR schedule (``lr_schedule``, dhp.runtime.loop.schedule) warms up for
    ``warmup_steps`` or ``warmup_ratio`` of the steps (one of them) and decays over the run's steps;
    a resume keeps the checkpoint's horizon unless ``resume_horizon=new``.
    """

    steps: int = 100  # 0: the length comes from train.epochs
    epochs: float = 0.0  # > 0: the run's length in passes over the training data (train.steps=0)
    global_batch_size: int = 8  # samples per optimizer step, over all DP replicas
    micro_batch_size: int = 1  # samples per forward, per DP replica
    # an MoE router's load-balancing loss over the step's batch (`step`, transformers' definition on the
    # whole batch; with several micro-batches per replica a statistics pass first: one more forward of
    # every module per micro-batch) or over each micro-batch (`micro_batch`: no pass, not HF's loss)
    router_aux_loss: str = "step"
    lr: float = 1e-5
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    warmup_ratio: float = 0.0  # > 0: warmup over this share of the run's steps (train.warmup_steps=0)
    lr_schedule: str = "cosine"  # cosine | linear | constant | wsd (warmup, stable, decay)
    decay_ratio: float = 0.1  # wsd: the share of the run's steps in its final linear decay
    # a resume whose run length differs from the checkpoint's: keep its LR horizon, or take the new one
    resume_horizon: str = "keep"  # keep | new
    # evaluation on data.eval: every eval_every steps (0: only after the last step) and at the end
    eval_every: int = 0
    keep_best: bool = False  # keep the checkpoint of the lowest eval loss (checkpoints/best) beside keep_last
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    seed: int = 0
    output_dir: str = "runs"
    log_every: int = 1
    checkpoint_every: int = 0  # 0 = only at the end
    keep_last: int = 2
    resume: str | None = None  # null | auto (continue its run dir) | fork (new run dir) | a checkpoint path
    save_on_interrupt: bool = True
    # a driver step (or a group's call) taking longer is a hang -> RuntimeFailure naming the ranks
    step_timeout_s: float = 900.0
    tensorboard: bool = False
    # automatic restart after a dead actor/node/collective or a step timeout: tear down every group,
    # reserve the placement again (waiting up to restart_wait_s for capacity), resume the newest
    # checkpoint that verifies; at most max_restarts times per run, restart_backoff_s apart
    max_restarts: int = 3
    restart_backoff_s: float = 5.0
    restart_wait_s: float = 300.0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)


@dataclass
class WandbConfig:
    """Weights & Biases (``metrics.loggers`` has ``wandb``; needs ``pip install -e .[wandb]``).

    mode: online | offline | disabled, or null = wandb's own choice ($WANDB_MODE, else online); offline
    writes ``<run_dir>/wandb/offline-run-*`` for ``wandb sync`` to upload later. entity: null = wandb's
    default ($WANDB_ENTITY or the account's).
    """

    project: str = "dhp"
    entity: str | None = None
    mode: str | None = None


@dataclass
class MlflowConfig:
    """MLflow (``metrics.loggers`` has ``mlflow``; needs ``pip install -e .[mlflow]``).

    tracking_uri: null = $MLFLOW_TRACKING_URI, else MLflow's default; ``file:DIR`` is the file store
    (MLflow 3 wants ``MLFLOW_ALLOW_FILE_STORE=true`` for it), ``sqlite:///x.db`` or ``http://host:5000``.
    experiment: the experiment name (created when missing).
    """

    tracking_uri: str | None = None
    experiment: str = "dhp"


@dataclass
class MetricsConfig:
    """Where step metrics go. ``jsonl`` (``metrics.jsonl``, which ``dhp report``/``dhp runs`` read)
    is required; ``tensorboard`` writes ``tb/``; ``wandb``/``mlflow`` log the same scalars, the resolved
    config and plan.json. ``train.tensorboard=true`` still works: it adds ``tensorboard``."""

    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class ExportConfig:
    """``dhp export``: ``lora: merge`` folds LoRA adapters into the HF weights; ``adapter`` writes the
    base weights plus peft's adapter files (``adapter_config.json``, ``adapter_model.safetensors``)."""

    lora: str = "merge"  # merge | adapter


@dataclass
class CheckpointConfig:
    """How checkpoints are written. ``async_save``: each rank stages its shards to host memory
    (one extra copy of its model + optimizer shard in RAM while a save is in flight) and writes
    them in a background thread (torch DCP's async save); training continues, at most one save is
    in flight, and the checkpoint counts (manifest, meta.json, rename) only once every rank's write
    finished. A crash mid-save leaves a temp dir, removed at the next start."""

    async_save: bool = False


@dataclass
class RunConfig:
    """The root: one training job, composed from conf/ groups by a recipe."""

    name: str = MISSING
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    modules: dict[str, ModuleConfig] = field(default_factory=dict)
    # which modules share GPUs (dhp.config.placement): collocated (all on the same GPUs) | disaggregated
    # (each on GPUs of its own) | a partition into GPU-sharing sets, e.g. audio+vision/llm (audio and
    # vision share their GPUs, llm has its own; sets take disjoint GPUs in the order written)
    placement: str = "collocated"
    # how image embeddings and their grads cross groups: auto | object_store | cuda_ipc | p2p
    # (auto: cpu -> object_store; cuda, per edge: a producer sharing the loss module's GPUs -> cuda_ipc,
    # on GPUs apart -> p2p over NCCL; the run's edges must agree)
    handoff: str = "auto"
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
