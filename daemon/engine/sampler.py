"""Batched sampling from logits with per-request parameters and per-request seeded generators.

One call handles a whole batch: each row of `logits` has its own `SamplingState`. Every step is a
batched tensor op with per-row parameters, and a step runs only when some row in the batch needs it.

Order of operations (vLLM's):
  0. logit_bias (OpenAI) is added to the raw logits of the rows that have one.
  1. penalties on the raw logits: repetition (prompt + output tokens), then frequency and presence
     (output tokens only); then the min_tokens mask (eos and stop_token_ids get -inf).
  2. logprobs are taken here: log_softmax of these processed logits, before temperature and
     before any truncation. `rank` and `top_logprobs` use the same distribution.
  3. greedy rows (temperature < 1e-5) take the argmax.
  4. random rows: divide by temperature, keep the top_k best tokens (ties at the k-th place are
     cut by torch.topk's order), drop tokens with prob < min_p * max_prob, then top_p over what is
     left (renormalized), then draw one token.

Rows with top_k work on their k best logits only (one topk call per distinct k in the batch, so a
row's candidates never depend on its neighbours); top_p there is an exact cumulative sum over the
sorted candidates. Rows without top_k work on the whole vocabulary, as below.

Drawing. Each random row needs a single uniform number u in [0, 1), taken from the row's own
generator when it has one (seeded requests), else from torch's global CPU generator. The token is
the inverse CDF of the row's weights at u. A seeded row therefore draws the same token whatever
else is in the batch, and the work is one cumulative sum per row, not one random number per vocab
entry.

top_p without sorting. A full sort of 256 x 49152 floats costs seconds on a small CPU, so top_p is
applied by rejection: draw a token j from the (min_p truncated) distribution; j lies in the
nucleus iff the mass of tokens strictly more likely than j is below top_p. If not, drop every token
not more likely than j and draw again from what is left (still a superset of the nucleus, so the
accepted token follows the nucleus distribution exactly). Tokens tied with the boundary token are
all kept. A rejection happens with probability <= 1 - top_p, so nearly every row is done after
one check; rows still open after a few rounds fall back to an exact sort of that row.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from kvpilot.kernels import ops

from .sampling_params import SamplingParams

GREEDY_TEMPERATURE = 1e-5
_MAX_REJECTION_ROUNDS = 8
_NEG_INF = float("-inf")


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A generator seeded from a request's seed; None (use the global RNG) when there is no seed."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    # torch takes seeds in [0, 2**64); map any Python int there so that negative seeds work too.
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


@dataclass
class SamplingState:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (penalties and min_tokens)
    generator: torch.Generator | None = None  # per-request, from make_generator(params.seed)
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class SampleResult:
    token_id: int
    logprob: float  # log_softmax of the penalized logits (before temperature/top-k/top-p/min-p)
    rank: int  # 1-based rank of token_id in that same distribution
    # params.logprobs = k: the k best (token id, logprob), best first; [] for k = 0; None when unset.
    top_logprobs: list[tuple[int, float]] | None = None


class Sampler:
    """Samples one token per row. Not thread-safe: it keeps up to four [rows, vocab] float32
    scratch buffers between calls ("proc", "exp", "x", "scratch"; 50 MB each at 256 x 49152),
    because fresh multi-megabyte allocations cost page faults that dominate on small CPUs."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> list[SampleResult]:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [len(states), vocab], got {tuple(logits.shape)} for {len(states)} states")
        n, vocab = logits.shape
        if n == 0:
            return []
        if logits.dtype != torch.float32:
            logits = logits.float()
        device = logits.device
        params = [s.params for s in states]

        proc = self._processed_logits(logits, states)

        # Row max (for the log-normalizer) and greedy tokens.
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        rand_rows = [i for i, g in enumerate(greedy) if not g]
        ranks = torch.ones(n, dtype=torch.long, device=device)  # greedy tokens are rank 1
        fused = None if rand_rows else ops.greedy_stats(proc)
        if fused is not None:
            # all greedy on the CPU: argmax, max and logsumexp in one native pass per row
            tokens, mx, lse = fused
        else:
            mx = torch.amax(proc, dim=-1)
            exp_buf = self._buffer("exp", n, vocab, device)
            torch.sub(proc, mx[:, None], out=exp_buf)
            exp_buf.exp_()
            sum_exp = exp_buf.sum(dim=-1)
            lse = mx + sum_exp.log()
            tokens = torch.empty(n, dtype=torch.long, device=device)
        if fused is None and len(rand_rows) < n:
            # argmax over every row costs less than gathering the greedy rows first.
            tokens = proc.argmax(dim=-1)
        if rand_rows:
            r_idx = torch.tensor(rand_rows, device=device)
            chosen = self._sample_random(proc, mx, r_idx, [states[i] for i in rand_rows], exp_buf, sum_exp)
            tokens[r_idx] = chosen
            # Rank on every row (greedy rows come out as 1), again cheaper than a gather of rows.
            # Count into a float buffer: summing a bool tensor is several times slower on CPU.
            above = self._buffer("scratch", n, vocab, device)
            torch.gt(proc, proc.gather(1, tokens[:, None]), out=above)
            ranks = above.sum(dim=-1).long() + 1

        logprobs = proc.gather(1, tokens[:, None]).squeeze(1) - lse

        top: dict[int, list[tuple[int, float]]] = {}
        lp_rows = [i for i, p in enumerate(params) if p.logprobs]
        if lp_rows:
            k = max(params[i].logprobs for i in lp_rows)
            l_idx = torch.tensor(lp_rows, device=device)
            vals, ids = self._rows(proc, l_idx, "x").topk(min(k, vocab), dim=-1)
            vals = (vals - lse[l_idx][:, None]).tolist()
            ids = ids.tolist()
            for j, i in enumerate(lp_rows):
                kk = params[i].logprobs
                top[i] = list(zip(ids[j][:kk], vals[j][:kk], strict=True))

        tok_l, lp_l, rank_l = tokens.tolist(), logprobs.tolist(), ranks.tolist()
        return [
            SampleResult(
                token_id=tok_l[i],
                logprob=lp_l[i],
                rank=rank_l[i],
                top_logprobs=top.get(i, []) if params[i].logprobs is not None else None,
            )
            for i in range(n)
        ]

    # ------------------------------------------------------------------ helpers

    def _buffer(self, name: str, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != vocab or buf.device != device:
            buf = torch.empty(max(rows, buf.shape[0] if buf is not None and buf.shape[1] == vocab else 0), vocab,
                              dtype=torch.float32, device=device)
            self._buffers[name] = buf
        return buf[:rows]

    def _rows(self, t: torch.Tensor, idx: torch.Tensor, name: str) -> torch.Tensor:
        """Rows idx of t: t itself when idx is every row, else a copy in a reused buffer."""
        if idx.numel() == t.shape[0]:
            return t
        out = self._buffer(name, idx.numel(), t.shape[1], t.device)
        return torch.index_select(t, 0, idx, out=out)

    def _processed_logits(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Penalties and the min_tokens mask, on a copy; the caller's logits are left as they were."""
        n, vocab = logits.shape
        device = logits.device
        pen_rows = [i for i, s in enumerate(states) if _has_penalty(s.params)]
        mask_rows: list[int] = []
        mask_toks: list[int] = []
        for i, s in enumerate(states):
            p = s.params
            if len(s.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    banned |= s.eos_token_ids
                for t in banned:
                    if 0 <= t < vocab:
                        mask_rows.append(i)
                        mask_toks.append(t)
        bias_rows = [i for i, s in enumerate(states) if s.params.logit_bias]
        if not pen_rows and not mask_rows and not bias_rows:
            return logits
        proc = self._buffer("proc", n, vocab, device)
        proc.copy_(logits)
        if bias_rows:  # OpenAI's logit_bias: added to the raw logits, before penalties (vLLM's order)
            _apply_logit_bias(proc, [states[i].params for i in bias_rows], bias_rows)
        if pen_rows:
            _apply_penalties(proc, [states[i] for i in pen_rows], pen_rows)
        if mask_rows:
            proc[torch.tensor(mask_rows, device=device), torch.tensor(mask_toks, device=device)] = _NEG_INF
        return proc

    def _sample_random(
        self,
        proc: torch.Tensor,
        mx: torch.Tensor,
        r_idx: torch.Tensor,
        states: list[SamplingState],
        exp_buf: torch.Tensor,
        sum_exp: torch.Tensor,
    ) -> torch.Tensor:
        """Draw one token for each row in r_idx (rows of proc). exp_buf holds exp(proc - max)."""
        m = len(states)
        vocab = proc.shape[1]
        device = proc.device
        params = [s.params for s in states]
        u = _uniforms(states, list(range(m)), device)  # one per row, up front
        chosen = torch.empty(m, dtype=torch.long, device=device)
        # Rows with top_k only need their top k logits; the others work on the whole row.
        k_rows = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
        f_rows = [j for j, p in enumerate(params) if not 0 < p.top_k < vocab]
        if k_rows:
            # One topk call per distinct k: a row's k best (and how ties among them are ordered)
            # then never depend on the other rows, which keeps seeded rows reproducible.
            buckets: dict[int, list[int]] = {}
            for j in k_rows:
                buckets.setdefault(params[j].top_k, []).append(j)
            for rows in buckets.values():
                pos = torch.tensor(rows, device=device)
                chosen[pos] = _sample_top_k(self._rows(proc, r_idx[pos], "x"), [params[j] for j in rows], u[pos])
        if f_rows:
            pos = torch.tensor(f_rows, device=device)
            chosen[pos] = self._sample_full(
                proc, mx, r_idx if len(f_rows) == m else r_idx[pos], [states[j] for j in f_rows], u[pos],
                exp_buf, sum_exp,
            )
        return chosen

    def _sample_full(
        self,
        proc: torch.Tensor,
        mx: torch.Tensor,
        idx: torch.Tensor,
        states: list[SamplingState],
        u: torch.Tensor,
        exp_buf: torch.Tensor,
        sum_exp: torch.Tensor,
    ) -> torch.Tensor:
        """Rows without top_k: temperature, min_p and top_p over the whole vocabulary."""
        m = len(states)
        n, vocab = proc.shape
        device = proc.device
        params = [s.params for s in states]
        if m == n and all(p.temperature == 1.0 and p.min_p == 0.0 for p in params):
            # vLLM's default parameters on every row: the weights are exactly exp(proc - max),
            # already computed for the logprobs.
            weights, total = exp_buf, sum_exp
        else:
            temp = torch.tensor([p.temperature for p in params], device=device)
            weights = self._buffer("x", m, vocab, device)
            if m == n:
                torch.div(proc, temp[:, None], out=weights)
            else:
                torch.index_select(proc, 0, idx, out=weights).div_(temp[:, None])
            xmax = mx.index_select(0, idx) / temp  # division is monotone: this is the max of each row
            weights.sub_(xmax[:, None]).exp_()  # weight of the most likely token is 1
            if any(p.min_p > 0.0 for p in params):
                # p_i >= min_p * p_max  <=>  weight_i >= min_p
                keep = self._buffer("scratch", m, vocab, device)
                torch.ge(weights, torch.tensor([p.min_p for p in params], device=device)[:, None], out=keep)
                weights.mul_(keep)
            total = weights.sum(dim=-1)

        chosen = _inverse_cdf(weights, u, self._buffer("scratch", m, vocab, device))

        # top_p by rejection (see the module docstring).
        pending = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if not pending:
            return chosen
        top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
        for _ in range(_MAX_REJECTION_ROUNDS):
            pidx = torch.tensor(pending, device=device)
            w = weights if len(pending) == m else weights.index_select(0, pidx)
            wj = w.gather(1, chosen[pidx][:, None])
            above = self._buffer("scratch", len(pending), vocab, device)
            torch.gt(w, wj, out=above)
            mass_above = above.mul_(w).sum(dim=-1)  # mass of the tokens strictly more likely than j
            reject = mass_above >= top_p[pidx] * total[pidx]
            if not bool(reject.any()):
                return chosen
            pending = [pending[j] for j in reject.nonzero().flatten().tolist()]
            pidx = torch.tensor(pending, device=device)
            w = w[reject]
            # Keep only the tokens strictly more likely than the rejected one, and draw again.
            w.masked_fill_(w <= wj[reject], 0.0)
            weights[pidx] = w
            chosen[pidx] = _inverse_cdf(w, _uniforms(states, pending, device), torch.empty_like(w))
        for j in pending:  # rare: exact nucleus by sorting this one row
            chosen[j] = _sorted_top_p(weights[j], float(total[j]), params[j].top_p, states[j], device)
        return chosen


def _sample_top_k(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Rows with top_k: temperature, top_k, min_p and top_p on the k best logits only (sorted)."""
    device = logits.device
    ks = torch.tensor([p.top_k for p in params], device=device)
    vals, ids = logits.topk(int(ks.max()), dim=-1)  # sorted, best first
    temp = torch.tensor([p.temperature for p in params], device=device)[:, None]
    vals = (vals - vals[:, :1]) / temp
    vals.masked_fill_(torch.arange(vals.shape[1], device=device)[None, :] >= ks[:, None], _NEG_INF)
    w = vals.exp_()  # the best token has weight 1
    if any(p.min_p > 0.0 for p in params):
        w = w * (w >= torch.tensor([p.min_p for p in params], device=device)[:, None])
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
        csum = torch.cumsum(w, dim=-1)
        before = csum - w  # mass of the better tokens
        keep = (before < top_p * csum[:, -1:]) | (top_p >= 1.0)
        w = w * keep
    j = _inverse_cdf(w, u, torch.empty_like(w))
    return ids.gather(1, j[:, None]).squeeze(1)


def _apply_logit_bias(proc: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> None:
    """proc[row, token] += bias for every (token, bias) of each row's logit_bias; ids outside the
    logits' width are skipped (the input processor has already refused ids outside the vocabulary)."""
    vocab = proc.shape[1]
    r_idx: list[int] = []
    t_idx: list[int] = []
    vals: list[float] = []
    for row, p in zip(rows, params, strict=True):
        for tid, bias in (p.logit_bias or {}).items():
            if 0 <= tid < vocab:
                r_idx.append(row)
                t_idx.append(tid)
                vals.append(float(bias))
    if r_idx:
        device = proc.device
        proc.index_put_((torch.tensor(r_idx, device=device), torch.tensor(t_idx, device=device)),
                        torch.tensor(vals, dtype=proc.dtype, device=device), accumulate=True)


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _apply_penalties(proc: torch.Tensor, states: list[SamplingState], rows: list[int]) -> None:
    """vLLM semantics, in place on the given rows of proc:
    repetition r, on every token seen in the prompt or the output: logit / r if logit > 0 else logit * r;
    then frequency f and presence p, on output tokens only: logit -= f * count + p.
    Only the (row, token) pairs that occur are touched, so the cost follows the sequence lengths,
    not the vocabulary size."""
    vocab = proc.shape[1]
    device = proc.device
    flat = proc.view(-1)
    params = [s.params for s in states]
    row_t = torch.tensor(rows, device=device)

    out_ids, out_pos = _flatten([s.output_token_ids for s in states], vocab, device)
    out_keys, counts = torch.unique(row_t[out_pos] * vocab + out_ids, return_counts=True)

    if any(p.repetition_penalty != 1.0 for p in params):
        p_ids, p_pos = _flatten([s.prompt_token_ids for s in states], vocab, device)
        seen = torch.unique(torch.cat([row_t[p_pos] * vocab + p_ids, out_keys]))
        rep = torch.ones(proc.shape[0], device=device)
        rep[row_t] = torch.tensor([p.repetition_penalty for p in params], device=device)
        r = rep[seen // vocab]
        v = flat[seen]
        flat[seen] = torch.where(v > 0, v / r, v * r)
    if out_keys.numel() and any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        freq = torch.zeros(proc.shape[0], device=device)
        pres = torch.zeros(proc.shape[0], device=device)
        freq[row_t] = torch.tensor([p.frequency_penalty for p in params], device=device)
        pres[row_t] = torch.tensor([p.presence_penalty for p in params], device=device)
        r = out_keys // vocab
        flat[out_keys] -= freq[r] * counts.to(flat.dtype) + pres[r]


def _flatten(lists: list[list[int]], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of several lists as one flat tensor plus the list index of each; ids outside
    the vocabulary are dropped."""
    ids = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long, device=device)
    pos = torch.repeat_interleave(
        torch.arange(len(lists), device=device), torch.tensor([len(x) for x in lists], device=device)
    )
    ok = (ids >= 0) & (ids < vocab)
    return ids[ok], pos[ok]


def _uniforms(states: list[SamplingState], rows: list[int], device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row: from the row's generator when seeded, else from the global one.
    Drawn in float64 so that tokens with tiny probabilities keep their share."""
    out = [0.0] * len(rows)
    unseeded = []
    for j, i in enumerate(rows):
        gen = states[i].generator
        if gen is None:
            unseeded.append(j)
        else:
            out[j] = torch.rand((), generator=gen, dtype=torch.float64, device=gen.device).item()
    if unseeded:
        for j, v in zip(unseeded, torch.rand(len(unseeded), dtype=torch.float64).tolist(), strict=True):
            out[j] = v
    return torch.tensor(out, dtype=torch.float64, device=device)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor, cdf: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative weight exceeds u * total (weights need not sum to 1)."""
    torch.cumsum(weights, dim=-1, out=cdf)
    total = cdf[:, -1]  # the cumulative sum's own total, so that the target is always reachable
    target = (u * total.double()).to(cdf.dtype)
    # Clamp below the total so that a rounding up of u * total never walks off the end; the first
    # index with cdf > target then always has a positive weight.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)


def _sorted_top_p(
    w: torch.Tensor, total: float, top_p: float, state: SamplingState, device: torch.device
) -> torch.Tensor:
    vals, ids = w.sort(descending=True)
    before = torch.cumsum(vals, dim=0) - vals  # mass strictly before each position
    keep = int((before < top_p * total).sum())
    kept = vals[:keep].clone()
    u = _uniforms([state], [0], device)
    j = _inverse_cdf(kept[None], u, torch.empty_like(kept[None]))
    return ids[j[0]]
