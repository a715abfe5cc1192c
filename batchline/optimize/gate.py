"""The accuracy gate a variant must pass to become a version: its outputs against FP32's.

Each output is judged as what it is (`kinds`): an embedding must keep its directions and its
neighbours (the mean cosine to FP32 and its 1st percentile, and each row's top-10 nearest
neighbours within the set mostly the same); a classifier must keep its argmax and stay close in
value; any other output must stay close in value.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import numpy as np

# How an output is judged: embedding (cosines, nearest neighbours), classes (argmax agreement),
# values (absolute error); executor/model_config.py's [optimize] outputs takes the same names.
KINDS = ("embedding", "classes", "values")
# Default kinds by output name (case-insensitive, first match wins), before looking at the values.
EMBEDDING_NAMES = ("*embed*", "sentence*", "pooler*", "last_hidden*")
CLASSES_NAMES = ("*prob*", "*logit*", "*class*")
# Neighbours are searched among at most this many rows (a fixed sample beyond), a block of rows at
# a time: at most NEIGHBOUR_BLOCK x NEIGHBOUR_ROWS similarities (8 MiB) are held at once.
NEIGHBOUR_ROWS = 4096
NEIGHBOUR_BLOCK = 256


@dataclass(frozen=True)
class Thresholds:
    min_mean_cosine: float = 0.99
    min_p1_cosine: float = 0.98
    min_neighbour_overlap: float = 0.9
    neighbours: int = 10
    max_abs_error: float = 0.05
    min_argmax_agreement: float = 0.99


def kind_of(name: str, reference: np.ndarray, declared: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """How output `name` is judged, and why: as declared (kind, where: --output, else config.toml's
    [optimize] outputs), else by its name, else a probability distribution (rows >= 0 summing to 1)
    is classes, else values."""
    if name in declared:
        return declared[name]
    rows = reference.ndim >= 2 and np.issubdtype(reference.dtype, np.floating)
    lowered = name.lower()
    if rows and any(fnmatch.fnmatchcase(lowered, p) for p in EMBEDDING_NAMES):
        return "embedding", f"its name matches {', '.join(EMBEDDING_NAMES)}"
    if any(fnmatch.fnmatchcase(lowered, p) for p in CLASSES_NAMES):
        return "classes", f"its name matches {', '.join(CLASSES_NAMES)}"
    if rows and reference.shape[-1] > 1 and reference.size and reference.min() >= 0 \
            and np.allclose(reference.sum(-1), 1.0, atol=1e-3):
        return "classes", "its rows are probabilities (>= 0, summing to 1)"
    return "values", "neither its name nor its values say embedding or classes"


def cosines(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    a, b = reference.astype(np.float64), candidate.astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.sum(a * b, axis=1) / np.maximum(norms, 1e-12)


def _nearest(x: np.ndarray, k: int) -> np.ndarray:
    """Each row's k nearest rows by cosine (itself excluded), as sets of indices, a block at a time."""
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    out = np.empty((len(x), k), np.int64)
    for start in range(0, len(x), NEIGHBOUR_BLOCK):
        similarity = unit[start:start + NEIGHBOUR_BLOCK] @ unit.T
        rows = np.arange(len(similarity))
        similarity[rows, rows + start] = -np.inf
        top = np.argpartition(-similarity, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(similarity, top, axis=1), axis=1, kind="stable")
        out[start:start + len(similarity)] = np.take_along_axis(top, order, axis=1)
    return out


def neighbour_overlap(reference: np.ndarray, candidate: np.ndarray, k: int) -> float:
    """Mean share of each row's k nearest rows (cosine, itself excluded) that both agree on; over a
    fixed sample of NEIGHBOUR_ROWS rows when there are more."""
    if len(reference) > NEIGHBOUR_ROWS:
        sample = np.sort(np.random.default_rng(0).choice(len(reference), NEIGHBOUR_ROWS, replace=False))
        reference, candidate = reference[sample], candidate[sample]
    k = min(k, len(reference) - 1)
    if k < 1:
        return 1.0
    a, b = _nearest(reference.astype(np.float64), k), _nearest(candidate.astype(np.float64), k)
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(a, b)]))


def distance(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray], kinds: dict[str, str]) -> float:
    """One number for how far `candidate` is from FP32, to rank choices by: the mean cosine distance
    of embeddings plus the relative mean absolute error of other outputs."""
    total = 0.0
    for name, ref in reference.items():
        ref64, got64 = ref.astype(np.float64), candidate[name].astype(np.float64)
        if kinds[name] == "embedding":
            total += float(np.mean(1.0 - cosines(ref64.reshape(len(ref64), -1), got64.reshape(len(got64), -1))))
        else:
            total += float(np.mean(np.abs(ref64 - got64)) / max(float(np.mean(np.abs(ref64))), 1e-12))
    return total if np.isfinite(total) else float("inf")  # a broken choice ranks last


def judge(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray], t: Thresholds,
          kinds: dict[str, str]) -> dict:
    """The gate's measurements per output and its verdict: {"passed": bool, "outputs": {...}, "failed": [why]}."""
    outputs, failed = {}, []
    for name, ref in reference.items():
        got = candidate[name]
        # Every comparison with NaN is False: a NaN or infinity where FP32 has a number would
        # pass each threshold below unseen.
        broken = int(np.count_nonzero(~np.isfinite(got) & np.isfinite(ref))) \
            if np.issubdtype(got.dtype, np.floating) else 0
        if broken:
            failed.append(f"{name}: {broken} values are NaN or infinite where FP32's are finite")
        if kinds[name] == "embedding":
            ref2, got2 = ref.reshape(len(ref), -1), got.reshape(len(got), -1)
            c = cosines(ref2, got2)
            m = {"kind": "embedding", "mean_cosine": float(c.mean()), "p1_cosine": float(np.percentile(c, 1)),
                 "neighbour_overlap": neighbour_overlap(ref2, got2, t.neighbours)}
            checks = [("mean_cosine", t.min_mean_cosine), ("p1_cosine", t.min_p1_cosine),
                      ("neighbour_overlap", t.min_neighbour_overlap)]
            failed += [f"{name}: {key} {m[key]:.4f} < {floor} (short by {floor - m[key]:.4f})"
                       for key, floor in checks if not m[key] >= floor]
        else:
            ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
            err = np.abs(ref64 - got64)
            m = {"kind": kinds[name], "max_abs_error": float(err.max(initial=0.0)),
                 "max_rel_error": float((err / np.maximum(np.abs(ref64), 1e-6)).max(initial=0.0))}
            if not m["max_abs_error"] <= t.max_abs_error:
                failed.append(f"{name}: max_abs_error {m['max_abs_error']:.4g} > {t.max_abs_error} "
                              f"(over by {m['max_abs_error'] - t.max_abs_error:.4g})")
            if kinds[name] == "classes" and ref.ndim >= 2 and ref.shape[-1] > 1:
                m["argmax_agreement"] = float(np.mean(ref.argmax(-1) == got.argmax(-1)))
                if not m["argmax_agreement"] >= t.min_argmax_agreement:
                    failed.append(f"{name}: argmax_agreement {m['argmax_agreement']:.4f} < {t.min_argmax_agreement}")
        outputs[name] = m
    return {"passed": not failed, "outputs": outputs, "failed": failed}
