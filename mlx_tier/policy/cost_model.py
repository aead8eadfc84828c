"""Where a host-resident expert is computed: on the CPU where it lies, or copied to the GPU.

The one placement rule of the two-tier cache (:mod:`mlx_tier.policy.placement`), written
here and nowhere else. An expert that is not in the GPU's hot tier lies in
host memory (warm tier, or just read there from SSD). For the ``t`` tokens of
one layer call routed to it, either

- the CPU computes it in place:  ``t x bytes / cpu_gbps``
  (CPU GB/s is weight bytes per second for *one* token: a CPU expert matvec is
  compute-bound on MLX's CPU kernels, docs/architecture.md, so t tokens cost t times one), or
- it is copied over PCIe and the GPU computes it:  ``bytes / pcie_gbps + bytes / gpu_gbps``
  (the GPU reads the weights once for the whole batch: memory-bound while t
  is small, which holds for decode and prefill chunks up to a few hundred tokens).

Copying wins when ``t > cpu_gbps x (1 / pcie_gbps + 1 / gpu_gbps)``: bytes
cancel out, so the rule is a token threshold. A free GPU slot is always filled
(the copy then displaces nothing and every later use runs on the GPU).

Ahead of use (warm -> hot prefetch, :meth:`mlx_tier.policy.placement.TierIndex.promote_ahead`)
the copy overlaps the previous layer's compute, so only the GPU's compute
is left to weigh against the CPU's: copy ahead when
``bytes / gpu_gbps < t x bytes / cpu_gbps``, i.e. ``t > cpu_gbps / gpu_gbps``
(:func:`copy_ahead_pays`; with the defaults, from one token). That the copy
finishes in time is assumed, not modelled.

Technique: Fiddler (Kamahori et al., "Fiddler: CPU-GPU Orchestration for Fast
Inference of Mixture-of-Experts Models", arXiv:2402.07033) compares the same two
latencies per expert and number of input tokens. Not modelled: the CPU work
overlaps the GPU's (so the CPU side is cheaper than it looks), and a copy may
demote another expert (its device-to-host copy is not counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class TransferCosts:
    """Bandwidths of the two ways to compute a host-resident expert, in GB/s (1e9 bytes/s).

    The defaults are nominal assumptions for a PCIe 4.0 x16 machine with a
    server-class CPU kernel, not measurements: PCIe 25 GB/s (of 32 nominal),
    GPU 1000 GB/s of weights, CPU 50 GB/s of weights per token. With them,
    copying pays from 3 tokens on one expert. ``benches/gpu_check.sh`` is where
    they are to be measured on a real device.

    Raises:
        ValueError: a bandwidth that is not positive (``math.inf`` is allowed:
            e.g. ``cpu_gbps=inf`` never copies, ``pcie_gbps=inf, gpu_gbps=inf``
            always copies).
    """

    pcie_gbps: float = 25.0
    gpu_gbps: float = 1000.0
    cpu_gbps: float = 50.0

    def __post_init__(self):
        for name in ("pcie_gbps", "gpu_gbps", "cpu_gbps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0) or math.isnan(v):
                raise ValueError(f"{name} must be a positive bandwidth in GB/s, got {v!r}")

    def cpu_seconds(self, nbytes: int, tokens: int) -> float:
        """Seconds for the CPU to compute ``tokens`` tokens on an expert of ``nbytes`` bytes."""
        return tokens * nbytes / (self.cpu_gbps * GB)

    def copy_seconds(self, nbytes: int, tokens: int) -> float:
        """Seconds to copy the expert over PCIe and compute ``tokens`` tokens on the GPU."""
        return nbytes / (self.pcie_gbps * GB) + nbytes / (self.gpu_gbps * GB)

    def copy_is_cheaper(self, nbytes: int, tokens: int) -> bool:
        """True when copying then computing on the GPU beats computing on the CPU."""
        return self.copy_seconds(nbytes, tokens) < self.cpu_seconds(nbytes, tokens)


def goes_to_hot(costs: TransferCosts, nbytes: int, tokens: int, hot_has_free_slot: bool) -> bool:
    """The placement rule: should a host-resident expert be copied into the hot tier?

    Args:
        nbytes: resident bytes of the expert (all its tensors).
        tokens: (token, k) entries of this layer call routed to it, >= 1.
        hot_has_free_slot: the layer's hot tier has an empty slot.

    Returns:
        True: copy it to the hot tier (a promotion, or a cold read placed there);
        False: compute it on the CPU from the warm tier.
    """
    return hot_has_free_slot or costs.copy_is_cheaper(nbytes, tokens)


def copy_ahead_pays(costs: TransferCosts, nbytes: int, tokens: int) -> bool:
    """The warm -> hot prefetch rule: is a predicted warm expert worth copying to
    the GPU ahead of use, the copy hidden behind the previous layer's compute?

    Args:
        nbytes: resident bytes of the expert.
        tokens: (token, k) entries predicted to use it in the next call, >= 1.

    Returns:
        True when the GPU computing it beats the CPU computing it in place:
        ``nbytes / gpu_gbps < tokens x nbytes / cpu_gbps``.
    """
    return nbytes / (costs.gpu_gbps * GB) < costs.cpu_seconds(nbytes, tokens)
