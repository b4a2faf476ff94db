"""Loss scalers for fp16 training (megatron-core names)."""

import math
from abc import ABC, abstractmethod
from typing import Dict, Optional

import torch


class MegatronGradScaler(ABC):
    """Holds the loss scale ``s``: the loss is multiplied by ``s``, gradients by ``1/s``."""

    def __init__(self, initial_scale: float, device: Optional[torch.device] = None) -> None:
        if not is_valid_loss_scale(initial_scale):
            raise ValueError(
                f"initial_scale={initial_scale}: expected a number > 0, finite in float32 "
                "(an infinite scale overflows every step and can never back off)"
            )
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float, device=device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool) -> None: ...

    @abstractmethod
    def state_dict(self) -> Dict: ...

    @abstractmethod
    def load_state_dict(self, state_dict: Dict) -> None: ...


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state_dict: Dict) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Halve (``backoff_factor``) after ``hysteresis`` overflowing steps, never below
    ``min_scale``; grow by ``growth_factor`` after ``growth_interval`` clean steps."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__(initial_scale, device)
        if not (is_valid_loss_scale(min_scale) and min_scale <= initial_scale):
            raise ValueError(
                f"min_scale={min_scale}: expected a number > 0, finite in float32 and <= "
                f"initial_scale ({initial_scale})"
            )
        if not (math.isfinite(growth_factor) and growth_factor > 1.0):
            raise ValueError(
                f"min_scale={min_scale}, growth_factor={growth_factor}: expected "
                "0 < min_scale <= initial_scale and growth_factor > 1"
            )
        if not (0.0 < backoff_factor < 1.0) or growth_interval <= 0 or hysteresis <= 0:
            raise ValueError(
                f"backoff_factor={backoff_factor}, growth_interval={growth_interval}, "
                f"hysteresis={hysteresis}: expected 0 < backoff < 1 and positive counts"
            )
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float, device=device)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float, device=device)
        self.backoff_factor = torch.tensor(
            [float(backoff_factor)], dtype=torch.float, device=device
        )
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> Dict:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: Dict) -> None:
        self._scale = state_dict["scale"].to(self._scale.device)
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]


FP32_MAX = torch.finfo(torch.float32).max  # the scale is held in float32


def is_valid_loss_scale(value: object) -> bool:
    """A number > 0 that stays finite in float32 (an infinite scale overflows every fp16
    step and backing off from it stays infinite)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= FP32_MAX
    )
