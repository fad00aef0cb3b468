"""Typed run configuration: Hydra structured configs registered in the ConfigStore.

Every YAML file in `dalle_ablate/conf/<group>/` starts from one of the schemas below
(`/schema/<name>@_here_`), so a typo in a field name fails when Hydra composes the config, before
anything is built.
Values are checked by `validate.py` (ranges, and choices that depend on registries: layouts, norms,
optimizers, ...), which names the field and what would be valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

DEFAULT_CACHE = "${oc.env:DALLE_ABLATE_CACHE,${oc.env:HOME,.}/.cache/dalle-ablate}"


@dataclass
class ModelConfig:
    """Architecture. `conf/model/<layout>.yaml` sets the layout flags; `conf/size/` the shape."""

    family: str = "seq2seq"  # encoder-decoder (DALL·E mini / Mega)
    layout: str = "preln"  # where the norms sit: see docs/variants.md "Layouts"
    d_model: int = 128
    heads: int = 4
    encoder_layers: int = 2
    decoder_layers: int = 2
    ffn_dim: int = 344  # hidden width of the FFN (with GLU, ~2/3 of the dense width)
    text_len: int = 32  # text positions, BOS and EOS included
    # None = taken from the data (patch grid / codebook / tokenizer); presets for large models set them
    image_len: Optional[int] = None
    image_vocab: Optional[int] = None
    text_vocab: Optional[int] = None
    norm: str = "layernorm"  # layernorm | rmsnorm
    ln_eps: float = 1e-5
    force_ln_scale: bool = False  # learned scale also on norms that feed a Dense layer
    activation: str = "gelu"  # gelu | swish | relu | smelu
    gelu_approximate: bool = False  # tanh approximation of gelu
    smelu_beta: float = 1.0  # SmeLU half-width
    glu: bool = True  # W_o (act(W_g x) * (W_v x))
    head_scale: bool = False  # NormFormer per-head scale
    final_ln_encoder: bool = True
    final_ln_decoder: bool = True
    swin_ln_every: Optional[int] = None  # swinv2: a norm on the residual stream every k layers
    cosine_attention: bool = False  # Swin v2: cos(q, k) / tau instead of q.k / sqrt(d)
    tau_init: float = 0.05  # cosine attention temperature (fixed, or the init of a learned one)
    learn_tau: bool = False  # learn tau per head and layer, clamped at >= tau_min
    tau_min: float = 0.01
    position_bias: bool = False  # Swin v2 log-spaced continuous position bias on image self-attention
    cpb_hidden: int = 64  # hidden width of the position-bias MLP
    bias: bool = False  # DALL·E mini study: biases cost time and hurt convergence
    init_std: float = 0.02
    dropout: float = 0.0  # on embeddings and on every sublayer output
    attention_dropout: float = 0.0  # on attention weights
    activation_dropout: float = 0.0  # after the FFN activation
    scale_embedding: bool = False  # multiply embeddings by sqrt(d_model)
    dtype: str = "float32"  # compute dtype; norms, softmax and loss stay float32
    remat: str = "none"  # per-layer rematerialisation: none | full | dots_saveable
    scan_layers: bool = False  # compile one layer and scan it over each stack (faster compiles)
    vocab_pad_multiple: int = 8  # embedding / logits rows padded up to a multiple of this


@dataclass
class OptimConfig:
    name: str = MISSING
    lr: float = 1e-3
    weight_decay: float = 0.0
    # Parameters whose path matches one of these regexes get no weight decay.
    wd_exclude: list[str] = field(default_factory=lambda: ["norm", "bias", "embed"])
    clip_grad_norm: Optional[float] = 1.0  # global gradient clipping; null = off


@dataclass
class AdamConfig(OptimConfig):
    name: str = "adam"
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0
    nesterov: bool = False


@dataclass
class ShampooConfig(OptimConfig):
    """Distributed Shampoo (arXiv 2002.09018) as DALL·E Mega trained with it."""

    name: str = "shampoo"
    lr: float = 1e-3
    block_size: int = 1024  # dimensions longer than this are split into blocks
    b1: float = 0.9  # momentum on the grafted direction
    b2: float = 0.99  # statistics decay; 1.0 = Adagrad-style sums
    graft: str = "rmsprop_normalized"  # rmsprop_normalized | rmsprop | adagrad | sgd | adam
    graft_b2: Optional[float] = None  # null: b2, as the reference has one beta2
    graft_eps: float = 1e-10  # Mega's diagonal_epsilon
    # parameter: each parameter's Shampoo direction takes its graft direction's norm, as the
    # reference; block: each block's (this project's rule before issue 15; blocks of one matrix
    # then move at different rates).
    graft_scope: str = "parameter"
    matrix_eps: float = 1e-6  # ridge, relative to the largest eigenvalue
    exponent_override: int = 0  # 0 = 2 x the statistics per block (4 for matrices, 2 for vectors)
    preconditioning_every: int = 10  # recompute inverse roots every k steps
    start_preconditioning_step: int = 101  # graft direction alone before this step
    inverse_failure_threshold: float = 0.1  # keep the previous root above this eigh backward error
    skip_preconditioning_dim_size_gt: int = 4096  # graft only for any larger dimension
    # Vectors (biases, norm gains) preconditioned by their one statistic, as Mega ran it
    # (skip_preconditioning_rank_lt=1); false leaves them to the graft, which is cheaper.
    precondition_1d: bool = True
    # Neighbouring dims are merged while their product is at most this (the reference's
    # merge_small_dims_block_size), so a 64 x 64 matrix is preconditioned as a 4096-vector: four
    # 1024-blocks and 1024 x 1024 roots instead of two 64 x 64. 0 keeps every matrix a matrix.
    merge_small_dims: int = 4096
    moving_average_for_momentum: bool = True  # EMA momentum (dalle-mini's setting) instead of heavy ball
    nesterov: bool = False
    statistics_dtype: str = "float32"  # float32 | bfloat16 for statistics and roots
    # Where inverse roots are computed: auto = float64 where the backend has it (CPU, GPU), float32
    # on TPU. float32 roots of ill-conditioned statistics are off by up to ~1e-3 (optim/shampoo.py).
    root_dtype: str = "auto"
    # Parameters whose path matches one of these get the graft direction only (Mega: embeddings).
    no_precondition: list[str] = field(default_factory=lambda: ["embed", "lm_head"])


@dataclass
class AdafactorConfig(OptimConfig):
    name: str = "adafactor"
    lr: float = 1e-2
    decay_rate: float = 0.8
    decay_offset: int = 0
    clipping_threshold: Optional[float] = 1.0
    momentum: Optional[float] = None
    factored: bool = True
    min_dim_size_to_factor: int = 128
    multiply_by_parameter_scale: bool = False  # DALL·E mini used the plain learning rate
    eps: float = 1e-30


@dataclass
class ScheduleConfig:
    """Linear warmup from 0 to optim.lr over warmup_steps, then the named decay."""

    name: str = MISSING
    warmup_steps: int = 50
    lr_offset: int = 0  # hold the rate at 0 for the first N steps (resuming with a fresh optimizer)
    allow_long_warmup: bool = False  # let warmup (with lr_offset) last as long as the run or longer


@dataclass
class ConstantScheduleConfig(ScheduleConfig):
    name: str = "constant"


@dataclass
class CosineScheduleConfig(ScheduleConfig):
    name: str = "cosine"
    end_factor: float = 0.0  # final lr as a fraction of optim.lr
    decay_steps: Optional[int] = None  # null = until trainer.steps


@dataclass
class LinearScheduleConfig(ScheduleConfig):
    name: str = "linear"
    end_factor: float = 0.0  # final lr as a fraction of optim.lr
    decay_steps: Optional[int] = None  # null = until trainer.steps


@dataclass
class ExponentialScheduleConfig(ScheduleConfig):
    name: str = "exponential"
    transition_steps: int = 1000
    decay_rate: float = 0.5
    staircase: bool = False


@dataclass
class DataConfig:
    name: str = MISSING
    blank_caption_prob: float = 0.1  # empty captions train the unconditional branch
    tokenizer_path: Optional[str] = None  # a tokenizer.json; null = BPE trained on the captions
    text_vocab_size: int = 512  # BPE vocabulary when trained here
    cache_dir: str = DEFAULT_CACHE


@dataclass
class ShapesDataConfig(DataConfig):
    """Procedural scenes of coloured shapes, tokenised by a k-means patch codebook."""

    name: str = "shapes"
    seed: int = 0  # fixes the scenes of every split; the run's seed only orders them
    image_size: int = 48  # the 3x3 scene grid on the patch grid: a cell is 2x2 patches of 8 px
    patch_size: int = 8  # 8x8 patches on 48 px = 36 image tokens; on 64 px 64 tokens, 4x4 on 64 px = 256 (DALL·E Mega's count)
    codebook_size: int = 145  # at 48 px: every distinct patch of the renders, a lossless tokenizer
    num_train: int = 20000
    num_valid: int = 512
    num_test: int = 512
    min_objects: int = 1
    max_objects: int = 3
    kmeans_patches: int = 1_000_000  # patches (of whole training renders) the codebook is fitted on
    kmeans_iters: int = 20
    text_vocab_size: int = 256


@dataclass
class ParquetDataConfig(DataConfig):
    """dalle-mini's format: parquet files with a caption column and a list-of-int code column."""

    name: str = "parquet"
    path: str = MISSING  # a file, a folder or a glob of training files
    valid_path: Optional[str] = None  # null = hold out valid_fraction of rows by hash
    valid_fraction: float = 0.01
    caption_column: str = "caption"
    encoding_column: str = "encoding"
    image_vocab: int = 16384
    image_len: Optional[int] = None  # null = model.image_len, else the first row's length
    shuffle_buffer: int = 10000
    codebook_path: Optional[str] = None  # a patch codebook (.npz) to decode samples; null = no grid
    vqgan_path: Optional[str] = None  # or VQGAN weights (.npz, dalle-ablate convert-vqgan) to decode them
    valid_max_rows: int = 2048
    allow_blank_captions: bool = False  # train on a set whose captions are all blank (unconditional)


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "dalle-ablate"
    entity: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    fallback: Optional[str] = None  # offline = log offline when online cannot connect or authenticate; null = fail


@dataclass
class TrackerConfig:
    backend: str = "wandb"  # wandb | none (the local run store is always written)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainerConfig:
    steps: int = 2000
    batch_size: int = 32  # examples per optimizer step, all micro-batches together
    grad_accum: int = 1  # micro-batches per step
    log_every: int = 50  # per-layer norms, optimizer stats
    eval_every: int = 500
    eval_batches: Optional[int] = None  # null = the whole valid split
    save_every: int = 1000
    keep_checkpoints: int = 2
    progress: bool = True


@dataclass
class MeshConfig:
    """Device mesh (dalle_ablate/parallel): sizes of its three axes; -1 = the remaining devices."""

    data: int = -1  # batch split, parameters replicated
    fsdp: int = 1  # batch split, parameters and optimizer state sharded on their embed axis
    model: int = 1  # tensor parallel: heads, MLP and vocabulary split


@dataclass
class DistributedConfig:
    """Several processes (hosts) in one run: jax.distributed.initialize before anything else.
    conf/config.yaml fills the fields from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID when they are set."""

    coordinator_address: Optional[str] = None  # host:port of process 0; null = a single process
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    auto: bool = False  # initialize() with no arguments: Cloud TPU, Slurm and Open MPI detect themselves


@dataclass
class SamplesConfig:
    """Images generated at the end of a run for a few fixed captions."""

    captions: Optional[list[str]] = None  # null = the dataset's fixed demo captions
    per_caption: int = 4
    temperature: float = 1.0
    top_k: Optional[int] = None


@dataclass
class PretrainedEvalConfig:
    """A pretrained scoring network (FID Inception or CLIP): a local `.npz` of converted weights
    (`dalle-ablate convert-inception` / `convert-clip`); nothing is downloaded."""

    weights: Optional[str] = None
    batch_size: int = 32  # images (or captions) per forward pass


@dataclass
class EvalConfig:
    """Sampling evaluation: metrics per guidance scale (the Pareto curve) and prompt grids. Runs
    every `every` steps during training, at the end of a run, and with `dalle-ablate eval`."""

    name: str = "default"  # which conf/eval preset this came from
    every: int = 0  # steps between evaluations during training; 0 = only at the end of the run
    guidance_scales: list[float] = field(default_factory=lambda: [1.0, 2.0, 3.0, 5.0, 8.0])
    metrics: list[str] = field(default_factory=lambda: ["shapes", "shapes_fd", "caption_sensitivity"])
    num_samples: int = 128  # stratified prompts (an equal share per difficulty tier), one sample each, the same at every scale
    batch_size: int = 32  # prompts sampled at once
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    sensitivity_examples: int = 64  # valid examples whose captions caption_sensitivity edits
    grids: list[str] = field(default_factory=lambda: ["shapesbench"])  # prompt lists: shapesbench, drawbench, partiprompts
    grid_scales: list[float] = field(default_factory=lambda: [3.0])  # guidance scales the grids are drawn at
    grid_prompts: Optional[int] = 6  # prompts per category and grid (null = all)
    grid_samples: int = 4  # samples per prompt
    seed: int = 0  # the sampling noise: fixed across scales, steps and checkpoints
    fid: PretrainedEvalConfig = field(default_factory=PretrainedEvalConfig)  # eval.metrics=[fid]: Inception weights
    clip: PretrainedEvalConfig = field(default_factory=PretrainedEvalConfig)  # eval.metrics=[clip]: CLIP weights + BPE
    reference: Optional[str] = None  # FID reference statistics (.npz, `dalle-ablate fid-reference`); null = the real images of the eval prompts


# Values of a run's summary a job can return to a sweeper (RunConfig.objectives).
OBJECTIVES = ("eval/valid/loss", "train/loss", "train/first_loss", "wall_time", "steps")


@dataclass
class OptunaTrialConfig:
    """Set by the Optuna sweeper (hydra/sweeper=optuna), never by hand: which study and trial this
    job runs for, so the trainer can report eval losses to it and be pruned."""

    storage: Optional[str] = None
    study: Optional[str] = None
    trial: Optional[int] = None


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: Any = MISSING
    schedule: Any = MISSING
    data: Any = MISSING
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    samples: SamplesConfig = field(default_factory=SamplesConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    seed: int = 0
    resume: Optional[str] = None  # null | auto | a run dir or checkpoint dir
    # What the job returns to a sweeper: one value, or a list for a multi-objective sweep; names
    # of the run's summary (OBJECTIVES above).
    objectives: list[str] = field(default_factory=lambda: ["eval/valid/loss"])
    optuna: OptunaTrialConfig = field(default_factory=OptunaTrialConfig)


def register_configs() -> None:
    """Schemas live in the `schema` group, so that `model=glob(*)` and the option lists in error
    messages see only the YAML options; each YAML starts from one with `/schema/<name>@_here_`."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    for name, node in {
        "model": ModelConfig,
        "optim_adam": AdamConfig,
        "optim_adafactor": AdafactorConfig,
        "optim_shampoo": ShampooConfig,
        "schedule_cosine": CosineScheduleConfig,
        "schedule_constant": ConstantScheduleConfig,
        "schedule_linear": LinearScheduleConfig,
        "schedule_exponential": ExponentialScheduleConfig,
        "data_shapes": ShapesDataConfig,
        "data_parquet": ParquetDataConfig,
        "tracker": TrackerConfig,
        "mesh": MeshConfig,
        "eval": EvalConfig,
    }.items():
        cs.store(group="schema", name=name, node=node)


register_configs()


def compose(overrides: list[str]) -> DictConfig:
    """The config for these overrides, composed as `python run.py` would (from the package's
    `conf/`, so the same from a wheel as from a checkout); `validate.to_run_config` types and
    checks it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module(config_module="dalle_ablate.conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)
