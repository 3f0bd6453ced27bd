"""N-gram (prompt lookup) drafts: find the context's last n tokens earlier in the context and propose the
tokens that followed them there. No model: the cost is a scan of the token list per step."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_propose(token_ids: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (max_n down to min_n) of ``token_ids``; [] when no suffix of min_n tokens occurs before.

    The latest occurrence, because a copied passage or an edited file repeats what was seen most recently;
    but the latest one that still has k tokens after it, when there is one: in a loop (a repeated line, a
    token said over and over) the latest match runs into the end of the context after a token or two.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    n_tok = ids.shape[0]
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        suffix = ids[n_tok - n:]
        # windows starting at 0 .. n_tok - n - 1: every earlier position, the suffix itself excluded
        windows = sliding_window_view(ids[: n_tok - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= n_tok]
            start = int(full[-1] if full.size else hits[-1]) + n
            return ids[start : start + k].tolist()
    return []
