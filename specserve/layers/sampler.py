"""Turning logits into a distribution, and a distribution into a token.

compute_probs applies temperature, top-k and top-p in vLLM's order. Sampling takes its uniforms from
the caller, so the same function serves plain decoding and speculative verification, and a seeded
request draws them from its own generator.
"""
import numpy as np
import torch


def compute_probs(
    logits: torch.Tensor,       # [M, V] any float dtype
    temperature: torch.Tensor,  # [M] float, 0 = greedy
    top_k: torch.Tensor,        # [M] int64, 0 = off
    top_p: torch.Tensor,        # [M] float, 1.0 = off
    min_p: torch.Tensor | None = None,  # [M] float, 0 = off
) -> torch.Tensor:
    """softmax(logits / T), without the tokens below min_p x the most likely one's probability, truncated to
    the top-k tokens, then to the top-p nucleus, renormalized (vLLM's order: min_p, then top-k/top-p).

    Greedy rows (T == 0) are exactly one-hot at argmax(logits) (ties: the lowest index).
    Returns [M, V] float32.
    """
    logits = logits.float()
    V = logits.shape[1]
    greedy = temperature <= 0                                              # [M]
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits)
    logits = logits / t[:, None]                                           # [M, V]
    if min_p is not None and bool(((min_p > 0) & ~greedy).any()):
        probs = torch.softmax(logits, dim=-1)
        floor = (min_p.to(probs) * probs.amax(dim=-1))[:, None]           # [M, 1]
        logits = logits.masked_fill((probs < floor) & ~greedy[:, None], float("-inf"))
    use_k = (top_k > 0) & (top_k < V) & ~greedy                            # [M]
    use_p = (top_p < 1) & ~greedy                                          # [M]
    if bool((use_k | use_p).any()):  # only sort the vocabulary when some row truncates
        logits = _top_k_top_p(logits, top_k, use_k, top_p, use_p)
    probs = torch.softmax(logits, dim=-1)                                  # [M, V]
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _top_k_top_p(
    logits: torch.Tensor,  # [M, V] float32, already divided by the temperature
    k: torch.Tensor,       # [M] int64
    use_k: torch.Tensor,   # [M] bool, rows where 0 < k < V
    p: torch.Tensor,       # [M] float in (0, 1]
    use_p: torch.Tensor,   # [M] bool
) -> torch.Tensor:
    """Masks truncated tokens to -inf (vLLM's apply_top_k_top_p, sorted descending).

    Top-k keeps every token at least as likely as the k-th, so ties with it are kept, as in vLLM.
    """
    V = logits.shape[1]
    if not bool(use_p.any()):
        # top-k alone needs only the k largest logits, not a sort of the vocabulary
        max_k = int(k[use_k].max())
        kth = logits.topk(max_k, dim=-1).values.gather(1, (k.clamp(1, max_k) - 1)[:, None])  # [M, 1]
        return logits.masked_fill((logits < kth) & use_k[:, None], float("-inf"))
    k = torch.where(use_k, k, V)
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [M, V]
    kth = sorted_logits.gather(1, (k - 1)[:, None])                            # [M, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # top-p: the smallest prefix whose mass reaches p, i.e. keep token i iff the mass before it is < p;
    # the first token has nothing before it, so at least one token is always kept
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs                                 # [M, V]
    drop = (mass_before >= p[:, None].to(probs)) & use_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i returns the first token whose cumulative mass exceeds u[i] * total.

    probs [M, V] need not be normalized (non-negative, each row with positive mass); u [M] in [0, 1).
    Never returns a zero-probability token, even where float rounding leaves u * total at or past the
    cumsum of the last positive token. Returns [M] int64.
    """
    # float64: in float32 each token's interval would be off by up to half an ulp of the running
    # sum, about 1e-3 in total variation over a 150k vocabulary
    cdf = probs.double().cumsum(dim=-1)                                    # [M, V]
    x = u.double()[:, None] * cdf[:, -1:]                                  # [M, 1]
    positive = probs > 0                                                   # [M, V]
    # A zero-probability token adds nothing to the cdf, but a parallel scan may round its entry a hair
    # above its neighbour's, so excluding it explicitly is what makes the guarantee hold on every device.
    hit = (cdf > x) & positive
    first = hit.byte().argmax(dim=-1)                                      # first True
    last_positive = probs.shape[1] - 1 - positive.flip(-1).byte().argmax(dim=-1)
    return torch.where(hit.any(dim=-1), first, last_positive)


def draw_uniforms(
    generators: list[torch.Generator | None],
    n: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[len(generators), n] float64 uniforms in [0, 1): row i from generators[i], or from torch's
    default generator where it is None (one batched call for all of those rows)."""
    out = torch.empty(len(generators), n, dtype=torch.float64)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        out[unseeded] = torch.rand(len(unseeded), n, dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            out[i] = torch.rand(n, generator=g, dtype=torch.float64, device=g.device).cpu()
    return out if device is None else out.to(device)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SEED_MODULUS = 1 << 64


def seed_array(seeds: list[int]) -> np.ndarray:
    """Any Python integer as the generator's 64-bit seed: taken modulo 2**64 (two's complement for the
    negative ones, so -1 is 2**64 - 1), which leaves every seed in [0, 2**64) unchanged."""
    return np.asarray([s % SEED_MODULUS for s in seeds], dtype=np.uint64)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def position_uniforms(seeds: list[int], positions, stream: int = 0) -> torch.Tensor:
    """[B, n] float64 uniforms in [0, 1): entry (b, j) is a fixed function of (seeds[b], positions[b][j], stream).

    A counter-based generator: the uniform that samples the token at sequence position i is the same
    however many steps it took to get there, so a seeded request draws the same numbers with or without
    speculation (and, for deterministic drafts, yields the same tokens as plain sampling).
    """
    seed = _splitmix64(seed_array(seeds) ^ (np.uint64(stream) << np.uint64(56)))
    pos = np.asarray(positions, dtype=np.uint64).reshape(len(seeds), -1)
    with np.errstate(over="ignore"):
        h = _splitmix64(_splitmix64(seed[:, None] + pos * _GOLDEN))
    return torch.from_numpy((h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)))
