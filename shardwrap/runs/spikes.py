"""Loss-spike detection: an outlier against a running median, or a value that is not finite.

A step's loss and global gradient norm are compared, before the optimizer applies the step,
with the medians of the last ``window`` accepted steps. A value is an outlier when it exceeds
its median by more than ``z`` times the step-to-step noise and also by more than ``rise``
times the median, so that a run whose noise is tiny does not cry wolf at every wobble. The
noise is estimated from the differences of successive values (1.4826 times their median
absolute value, over the square root of two: the standard deviation for normal noise), not
from the spread around the median, which a falling loss inflates: early in training the loss
falls by more over a window than a bad batch adds. Only rises count: a loss that falls faster
than usual is good news. Steps flagged as spikes never enter the history, so one bad batch does
not move the baseline.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

__all__ = ["SpikeCheck", "Spikes"]

# For normal noise of standard deviation sigma, the difference of two draws has median absolute
# value sigma * sqrt(2) / 1.4826.
_DIFF_TO_SIGMA = 1.4826 / math.sqrt(2)


@dataclass(frozen=True, kw_only=True)
class Spikes:
    """When a step counts as a loss spike, and what the run does about one."""

    window: int = 50
    """Accepted steps whose median is the baseline."""
    min_history: int = 20
    """Steps to see before any outlier is called (non-finite values are spikes at once)."""
    loss_z: float = 6.0
    """Noise standard deviations above the loss median that make an outlier."""
    loss_rise: float = 0.2
    """And the least rise above the loss median, as a fraction of it."""
    grad_z: float = 8.0
    """Noise standard deviations above the gradient-norm median that make an outlier."""
    grad_rise: float = 2.0
    """And the least rise above the gradient-norm median, as a fraction of it."""
    suspect: int = 10
    """Steps before a spike that may already be on the bad path: the rollback goes to the
    last checkpoint saved at least this many steps before it."""
    lr_backoff: float = 0.5
    """Factor applied to the learning rate at a rollback; a spike before it has recovered
    multiplies the factor in force then."""
    lr_recover: int = 100
    """Steps past the spike over which the learning rate climbs back linearly to the
    schedule's; ``0`` keeps it lowered for the rest of the run."""
    max_retries: int = 3
    """Rollbacks in a row without getting ``suspect`` steps past the previous spike, after
    which the run stops with :class:`SpikeError`."""

    def __post_init__(self) -> None:
        if self.window < 3:
            raise ValueError(f"Spikes.window must be at least 3, got {self.window}")
        if not 1 <= self.min_history <= self.window:
            raise ValueError(
                f"Spikes.min_history must be between 1 and window ({self.window}), "
                f"got {self.min_history}"
            )
        for name in ("loss_z", "loss_rise", "grad_z", "grad_rise"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Spikes.{name} must be positive, got {getattr(self, name)}")
        if self.suspect < 0:
            raise ValueError(f"Spikes.suspect must be 0 or more, got {self.suspect}")
        if not 0 < self.lr_backoff <= 1:
            raise ValueError(f"Spikes.lr_backoff must be in (0, 1], got {self.lr_backoff}")
        if self.lr_recover < 0:
            raise ValueError(f"Spikes.lr_recover must be 0 or more, got {self.lr_recover}")
        if self.max_retries < 1:
            raise ValueError(f"Spikes.max_retries must be at least 1, got {self.max_retries}")


class SpikeCheck:
    """The running history of one run, and the verdict on each new step."""

    def __init__(self, spikes: Spikes) -> None:
        self.spikes = spikes
        self.losses: deque[float] = deque(maxlen=spikes.window)
        self.grads: deque[float] = deque(maxlen=spikes.window)

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is a spike (a sentence), or ``None``; a normal step joins the history."""
        s = self.spikes
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return f"non-finite loss {loss} or gradient norm {grad_norm}"
        reasons = []
        if len(self.losses) >= s.min_history:
            reasons += _outlier("loss", loss, self.losses, s.loss_z, s.loss_rise)
            reasons += _outlier("gradient norm", grad_norm, self.grads, s.grad_z, s.grad_rise)
        if reasons:
            return "; ".join(reasons)
        self.losses.append(loss)
        self.grads.append(grad_norm)
        return None

    def state(self) -> dict[str, list[float]]:
        return {"losses": list(self.losses), "grads": list(self.grads)}

    def load(self, state: dict[str, list[float]]) -> None:
        self.losses.clear()
        self.grads.clear()
        self.losses.extend(state["losses"])
        self.grads.extend(state["grads"])


def _outlier(what: str, value: float, history: deque[float], z: float, rise: float) -> list[str]:
    median = statistics.median(history)
    values = list(history)
    sigma = _DIFF_TO_SIGMA * statistics.median(abs(b - a) for a, b in zip(values, values[1:]))
    limit = median + max(z * sigma, rise * abs(median))
    if value <= limit:
        return []
    return [f"{what} {value:.4g} above {limit:.4g} (median {median:.4g} of {len(history)} steps)"]
