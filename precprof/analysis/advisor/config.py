"""Every threshold the advisor uses, in one object, with its default and why."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdvisorConfig:
    """Every threshold the advisor uses, with its default and why.

    Shares are fractions (0.01 = 1%). Loss scales are powers of two given by their log2.
    """

    # Loss scale: the largest 2^k with max|g| * 2^k < 65504 / 2^fp16_margin_log2. A margin of 2^2 leaves room
    # for one GradScaler growth step and for gradients larger than those seen on the sampled steps.
    fp16_margin_log2: int = 2
    # Clamp of the recommended loss scale. 2^32 is far above the 8..32K the 2018 paper used; it only stops a
    # run with vanishing gradients from producing an absurd scale.
    min_loss_scale_log2: int = -16
    max_loss_scale_log2: int = 32
    # Used when the run has no gradient statistics: GradScaler's own default init_scale, 2^16.
    default_loss_scale_log2: int = 16
    # Used when every gradient value recorded was fp16 at scale 1 and an exact zero (an unscaled fp16 run that
    # flushed them all): 2^24 puts a gradient at fp16's flush point (2^-25) at 0.5; GradScaler backs off from it,
    # a skipped step a halving, where something overflows.
    flushed_loss_scale_log2: int = 24
    # Activation-gradient underflow in fp16: at or below ``fp16_underflow_ok`` it is negligible (the target of
    # the loss-scale rule); above ``fp16_underflow_block`` even at the recommended scale, fp16 is not advised.
    fp16_underflow_ok: float = 0.01
    # FP8 only when the eligible layers carry more than this share of the linear layers' matmul FLOPs
    fp8_flops_share_min: float = 0.5
    # fp16 gradients flushed already (an unscaled fp16 run): at least this share of the fp16 activation-gradient
    # values where a zero can only be a flush (a matmul's backward computed them) are exact zeros in modules whose
    # gradients run into fp16's floor; a loss that moved less than
    # ``stalled_loss_change`` (relative) over the run is called stalled
    fp16_flushed_zero_share: float = 0.2
    # A module's fp16 activation gradients run into the floor when more than this share of their nonzero values
    # sit at fp16's smallest subnormal, 2^-24: a distribution that dense at the floor continues below it, and its
    # zeros are flushes. ReLU's exact zeros (or a saturated GELU's) sit apart from a distribution that thins out
    # towards the floor (0.01% of the values at 2^-24 in a ReLU MLP; 4% in one that flushed 98% of its gradients).
    fp16_flushed_floor_share: float = 0.01
    stalled_loss_change: float = 0.02
    # ...over at least ``stalled_min_steps`` recorded losses, and without a trend its own noise resolves (a slope
    # more than ``stalled_trend_t`` standard errors from 0): a 4-step fp16 run whose loss fell 0.5% step after
    # step, as its fp32 run's did, was told 'training stalled', critically
    stalled_min_steps: int = 10
    stalled_trend_t: float = 3.0
    fp16_underflow_block: float = 0.10
    # ...unless the values still lost at the recommended scale are negligible: in every module they carry at
    # most this share of the activation gradient's L2 norm (a layer whose gradients are all tiny is lost
    # entirely and fails this; a few far-out tail values in an otherwise healthy tensor pass it).
    fp16_underflow_norm_ok: float = 1e-3
    # Activations whose largest value is within 2^fp16_activation_headroom_log2 of 65504 are kept in fp32 too:
    # steps that were not sampled can be larger.
    fp16_activation_headroom_log2: int = 1
    # Forward activations that flush to zero in fp16 (no loss scale helps the forward pass).
    fp16_activation_underflow_warn: float = 0.01
    # fp16 is not worth it when more than this share of the matmul layers would have to stay in fp32.
    fp16_keep_share_max: float = 0.5
    # GradScaler's default growth interval; doubled (at least) when the scaler thrashed.
    default_growth_interval: int = 2000
    # Thrashing: at least this many skipped steps after the scaler first settled, with growth in between.
    thrash_min_skips: int = 2
    # Lost weight updates (updates below half an ulp of the weight in bf16/fp16): warn above this share.
    lost_update_warn: float = 0.01
    # ... and, in a run that holds its weights in the format, whatever the model's share, where one parameter
    # loses more than this share of its own updates: it hardly trains (an fp16-pure model's LayerNorm weights,
    # near 1.0, lose every AdamW update below half an fp16 ulp, 2^-11, while the model loses a fraction of 1%).
    lost_update_param_warn: float = 0.5
    # bf16 is blocked when more than this share of nonzero gradient values underflow bf16 at scale 1.
    bf16_underflow_block: float = 0.01
    # Every what-if cast (per-tensor FP8 under current scaling, MXFP8's elements, like fp16's
    # ``fp16_underflow_norm_ok``) is judged by the share of a tensor's L2 norm it loses to underflow (and, for
    # block formats, to saturation), an upper bound from the exponent histograms (analysis/lost_norm.py), never
    # by the count of values it flushes. At most 0.1%: a bf16 cast moves a tensor by 0.17% of its norm (torch's
    # own casts of 4M Gaussian or Laplace values), so a cast that loses less changes a tensor less than the bf16
    # autocast every mixed-precision run already applies; FP8's own rounding moves it by 2.7% (e4m3) and 5.3%
    # (e5m2). Per-tensor FP8 reads the median over the sampled steps: one step's share does not flip a layer.
    lost_norm_max: float = 1e-3
    # ...and a tensor whose largest 0.1% of values push more than this share of its values below the FP8
    # format's smallest normal is not cast per tensor: an outlier sets the scale, and the bulk keeps 0 to 3 of
    # e4m3's 4 significant bits while the whole-tensor norm, which the outlier holds, loses almost nothing. An
    # N(0,1) input of 512 x 256 values with one value of 1.2e4, 2e4 or 3e4 gets 38%, 68% or 95% of its values
    # pushed there, and e4m3 moves each other token by 2.9%, 3.9% or 7.2% of its norm, against 2.7% without the
    # outlier (real casts); torchao's FP8 Linear errs by 7.7% a token at 3e4, against 3.6%.
    fp8_pushed_subnormal_max: float = 0.5
    # FP8 is advised only where its estimated speedup of a training step at the eligible layers' GEMM shapes
    # (analysis/fp8_speed.py: each layer shape's bf16 and FP8 times measured alone on an H200, and one constant
    # for the rest of the step fitted on three whole steps) is above this. Against the steps it lands within
    # 0.09 of the measured speedup (gpt2-small 0.84x for 0.75x, qwen2-2048 0.85x for 0.86x, qwen2-4096 1.23x for
    # 1.25x): a gain must clear 10% to be promised.
    fp8_speedup_min: float = 1.1
    # Tensor-core alignment: dims multiple of 8 for fp16/bf16/tf32, of 16 for fp8.
    alignment: int = 8
    fp8_alignment: int = 16
    # ... judged for layers carrying at least this share of the linear layers' matmul FLOPs (at the tokens each
    # call read): a router's or a gate's few outputs (an MoE's shared_expert_gate, out=1) cost next to nothing
    # misaligned
    alignment_min_flops_share: float = 0.01
    # Below this many parameters, fp32 may be as fast as mixed precision (launch-bound, not math-bound).
    small_model_params: int = 100_000_000
    # Mixed precision requested but not active: critical when at least this share of matmul layers still
    # produce float32 outputs (1.0: none is active), info when fewer do.
    mp_inactive_share: float = 1.0
    # Messages list at most this many modules by name ("and N more").
    max_listed_modules: int = 8
    # Non-finite gradients on steps GradScaler skipped are its business (a scale too high) unless the run of
    # skips drove the scale this many powers of two below the last scale at which a step was finite, or
    # lasted to the end of the run over at least ``nonfinite_persist_steps`` steps: overflow is gone after a
    # back-off or two, a nan from the model is not.
    nonfinite_backoff_log2: int = 4
    nonfinite_persist_steps: int = 8
    # Block-scaled formats (Blackwell: rules/blocks.py), judged per matmul layer over every operand its three
    # GEMMs quantise, from the layers table's block columns summed over the sampled steps.
    # MXFP8 (E4M3 elements, as Transformer Engine's MXFP8BlockScaling and torchao's MX training use for forward
    # and backward alike; E8M0 scales per 32 values, rounded up as cuBLAS and TE compute them, "rceil") is judged
    # like per-tensor FP8: flushing and saturation lose at most ``lost_norm_max`` of each operand's norm...
    # ...and its SQNR is at least this: E4M3's 3 mantissa bits give 30-31.5 dB on Gaussian, Laplace and
    # Student-t blocks (precprof.block_formats on 4M values); 28 dB allows twice that noise power, for elements
    # that land in E4M3's subnormals, and no more.
    block_mxfp8_sqnr_min_db: float = 28.0
    # NVFP4 / MXFP4 (FP4 E2M1 elements) where every operand's SQNR is at least this: the norm of its whole error,
    # what FP4 flushes by design included (E2M1 keeps nothing below a quarter of a block's scale: 7-9% of the
    # values of Gaussian blocks, 13-16% of Laplace ones, carrying 1.4-2.0% and 2.4-3.5% of their norm in NVFP4
    # and MXFP4, precprof.block_formats on 4M values: more than ``lost_norm_max``, and trained on). NVIDIA's NVFP4
    # pretraining recipe (arXiv 2509.25149: a 12B model on 10T tokens, within about 1% of FP8's validation loss)
    # applies a random Hadamard transform to the weight-gradient GEMM's inputs precisely to make each block's
    # contents Gaussian-like, and keeps about the last 15% of the layers in bf16. Round-to-nearest FP4 of
    # Gaussian blocks gives 20.4 dB in NVFP4 and 18.8 dB in MXFP4 (Laplace: 20.7 / 17.9 dB); 18 dB admits what
    # that recipe trains on and rejects tensors whose blocks are worse than Gaussian. The count of values
    # flushed is not judged (a block dominated by one outlier flushes the others, which carry little of its
    # norm: the SQNR says how much).
    block_fp4_sqnr_min_db: float = 18.0
