"""pass@k from n samples per question: the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374, eq. 1),
``1 - C(n - c, k) / C(n, k)`` for ``c`` correct of ``n``, computed as the product ``prod_{i=n-c+1}^{n} (1 - k / i)``
(their numerically stable form: no factorials). mean@k (avg@k) is its k = 1 case, the mean of the n verdicts."""

from __future__ import annotations

import torch


def pass_at_k(correct: torch.Tensor, k: int) -> torch.Tensor:
    """Per question, the probability that at least one of k samples drawn without replacement from its n is correct.

    Args:
        correct: ``[questions, n]`` verdicts (bool or 0/1).
        k: samples per draw, ``1 <= k <= n``.

    Returns:
        ``[questions]`` float64.
    """
    if correct.dim() != 2:
        raise ValueError(f"pass_at_k needs correct as [questions, n], got shape {tuple(correct.shape)}.")
    n = correct.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n = {n} samples, got k={k}.")
    c = (correct != 0).sum(-1, keepdim=True)  # [Q, 1]
    i = torch.arange(1, n + 1, dtype=torch.float64, device=correct.device)  # [n]
    # factor (1 - k/i) for i in (n - c, n]; 1 elsewhere. i = k lies in that range exactly when n - c < k: then a draw
    # of k always holds a correct sample and the product is 0.
    factors = torch.where(i > n - c, 1.0 - k / i, torch.ones_like(i))  # [Q, n]
    return 1.0 - factors.prod(-1)  # [Q]


def reported_ks(n: int) -> list[int]:
    """The k values logged beside mean@n: powers of two from 2 below n, and n itself (none for n = 1)."""
    ks = [2**e for e in range(1, n.bit_length()) if 2**e < n]
    return ks + [n] if n > 1 else []
