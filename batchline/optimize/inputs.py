"""The inputs `batchline optimize` judges and calibrates with: the user's (a .npz of the model's
inputs, or a text file tokenized as the gateway tokenizes the model's text), else generated ones
(and the report says so). Nothing comes from the network."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass

import numpy as np

from batchline.codec import DATATYPES
from batchline.protocol import internal_pb2 as pb
from batchline.text_inputs import configured, first_too_long, fixed_width, token_arrays

GENERATED_ROWS = 256
GENERATED_LENGTH = 128  # for the variable dims of generated inputs (a sequence length)
# Rows that calibrate activation ranges (int8-static, TensorRT's table), spread over the inputs:
# ranges settle within a few hundred rows, and each row costs a run that records every tensor.
CALIBRATION_ROWS = 512


class InputsError(ValueError):
    """The inputs given do not fit the model: the message names the mismatch."""


@dataclass
class Inputs:
    batches: list[dict[str, np.ndarray]]  # each at most the model's max_batch_size rows
    source: str                           # what they are, for the report
    timing: dict[str, np.ndarray] | None = None  # the batch speed is measured on (default: the first)

    def __post_init__(self) -> None:
        if self.timing is None:
            self.timing = self.batches[0]

    @property
    def rows(self) -> int:
        return sum(next(iter(b.values())).shape[0] for b in self.batches)


def spread(batches: list[dict[str, np.ndarray]], rows: int) -> list[int]:
    """Indices of batches holding about `rows` rows, spread evenly over `batches` (texts come sorted
    by length: every length)."""
    per = len(next(iter(batches[0].values())))
    count = min(len(batches), max(1, -(-rows // per)))
    return sorted({round(i * (len(batches) - 1) / max(count - 1, 1)) for i in range(count)})


def _split(arrays: dict[str, np.ndarray], batch: int) -> list[dict[str, np.ndarray]]:
    rows = next(iter(arrays.values())).shape[0]
    return [{k: v[i:i + batch] for k, v in arrays.items()} for i in range(0, rows, batch)]


def from_npz(path: pathlib.Path, info: pb.ModelInfo, batch: int) -> Inputs:
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    expected = {s.name: s for s in info.inputs}
    if set(arrays) != set(expected):
        raise InputsError(f"{path}: holds inputs {sorted(arrays)}, model '{info.name}' takes {sorted(expected)}")
    rows = {a.shape[0] if a.ndim else 0 for a in arrays.values()}
    if len(rows) != 1 or 0 in rows:
        raise InputsError(f"{path}: every input needs the same number of rows (a batch dim first), got "
                          + ", ".join(f"{k} {list(v.shape)}" for k, v in arrays.items()))
    for name, spec in expected.items():
        shape = arrays[name].shape
        if len(shape) != len(spec.shape) or any(d not in (-1, s) for d, s in zip(list(spec.shape)[1:], shape[1:])):
            raise InputsError(f"{path}: input '{name}' has shape {list(shape)}, model '{info.name}' takes "
                              f"{list(spec.shape)} (-1: any)")
        arrays[name] = arrays[name].astype(DATATYPES[spec.datatype])
    return Inputs(_split(arrays, batch), f"{path.name}: {rows.pop()} rows")


def from_texts(path: pathlib.Path, tokenizer_json: bytes, info: pb.ModelInfo, batch: int) -> Inputs:
    """The texts at `path` (one a line) tokenized as the gateway tokenizes the model's text input
    (config.toml's [tokenizer]: its tokenizer, max_length, truncation and input names), in batches
    of texts of similar length, as the scheduler's length-aware batches are. The timing batch is
    the file's first texts, lengths mixed."""
    text = info.text
    if not text.name:
        raise InputsError(f"--texts needs a [tokenizer] table in the config.toml of model '{info.name}' (its "
                          f"tokenizer and the inputs it feeds); the model takes {sorted(s.name for s in info.inputs)}")
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise InputsError(f"{path}: no text (one sentence a line)")
    tokenizer = configured(tokenizer_json.decode(), text)
    encodings = tokenizer.encode_batch(lines)
    too_long = first_too_long(encodings, text)
    if too_long:
        i, n = too_long
        raise InputsError(f"{path}: text {i + 1} is {n} tokens, more than the {text.max_length} model '{info.name}' "
                          "takes (its [tokenizer] does not truncate)")
    dtypes = {s.name: DATATYPES[s.datatype] for s in info.inputs}

    def feeds(chosen: list) -> dict[str, np.ndarray]:
        return {name: array.astype(dtypes[name]) for name, array in token_arrays(chosen, text, fixed_width(info))}

    by_length = sorted(encodings, key=lambda e: len(e.ids))
    batches = [feeds(by_length[i:i + batch]) for i in range(0, len(lines), batch)]
    return Inputs(batches, f"{path.name}: {len(lines)} texts, tokenized with the model's [tokenizer] (at most "
                           f"{text.max_length} tokens)", timing=feeds(encodings[:batch]))


def generated(info: pb.ModelInfo, batch: int, rows: int = GENERATED_ROWS, seed: int = 0) -> Inputs:
    rng = np.random.default_rng(seed)
    arrays = {}
    for spec in info.inputs:
        shape = [rows] + [d if d >= 0 else GENERATED_LENGTH for d in list(spec.shape)[1:]]
        dtype = DATATYPES[spec.datatype]
        if np.issubdtype(dtype, np.integer):
            # Masks all ones; other integers as token ids inside a BERT-sized vocabulary.
            arrays[spec.name] = (np.ones(shape, dtype) if "mask" in spec.name
                                 else rng.integers(1000, 29000, size=shape).astype(dtype))
        else:
            arrays[spec.name] = rng.standard_normal(shape).astype(dtype)
    return Inputs(_split(arrays, batch), f"generated: {rows} rows of random values (no inputs were given; "
                                         "judge with --texts or --calibration for a verdict on real data)")
