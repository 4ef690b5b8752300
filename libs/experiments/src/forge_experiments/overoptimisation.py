"""The over-optimisation signal of RLHF (Gao et al. 2022, "Scaling laws for reward model
over-optimisation"): the policy keeps gaining reward under the proxy reward model while what
humans prefer — agreement with held-out human preferences — falls. One rule, used both during
DPO training (checked every K steps) and by the RLHF loop's drift check between rounds.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def overoptimised(proxy_reward: Sequence[float], heldout_agreement: Sequence[float], window: int) -> bool:
    """True when, over the last ``window`` steps (``window + 1`` points, oldest first), the proxy
    reward rose at every step while held-out agreement fell at every step."""
    if len(proxy_reward) != len(heldout_agreement):
        raise ValueError("proxy_reward and heldout_agreement must have one value per point each")
    if window < 1 or len(proxy_reward) <= window:
        return False
    proxy = list(itertools.pairwise(proxy_reward[-(window + 1) :]))
    agreement = list(itertools.pairwise(heldout_agreement[-(window + 1) :]))
    return all(b > a for a, b in proxy) and all(b < a for a, b in agreement)
