"""What the rollout engine is asked to decode: how each token is chosen (`Sampling`) and one generate
call's settings (`Decode`, what its prefill and decode step read). Frozen, so they are hashable: the
engine keys its captured graphs by them (sampler.Engine._graphed)."""
from __future__ import annotations

from dataclasses import dataclass

from ..run.config import RolloutCfg, logit_temperature


@dataclass(frozen=True)
class Sampling:
    # the logits are divided by it before the softmax; a token's recorded log-prob is under that
    # tempered distribution, the one the update's teacher-forced forward recomputes
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus: drawn from the most likely tokens holding this much probability (1: all)
    greedy: bool = False  # the most likely token, no draw (its log-prob still under `temperature`)

    def __post_init__(self):
        if not self.temperature > 0:  # (0 is no temperature to divide by: `of` makes it greedy)
            raise ValueError(f"Sampling.temperature = {self.temperature}; expected > 0 (Sampling.of maps "
                             "rollout.temperature 0 to greedy)")

    @classmethod
    def of(cls, rollout: RolloutCfg, greedy: bool = False) -> Sampling:
        """The run's sampling (rollout.temperature, rollout.top_p), greedy where the caller asks. The
        one place where rollout.temperature 0 means greedy selection; its log-probs are then those of
        the untempered distribution (config.logit_temperature, which score and update divide by too)."""
        return cls(logit_temperature(rollout), rollout.top_p, greedy or rollout.temperature == 0)


@dataclass(frozen=True)
class Decode:
    max_new: int  # new tokens per row (the width of the output buffers)
    sampling: Sampling
    min_new: int  # EOS is blocked before this many new tokens (rollout.min_new_tokens; 0: never)
    eos: int  # a row that draws it is finished
    pad: int  # what a finished row's later positions hold
