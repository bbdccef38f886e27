"""The per-component config sections (model, optimiser, roles, algorithm): one validated
dataclass each, on the shared :class:`~resilient_rl.config.section.Section` base.

Every section type-checks its fields and validates ranges and allowed values in ``__post_init__``
(:mod:`resilient_rl.config.section`). The root :class:`~resilient_rl.config.schema.Config` lives
in ``config.py`` with the cross-section rules and the YAML loading; the run-time sections (trainer,
checkpoint, recovery, telemetry, Ray) in :mod:`resilient_rl.config.runtime`; the data and reward
sections in :mod:`resilient_rl.config.data_sections`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from resilient_rl.config.section import choice, require, Section

KL_ESTIMATORS = ("k1", "abs", "mse", "k3", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
#: Data-parallel strategies of the trained roles (see ActorConfig.strategy).
STRATEGIES = ("auto", "fsdp", "ddp")
BUILTIN_TASKS = ("reverse", "copy", "add")
#: Tasks that read their prompts from a file (``data.path``).
FILE_TASKS = ("jsonl", "parquet")
#: Rewards ``data.reward_fn`` may name without an import path (:data:`resilient_rl.data.rewards.REWARDS`).
BUILTIN_REWARDS = ("exact_match", "partial_match", "gsm8k")
#: Compute dtypes of ``model.dtype`` (``auto``: bf16 on CUDA, fp32 on CPU).
MODEL_DTYPES = ("auto", "float32", "bfloat16")


def _micro_batch_tokens(value: Optional[Union[int, str]]) -> None:
    require(value is None or value == "auto" or (isinstance(value, int) and value >= 1), "micro_batch_tokens",
            value, "must be 'auto' (sized from the device's memory), a number of tokens >= 1, or null "
                   "(one forward per mini-batch)")


def _world_size_or_unset(value: Optional[int]) -> None:
    """A role's ``world_size``: unset (None, resolved by the root config) or >= 1."""
    require(value is None or value >= 1, "world_size", value, "must be >= 1 or null (unset)")


@dataclass
class ModelConfig(Section):
    """The policy/value backbone: the built-in tiny LM or a Hugging Face causal LM."""

    #: ``tiny``: the built-in causal LM, built from the sizes below; ``hf``: a Hugging Face causal
    #: LM (``path`` or ``hf_config``; needs the ``hf`` extra).
    kind: str = "tiny"
    #: ``kind=hf``: a local Hugging Face model directory (nothing is downloaded).
    path: Optional[str] = None
    #: ``kind=hf``: a Hugging Face config dict to build a model with random weights from, instead of
    #: ``path``.
    hf_config: Optional[Dict[str, Any]] = None
    #: Tiny model: width of the residual stream (a multiple of ``num_heads``).
    hidden_size: int = 64
    #: Tiny model: number of transformer blocks.
    num_layers: int = 2
    #: Tiny model: attention heads per block.
    num_heads: int = 4
    #: Tiny model: width of each block's MLP.
    intermediate_size: int = 256
    #: Longest sequence (prompt and response) the model is built for; a Hugging Face model's
    #: ``max_position_embeddings`` must cover it.
    max_seq_len: int = 64
    #: Compute dtype of the trained and scoring passes and of generation. Master weights, gradients
    #: reduction and optimizer state stay fp32 (FSDP2's mixed-precision policy, or autocast for a
    #: replica). ``auto``: bfloat16 on CUDA (when the GPU supports it), float32 on CPU (bit-reproducible).
    dtype: str = "auto"

    def validate(self) -> None:
        choice("kind", self.kind, ("tiny", "hf"))
        choice("dtype", self.dtype, MODEL_DTYPES)
        require(self.kind != "hf" or self.path is not None or self.hf_config is not None, "path", self.path,
                 "model.kind='hf' needs model.path (a local HF directory) or model.hf_config")
        given = "model.path" if self.path is not None else "model.hf_config" if self.hf_config is not None else None
        require(self.kind == "hf" or given is None, "kind", self.kind,
                 f"{given} is read only with model.kind=hf (the built-in tiny model would ignore it): set "
                 "model.kind=hf")
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        require(self.hidden_size % self.num_heads == 0, "hidden_size", self.hidden_size,
                 f"must be divisible by num_heads={self.num_heads}")
        require(self.max_seq_len >= 2, "max_seq_len", self.max_seq_len, "must be >= 2")
        positions = (self.hf_config or {}).get("max_position_embeddings") if self.kind == "hf" else None
        require(not isinstance(positions, int) or positions >= self.max_seq_len, "max_seq_len", self.max_seq_len,
                 f"must be <= model.hf_config.max_position_embeddings={positions}")


@dataclass
class OptimConfig(Section):
    """AdamW and its learning-rate schedule, one per trained role."""

    #: AdamW's peak learning rate.
    lr: float = 3e-3
    #: AdamW's decoupled weight decay.
    weight_decay: float = 0.0
    #: AdamW's two moment decay rates, each in [0, 1).
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    #: AdamW's denominator epsilon.
    eps: float = 1e-8
    #: Optimizer steps of linear warm-up from 0 to ``lr``.
    warmup_steps: int = 5
    #: After warm-up: ``constant``, or ``cosine`` / ``linear`` decay to ``min_lr_ratio * lr`` over
    #: the run's optimizer steps.
    schedule: str = "constant"
    #: Where ``cosine`` and ``linear`` end, as a fraction of ``lr``.
    min_lr_ratio: float = 0.1
    #: Clip the global gradient norm to this before each optimizer step.
    grad_clip: float = 1.0

    def validate(self) -> None:
        require(self.lr > 0, "lr", self.lr, "must be > 0")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", self.betas,
                 "must be two numbers in [0, 1)")
        require(self.eps > 0, "eps", self.eps, "must be > 0")
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        choice("schedule", self.schedule, ("constant", "cosine", "linear"))
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        require(self.grad_clip > 0, "grad_clip", self.grad_clip, "must be > 0")


@dataclass
class ActorConfig(Section):
    """The policy being trained (PPO clipped objective)."""

    #: The actor's optimizer.
    optim: OptimConfig = field(default_factory=OptimConfig)
    #: Passes over each step's batch in the policy update.
    ppo_epochs: int = 4
    #: Rows per optimizer step of the update, over all ranks (a multiple of ``world_size``).
    mini_batch_size: int = 32
    #: PPO's clip range of the probability ratio.
    clip_ratio: float = 0.2
    #: Dual-clip PPO (Ye et al., 2020), as verl applies it: where the advantage is negative, a
    #: token's loss is at most ``clip_ratio_c`` times it, however far the ratio grew (> 1).
    clip_ratio_c: float = 3.0
    #: Shuffle the rows into new mini-batches every epoch of the update (false: in order, verl's default).
    shuffle: bool = True
    #: Weight of the entropy bonus in the policy loss (0: none).
    entropy_coeff: float = 0.0
    #: Add a KL penalty against the reference policy to the loss (GRPO's way;
    #: ``algorithm.use_kl_in_reward`` puts it in the reward instead).
    use_kl_loss: bool = False
    #: Weight of that KL loss.
    kl_loss_coef: float = 0.001
    #: Estimator of that KL: ``k1``, ``abs``, ``mse``, ``k3`` or ``low_var_kl``.
    kl_loss_type: str = "low_var_kl"
    #: How token losses become one number: ``token-mean`` or one of verl's ``seq-mean-*`` modes.
    loss_agg_mode: str = "token-mean"
    #: Ranks (processes, one GPU each on GPU) of the actor.
    world_size: int = 2
    #: Data parallelism over the ranks: ``fsdp`` shards parameters, gradients and optimizer state
    #: (FSDP2); ``ddp`` keeps a full replica on every rank and averages gradients with one all-reduce
    #: per mini-batch (fewer, larger collectives; for models whose state fits one device; computes
    #: in the parameters' dtype, without FSDP2's bf16 mixed precision); ``auto`` is ``ddp`` on CPU
    #: (gloo pays a round of latency per collective) and ``fsdp`` on CUDA.
    strategy: str = "auto"
    #: FSDP2: true frees a unit's gathered parameters after its forward and gathers them again for
    #: its backward; false keeps them from forward to backward (one all-gather per unit and
    #: mini-batch instead of two). Set true when the full parameters of a model do not fit a device.
    reshard_after_forward: bool = False
    #: Split each mini-batch into micro-batches of at most this many tokens (rows x their longest
    #: unpadded length), accumulating gradients over them; null: one forward per mini-batch. Also
    #: bounds the log-prob passes' batches. A row longer than the budget gets a micro-batch alone.
    #: ``auto``: sized when the model is built from the device's memory, the model's shape, the
    #: precision, activation checkpointing and the FSDP shard (:mod:`resilient_rl.workers.memory_plan`;
    #: null when the whole mini-batch fits), and printed at start.
    micro_batch_tokens: Optional[Union[int, str]] = "auto"
    #: Recompute each transformer block's activations in the backward pass instead of keeping them.
    activation_checkpointing: bool = False
    #: ``torch.compile`` each transformer block (needs a C++ compiler on CPU; first steps compile).
    compile: bool = False
    #: Compile the log-prob head's reductions (log-prob and entropy of each chunk of logits) into
    #: fused kernels, in the actor's passes and the ref's; null: on GPU only. The first log-prob
    #: pass and the first update of a process compile them (:mod:`resilient_rl.workers.logprob`).
    compile_head: Optional[bool] = None
    #: Compile the elementwise work between each block's matrix products (the RMS norms, the rotary
    #: embedding and the SwiGLU) into fused kernels, in the actor's passes and the ref's; null: on
    #: GPU only, and not with ``compile`` (the compiled blocks hold them). The first passes of a process compile them
    #: (:mod:`resilient_rl.models.fused_elementwise`).
    compile_elementwise: Optional[bool] = None
    #: Run each (micro-)batch's real tokens end to end in one row, without padding (positions tell
    #: the sequences apart); ``micro_batch_tokens`` then counts real tokens. The actor's log-prob and
    #: update passes and the ref's log-probs; values are computed padded.
    packing: bool = False

    def validate(self) -> None:
        _micro_batch_tokens(self.micro_batch_tokens)
        for name in ("ppo_epochs", "mini_batch_size", "world_size"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        require(self.clip_ratio > 0, "clip_ratio", self.clip_ratio, "must be > 0")
        require(self.clip_ratio_c > 1, "clip_ratio_c", self.clip_ratio_c, "must be > 1")
        require(self.entropy_coeff >= 0, "entropy_coeff", self.entropy_coeff, "must be >= 0")
        require(self.kl_loss_coef >= 0, "kl_loss_coef", self.kl_loss_coef, "must be >= 0")
        choice("kl_loss_type", self.kl_loss_type, KL_ESTIMATORS)
        choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        choice("strategy", self.strategy, STRATEGIES)


@dataclass
class CriticConfig(Section):
    """The value model (PPO with GAE).

    ``enabled`` unset (null) means on for ``algorithm.adv_estimator='gae'`` and off for ``'grpo'``
    (whose baseline is the group mean); true with GRPO is an error. ``world_size`` unset means the
    actor's when colocated and 1 when split; see :meth:`resilient_rl.config.schema.Config.validate`.
    """

    #: Train a value model; null: on for ``algorithm.adv_estimator=gae``, off for ``grpo`` (true
    #: with GRPO is an error).
    enabled: Optional[bool] = None
    #: The critic's optimizer.
    optim: OptimConfig = field(default_factory=OptimConfig)
    #: Passes over each step's batch in the value update.
    ppo_epochs: int = 4
    #: Rows per optimizer step of the value update, over all ranks.
    mini_batch_size: int = 32
    #: Shuffle the rows into new mini-batches every epoch of the update (false: in order, verl's default).
    shuffle: bool = True
    #: Clip range of the value-function update around the old values.
    cliprange_value: float = 0.5
    #: Ranks of the critic; null: the actor's when colocated, 1 when split.
    world_size: Optional[int] = None
    #: As ``ActorConfig.strategy``.
    strategy: str = "auto"
    #: FSDP2: true frees a unit's gathered parameters after its forward and gathers them again for
    #: its backward; false keeps them from forward to backward (one all-gather per unit and
    #: mini-batch instead of two). Set true when the full parameters of a model do not fit a device.
    reshard_after_forward: bool = False
    #: As ``actor.micro_batch_tokens``, for the value passes.
    micro_batch_tokens: Optional[Union[int, str]] = "auto"
    #: As ``actor.activation_checkpointing``.
    activation_checkpointing: bool = False
    #: As ``actor.compile``.
    compile: bool = False
    #: As ``actor.compile_elementwise``, for the value passes.
    compile_elementwise: Optional[bool] = None

    def validate(self) -> None:
        _micro_batch_tokens(self.micro_batch_tokens)
        for name in ("ppo_epochs", "mini_batch_size"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        _world_size_or_unset(self.world_size)
        require(self.cliprange_value > 0, "cliprange_value", self.cliprange_value, "must be > 0")
        choice("strategy", self.strategy, STRATEGIES)


@dataclass
class ValKwargsConfig(Section):
    """How a validation pass samples (verl's ``rollout.val_kwargs``): greedy unless ``do_sample``,
    else ``temperature`` (0: greedy) and ``top_p``; ``n`` responses per validation prompt."""

    #: Sample in validation; false: greedy decoding.
    do_sample: bool = False
    #: Sampling temperature when sampling (0: greedy).
    temperature: float = 0.0
    #: Nucleus sampling threshold when sampling (1: off).
    top_p: float = 1.0
    #: Responses per validation prompt.
    n: int = 1

    def validate(self) -> None:
        require(self.temperature >= 0, "temperature", self.temperature, "must be >= 0 (0: greedy)")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        require(self.n >= 1, "n", self.n, "must be >= 1")


@dataclass
class RolloutConfig(Section):
    """Sampling of responses; ``world_size`` unset (null) means the actor's when colocated and 1
    when split (colocated rollouts run in the actor's processes: another value is an error).

    ``weight_transfer`` (split placement only; colocated rollouts get the weights in their process):
    ``channel`` broadcasts them from actor rank 0 over a process group of their own (NCCL on GPU:
    the bytes stay on the devices), ``object_store`` sends them through host memory and Ray's
    object store, ``auto`` is ``channel`` on GPU and ``object_store`` on CPU.

    ``engine``: ``static`` is the rollout engine of :mod:`resilient_rl.models.engine` (preallocated
    KV cache, one prefill per prompt, finish checks every ``finish_check_every`` tokens, finished
    rows dropped once ``compact_min_fraction`` of the batch has finished, the decode step compiled
    when ``compile`` (null: on GPU) and captured in a CUDA graph on GPU when ``cuda_graphs``);
    ``plain`` is the decode loop's plain mode (the model's own cache, eager); ``auto`` is ``static``
    for the models it covers (the tiny model, Hugging Face models with static-shape support), else
    ``plain``.
    """

    #: Sampling temperature of the training rollouts. The actor and the ref score the sampled
    #: tokens at it too (log-probs and entropy of softmax(logits / T), as verl computes them).
    temperature: float = 1.0
    #: Nucleus sampling threshold (1: off).
    top_p: float = 1.0
    #: Most tokens generated per response.
    max_new_tokens: int = 4
    #: Responses per prompt (GRPO's group size).
    n: int = 1
    #: Ranks of the rollout; null: the actor's when colocated (another value is then an error), 1
    #: when split.
    world_size: Optional[int] = None
    #: Split placement: how new weights reach the rollout: ``channel`` (a broadcast from actor rank
    #: 0 over a process group of their own; NCCL on GPU), ``object_store`` (host memory and Ray's
    #: object store), ``auto`` (``channel`` on GPU, ``object_store`` on CPU).
    weight_transfer: str = "auto"
    #: ``static``: the engine with a preallocated KV cache, compaction and a compiled decode step
    #: (resilient_rl.models.engine); ``plain``: the same decode loop with the model's own cache,
    #: eager; ``auto``: ``static`` for the models it covers, else ``plain``.
    engine: str = "auto"
    #: Static engine: tokens decoded between checks for finished rows.
    finish_check_every: int = 8
    #: Static engine: drop finished rows from the batch once this fraction of it has finished.
    compact_min_fraction: float = 0.25
    #: Static engine on GPU: capture the compiled decode step in a CUDA graph.
    cuda_graphs: bool = True
    #: Static engine: ``torch.compile`` the decode step; null: on GPU only.
    compile: Optional[bool] = None
    #: Sampling of the validation passes (``trainer.test_freq``): greedy by default.
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)

    def validate(self) -> None:
        choice("weight_transfer", self.weight_transfer, ("auto", "channel", "object_store"))
        choice("engine", self.engine, ("auto", "static", "plain"))
        require(self.finish_check_every >= 1, "finish_check_every", self.finish_check_every, "must be >= 1")
        require(0 <= self.compact_min_fraction <= 1, "compact_min_fraction", self.compact_min_fraction,
                "must be in [0, 1]")
        require(self.temperature > 0, "temperature", self.temperature, "must be > 0")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        for name in ("max_new_tokens", "n"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        _world_size_or_unset(self.world_size)


@dataclass
class RefConfig(Section):
    """The frozen reference policy; ``world_size`` unset (null) means the actor's when colocated and
    1 when split (colocated, another value than the actor's is an error)."""

    #: Ranks of the frozen reference policy; null: the actor's when colocated, 1 when split.
    world_size: Optional[int] = None
    #: FSDP2: false keeps the full parameters after the first forward (the ref never changes, so it
    #: then runs without collectives); true gathers them for every forward and frees them after.
    reshard_after_forward: bool = False

    def validate(self) -> None:
        _world_size_or_unset(self.world_size)


@dataclass
class KLControlConfig(Section):
    """Coefficient of the KL penalty in the reward: fixed, or adapted towards ``target_kl``."""

    #: ``fixed``: the coefficient stays ``kl_coef``; ``adaptive``: it moves towards ``target_kl``
    #: over ``horizon`` samples.
    type: str = "fixed"
    #: The (initial) KL coefficient.
    kl_coef: float = 0.001
    #: Adaptive: the KL the coefficient steers towards.
    target_kl: float = 0.1
    #: Adaptive: samples over which the coefficient adapts.
    horizon: int = 10000

    def validate(self) -> None:
        choice("type", self.type, ("fixed", "adaptive"))
        require(self.kl_coef >= 0, "kl_coef", self.kl_coef, "must be >= 0")
        require(self.target_kl > 0, "target_kl", self.target_kl, "must be > 0")
        require(self.horizon >= 1, "horizon", self.horizon, "must be >= 1")


@dataclass
class AlgorithmConfig(Section):
    """Advantage estimation and the KL penalty."""

    #: ``gae`` (PPO with a critic) or ``grpo`` (group-relative baseline over ``rollout.n``
    #: responses, no critic).
    adv_estimator: str = "gae"
    #: GAE discount.
    gamma: float = 1.0
    #: GAE lambda.
    lam: float = 0.95
    #: Normalize advantages over the batch (GAE).
    whiten_advantages: bool = True
    #: GRPO: divide by the group's standard deviation (false: Dr. GRPO, only subtract the mean).
    norm_adv_by_std_in_grpo: bool = True
    #: Subtract ``kl_ctrl``'s coefficient times the KL to the reference policy from the reward.
    use_kl_in_reward: bool = True
    #: Estimator of that in-reward KL: ``k1``, ``abs``, ``mse``, ``k3`` or ``low_var_kl``.
    kl_penalty: str = "k1"
    #: The in-reward KL coefficient.
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)

    def validate(self) -> None:
        choice("adv_estimator", self.adv_estimator, ("gae", "grpo"))
        require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        require(0 <= self.lam <= 1, "lam", self.lam, "must be in [0, 1]")
        choice("kl_penalty", self.kl_penalty, KL_ESTIMATORS)
