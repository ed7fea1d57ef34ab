"""Chi-square goodness of fit for the lossless-sampling tests (scipy is not a dependency)."""

import jax
import numpy as np


def chi2_pvalue(stat, df):
    return float(jax.scipy.special.gammaincc(df / 2.0, stat / 2.0))


def chi2_test(counts, probs, min_expected=5.0):
    """Pearson chi-square of counts against probabilities; cells with expected < min_expected are
    pooled into one cell. -> (stat, df, p-value)."""
    counts, probs = np.ravel(counts).astype(np.float64), np.ravel(probs).astype(np.float64)
    n = counts.sum()
    exp = probs * n
    big = exp >= min_expected
    obs_cells = np.append(counts[big], counts[~big].sum())
    exp_cells = np.append(exp[big], exp[~big].sum())
    if exp_cells[-1] < min_expected:  # fold a tiny pooled cell into the smallest
        j = np.argmin(exp_cells[:-1])
        obs_cells[j] += obs_cells[-1]
        exp_cells[j] += exp_cells[-1]
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    assert np.all(obs_cells[exp_cells == 0] == 0), "a zero-probability sequence was emitted"
    keep = exp_cells > 0
    stat = float(np.sum((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]))
    df = int(keep.sum()) - 1
    return stat, df, chi2_pvalue(stat, df)
