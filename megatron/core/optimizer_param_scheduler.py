"""Learning-rate warm-up and decay, weight-decay increment (megatron-core's scheduler).

At step n (after ``step(increment)`` calls summing to n), with warm-up W, decay end D,
``lr_max`` / ``lr_min`` per param group (``max_lr`` / ``min_lr``, else the scheduler's):

    warm-up (W > 0, n <= W):  lr = init_lr + (lr_max - init_lr) * n / W
    constant:                 lr = lr_max
    n > D:                    lr = lr_min
    r = (n - W) / (D - W):    linear  lr = lr_min + (lr_max - lr_min) * (1 - r)
                              cosine  lr = lr_min + (lr_max - lr_min) * (1 + cos(pi r)) / 2
    inverse-square-root:      lr = max(lr_min, lr_max * sqrt(max(W,1)) / sqrt(max(n,1)))
    WSD: constant until D - wsd_decay_steps, then the ``lr_wsd_decay_style`` ramp to lr_min.

Weight decay goes from ``start_wd`` to ``end_wd`` over ``wd_incr_steps`` (constant, linear,
cosine ``(1 + cos(pi (1 - r)))/2``), times the group's ``wd_mult``.
"""

import math
from typing import Any, Optional


class OptimizerParamScheduler:
    """Sets ``lr`` and ``weight_decay`` of every param group of ``optimizer`` each step."""

    def __init__(
        self,
        optimizer: Any,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: Optional[bool] = True,
        override_opt_param_scheduler: Optional[bool] = False,
        wsd_decay_steps: Optional[int] = None,
        lr_wsd_decay_style: Optional[str] = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        _require(min_lr >= 0.0, "min_lr", min_lr, ">= 0")
        _require(self.max_lr >= min_lr, "max_lr", max_lr, f">= min_lr ({min_lr})")
        _require(init_lr <= self.max_lr, "init_lr", init_lr, f"<= max_lr ({max_lr})")
        self.lr_warmup_steps = lr_warmup_steps
        self.num_steps = 0
        self.lr_decay_steps = lr_decay_steps
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        _require(lr_decay_steps > 0, "lr_decay_steps", lr_decay_steps, "> 0")
        _require(
            lr_warmup_steps < lr_decay_steps,
            "lr_warmup_steps",
            lr_warmup_steps,
            f"< lr_decay_steps ({lr_decay_steps})",
        )
        _require(
            lr_decay_style in ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
            "lr_decay_style",
            lr_decay_style,
            "constant, linear, cosine, inverse-square-root or WSD",
        )
        if lr_decay_style == "WSD":
            _require(wsd_decay_steps is not None, "wsd_decay_steps", wsd_decay_steps, "an int")
        self.lr_decay_style = lr_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        _require(start_wd >= 0.0, "start_wd", start_wd, ">= 0")
        _require(end_wd >= start_wd, "end_wd", end_wd, f">= start_wd ({start_wd})")
        _require(
            wd_incr_style in ("constant", "linear", "cosine"),
            "wd_incr_style",
            wd_incr_style,
            "constant, linear or cosine",
        )
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "override_opt_param_scheduler=True and use_checkpoint_opt_param_scheduler=True; "
                "expected at most one"
            )
        self.step(0)

    def get_wd(self, param_group: Optional[dict] = None) -> float:
        """Weight decay at the current step (before the group's ``wd_mult``)."""
        start = self.start_wd if param_group is None else param_group.get("start_wd", self.start_wd)
        end = self.end_wd if param_group is None else param_group.get("end_wd", self.end_wd)
        if self.num_steps > self.wd_incr_steps:
            return end
        if self.wd_incr_style == "constant":
            if start != end:
                raise ValueError(f"wd_incr_style='constant' with start_wd={start} != end_wd={end}")
            return end
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return start + coeff * (end - start)

    def get_lr(self, param_group: dict) -> float:
        """Learning rate at the current step for ``param_group`` (formulas in the module doc)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        n, warm, decay = self.num_steps, self.lr_warmup_steps, self.lr_decay_steps
        if warm > 0 and n <= warm:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(warm)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > decay:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * max(warm, 1) ** 0.5 / max(n, 1) ** 0.5)
        ratio = float(n - warm) / float(decay - warm)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD
            anneal_start = decay - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                r = float(n - anneal_start) / float(self.wsd_decay_steps)
                style = self.lr_wsd_decay_style
                if style == "linear":
                    coeff = 1.0 - r
                elif style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * r) + 1.0)
                elif style == "exponential":
                    coeff = 2.0 * math.pow(0.5, r) - 1.0
                elif style == "minus_sqrt":
                    coeff = 1.0 - math.sqrt(r)
                else:
                    raise ValueError(
                        f"lr_wsd_decay_style={style!r}: expected linear, cosine, exponential "
                        "or minus_sqrt"
                    )
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        """Advance ``increment`` steps and write lr / weight_decay into every param group."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group)
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        """The schedule's settings and the step count."""
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value: Any, sd_value: Any, name: str) -> Any:
        if self.override_opt_param_scheduler:
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(
                f"OptimizerParamScheduler: {name} is {cls_value} here but {sd_value} in the "
                "checkpoint (set use_checkpoint_opt_param_scheduler or "
                "override_opt_param_scheduler)"
            )
        return sd_value

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a ``state_dict`` (older megatron key names accepted) and re-apply it."""

        def first(*keys: str) -> Any:
            for key in keys:
                if key in state_dict:
                    return state_dict[key]
            raise KeyError(f"scheduler state_dict has none of {keys}")

        self.max_lr = self._check_and_set(self.max_lr, first("start_lr", "max_lr"), "max_lr")
        self.min_lr = self._check_and_set(self.min_lr, state_dict["min_lr"], "min_lr")
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps,
            first("warmup_iter", "warmup_steps", "lr_warmup_steps"),
            "lr_warmup_steps",
        )
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps,
            first("end_iter", "decay_steps", "lr_decay_steps"),
            "lr_decay_steps",
        )
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style, first("decay_style", "lr_decay_style"), "lr_decay_style"
        )
        num_steps = first("num_iters", "num_steps")
        self.num_steps = 0
        if "start_wd" in state_dict:
            self.start_wd = self._check_and_set(self.start_wd, state_dict["start_wd"], "start_wd")
            self.end_wd = self._check_and_set(self.end_wd, state_dict["end_wd"], "end_wd")
            self.wd_incr_steps = self._check_and_set(
                self.wd_incr_steps, state_dict["wd_incr_steps"], "wd_incr_steps"
            )
            self.wd_incr_style = self._check_and_set(
                self.wd_incr_style, state_dict["wd_incr_style"], "wd_incr_style"
            )
        self.step(increment=num_steps)


def _require(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"OptimizerParamScheduler: {name}={value!r}; expected {expected}")
