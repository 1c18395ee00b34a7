"""Plain, slow, one-row-at-a-time references of every sampler stage (contract §4.4), written
with Python lists and `math` straight from the contract's wording. The batched ops under
paphos/sample/ops/ are tested against these."""

from __future__ import annotations

import math

INF = math.inf


def probs_of(row: list[float]) -> list[float]:
    top = max(row)
    weights = [math.exp(v - top) if v != -INF else 0.0 for v in row]
    total = sum(weights)
    return [w / total for w in weights]


def entropy(row: list[float]) -> float:
    return -sum(p * math.log(p) for p in probs_of(row) if p > 0)


def sorted_ids(row: list[float]) -> list[int]:
    """Descending probability, ties: lower id first."""
    return sorted(range(len(row)), key=lambda i: (-row[i], i))


def finite(row: list[float]) -> list[int]:
    return [i for i, v in enumerate(row) if v != -INF]


def keep_only(row: list[float], kept: set[int]) -> list[float]:
    return [v if i in kept else -INF for i, v in enumerate(row)]


def remove_keep_max(row: list[float], removed: set[int]) -> list[float]:
    top = max(row)
    return [-INF if i in removed and v < top else v for i, v in enumerate(row)]


def temperature(row, t, dmin=0.0, dmax=0.0, exponent=1.0):
    if dmin > 0 or dmax > 0:
        n = len(finite(row))
        t = dmin if n <= 1 else dmin + (dmax - dmin) * (entropy(row) / math.log(n)) ** exponent
        t = max(t, 1e-5)
    return [v / t for v in row]


def top_k(row, k):
    if k <= 0 or k >= len(row):
        return list(row)
    kth = row[sorted_ids(row)[k - 1]]
    return [v if v >= kth else -INF for v in row]


def top_p(row, p):
    if p >= 1.0:
        return list(row)
    probs = probs_of(row)
    kept, mass = set(), 0.0
    for i in sorted_ids(row):
        if mass >= p and kept:
            break
        kept.add(i)
        mass += probs[i]
    return keep_only(row, kept)


def top_a(row, a):
    probs = probs_of(row)
    limit = a * max(probs) ** 2
    return remove_keep_max(row, {i for i, p in enumerate(probs) if p < limit})


def min_p(row, m):
    probs = probs_of(row)
    return keep_only(row, {i for i, p in enumerate(probs) if p >= m * max(probs)})


def tfs(row, z):
    if z >= 1.0:
        return list(row)
    order = sorted_ids(row)
    f = len(finite(row))
    p = [probs_of(row)[i] for i in order]
    d = [abs(p[i] - 2 * p[i + 1] + p[i + 2]) for i in range(max(0, f - 2))]
    total = sum(d)
    if total == 0:
        return list(row)
    cum, m = 0.0, f - 1
    for i, di in enumerate(d):
        cum += di / total
        if cum > z:
            m = i
            break
    return keep_only(row, set(order[: m + 1]))


def typical_p(row, tp):
    if tp >= 1.0:
        return list(row)
    probs = probs_of(row)
    h = entropy(row)
    order = sorted(finite(row), key=lambda i: (abs(-math.log(probs[i]) - h) if probs[i] > 0 else INF, i))
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= tp:
            break
    return keep_only(row, kept)


def eta_cutoff(row, eta):
    theta = min(eta, math.sqrt(eta) * math.exp(-entropy(row)))
    return remove_keep_max(row, {i for i, p in enumerate(probs_of(row)) if p < theta})


def epsilon_cutoff(row, eps):
    return remove_keep_max(row, {i for i, p in enumerate(probs_of(row)) if p < eps})


def top_nsigma(row, n):
    if n <= 0:
        return list(row)
    vals = [row[i] for i in finite(row)]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    limit = max(vals) - n * std
    return [v if v >= limit else -INF for v in row]


def quadratic(row, f, c):
    if f == 0:
        return list(row)
    m = max(row)
    k, s = f * (3 - c) / 2, f * (c - 1) / 2
    return [v if v == -INF else m - k * (v - m) ** 2 + s * (v - m) ** 3 for v in row]


def xtc(row, threshold, applies):
    probs = probs_of(row)
    above = [i for i in sorted_ids(row) if probs[i] >= threshold]
    if not applies or len(above) < 2:
        return list(row)
    return keep_only(row, set(range(len(row))) - set(above[:-1]))


def skew(row, s):
    if s == 0:
        return list(row)
    order = sorted_ids(row)
    probs = probs_of(row)
    out = [-INF] * len(row)
    prev, cum = 0.0, 0.0
    for i in order:
        cum = min(1.0, cum + probs[i])
        c = cum ** math.exp(s)
        if row[i] != -INF:
            out[i] = math.log(c - prev) if c > prev else -INF
        prev = c
    return out


def penalties(row, tokens, num_prompt, rp, rep_range, slope, freq, pres):
    window = tokens[-rep_range:] if rep_range > 0 else list(tokens)
    newer = set(window[len(window) - (len(window) - len(window) // 2):])
    out = list(row)
    for t in set(window):
        r = rp if (t in newer or slope >= 1 or rp <= 1) else 1 + (rp - 1) * slope
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    output = tokens[num_prompt:]
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def dry(row, tokens, breakers, mult, base, allowed, dry_range=0, max_ngram=50, max_occ=0, early_exit=0):
    s = tokens[-dry_range:] if dry_range > 0 else list(tokens)
    if mult == 0 or not s or s[-1] in breakers:
        return list(row)
    last = len(s) - 1
    longest: dict[int, int] = {}
    occurrences = [i for i in range(last) if s[i] == s[last]][::-1]
    if max_occ > 0:
        occurrences = occurrences[:max_occ]
    for i in occurrences:
        t = s[i + 1]
        if t in breakers:
            continue
        length = 1
        while length < max_ngram and i - length >= 0 and s[i - length] == s[last - length] \
                and s[last - length] not in breakers:
            length += 1
        longest[t] = max(longest.get(t, 0), length)
        if early_exit > 0 and length >= early_exit:
            break
    out = list(row)
    for t, length in longest.items():
        if length >= allowed:
            out[t] -= mult * base ** (length - allowed)
    return out


def no_repeat_ngram(row, tokens, n):
    if n <= 0 or len(tokens) < n - 1:
        return list(row)
    prefix = tokens[len(tokens) - (n - 1):] if n > 1 else []
    banned = {tokens[j + n - 1] for j in range(len(tokens) - n + 1) if tokens[j:j + n - 1] == prefix}
    return [-INF if i in banned else v for i, v in enumerate(row)]


def mirostat_v2(row, mu):
    probs = probs_of(row)
    return remove_keep_max(row, {i for i, p in enumerate(probs) if p > 0 and -math.log2(p) > mu})


def mirostat_v1_k(row, mu, vocab):
    probs = sorted(probs_of(row), reverse=True)
    f = len(finite(row))
    m = min(100, f)
    num = den = 0.0
    for i in range(m - 1):
        t = math.log((i + 2) / (i + 1))
        b = math.log(probs[i] / probs[i + 1])
        num += t * b
        den += t * t
    s_hat = num / den
    eps = s_hat - 1
    k = ((eps * 2 ** mu) / (1 - vocab ** (-eps))) ** (1 / s_hat)
    return int(min(max(math.floor(k), 1), f))
