"""The accuracy gate a variant must pass to become a version: its outputs against FP32's.

Embeddings (a 2-D float output, [batch, dim]) must keep their directions and their neighbours:
the mean cosine to FP32 and its 1st percentile above thresholds, and each embedding's top-10
nearest neighbours within the set mostly the same. Anything else must stay close in value, and a
classifier (a last dim above 1) must keep its argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Thresholds:
    min_mean_cosine: float = 0.99
    min_p1_cosine: float = 0.98
    min_neighbour_overlap: float = 0.9
    neighbours: int = 10
    max_abs_error: float = 0.05
    min_argmax_agreement: float = 0.99


def is_embedding(array: np.ndarray) -> bool:
    return array.ndim == 2 and array.shape[1] >= 8 and np.issubdtype(array.dtype, np.floating)


def cosines(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    a, b = reference.astype(np.float64), candidate.astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.sum(a * b, axis=1) / np.maximum(norms, 1e-12)


def neighbour_overlap(reference: np.ndarray, candidate: np.ndarray, k: int) -> float:
    """Mean share of each row's k nearest rows (cosine, itself excluded) that both agree on."""
    k = min(k, len(reference) - 1)
    if k < 1:
        return 1.0

    def nearest(x: np.ndarray) -> np.ndarray:
        unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        similarity = unit @ unit.T
        np.fill_diagonal(similarity, -np.inf)
        return np.argsort(-similarity, axis=1)[:, :k]

    a, b = nearest(reference.astype(np.float64)), nearest(candidate.astype(np.float64))
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(a, b)]))


def judge(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray], t: Thresholds) -> dict:
    """The gate's measurements per output and its verdict: {"passed": bool, "outputs": {...}, "failed": [why]}."""
    outputs, failed = {}, []
    for name, ref in reference.items():
        got = candidate[name]
        if is_embedding(ref):
            c = cosines(ref, got)
            m = {"kind": "embedding", "mean_cosine": float(c.mean()), "p1_cosine": float(np.percentile(c, 1)),
                 "neighbour_overlap": neighbour_overlap(ref, got, t.neighbours)}
            checks = [("mean_cosine", t.min_mean_cosine), ("p1_cosine", t.min_p1_cosine),
                      ("neighbour_overlap", t.min_neighbour_overlap)]
            failed += [f"{name}: {key} {m[key]:.4f} < {floor} (short by {floor - m[key]:.4f})"
                       for key, floor in checks if m[key] < floor]
        else:
            ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
            err = np.abs(ref64 - got64)
            m = {"kind": "values", "max_abs_error": float(err.max(initial=0.0)),
                 "max_rel_error": float((err / np.maximum(np.abs(ref64), 1e-6)).max(initial=0.0))}
            if m["max_abs_error"] > t.max_abs_error:
                failed.append(f"{name}: max_abs_error {m['max_abs_error']:.4g} > {t.max_abs_error} "
                              f"(over by {m['max_abs_error'] - t.max_abs_error:.4g})")
            if ref.ndim >= 2 and ref.shape[-1] > 1:
                m["argmax_agreement"] = float(np.mean(ref.argmax(-1) == got.argmax(-1)))
                if m["argmax_agreement"] < t.min_argmax_agreement:
                    failed.append(f"{name}: argmax_agreement {m['argmax_agreement']:.4f} < {t.min_argmax_agreement}")
        outputs[name] = m
    return {"passed": not failed, "outputs": outputs, "failed": failed}
