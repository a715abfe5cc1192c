"""The inputs `batchline optimize` judges and calibrates with: the user's (a .npz of the model's
inputs, or a text file tokenized with the model's tokenizer), else generated ones (and the report
says so). Nothing comes from the network."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass

import numpy as np

from batchline.codec import DATATYPES
from batchline.protocol import internal_pb2 as pb

GENERATED_ROWS = 256
GENERATED_LENGTH = 128  # for the variable dims of generated inputs (a sequence length)


class InputsError(ValueError):
    """The inputs given do not fit the model: the message names the mismatch."""


@dataclass
class Inputs:
    batches: list[dict[str, np.ndarray]]  # each at most the model's max_batch_size rows
    source: str                           # what they are, for the report

    @property
    def rows(self) -> int:
        return sum(next(iter(b.values())).shape[0] for b in self.batches)


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


def from_texts(path: pathlib.Path, model_dir: pathlib.Path, info: pb.ModelInfo, batch: int,
               max_length: int = GENERATED_LENGTH) -> Inputs:
    tokenizer_file = model_dir / "tokenizer" / "tokenizer.json"
    if not tokenizer_file.exists():
        raise InputsError(f"--texts needs the model's tokenizer at {tokenizer_file}")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding()
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise InputsError(f"{path}: no text (one sentence a line)")
    names = {s.name for s in info.inputs}
    if "input_ids" not in names:
        raise InputsError(f"--texts needs a model with an `input_ids` input; model '{info.name}' takes {sorted(names)}")
    batches = []
    for i in range(0, len(lines), batch):
        encodings = tokenizer.encode_batch(lines[i:i + batch])
        columns = {"input_ids": [e.ids for e in encodings], "attention_mask": [e.attention_mask for e in encodings],
                   "token_type_ids": [e.type_ids for e in encodings]}
        batches.append({s.name: np.asarray(columns[s.name], dtype=DATATYPES[s.datatype]) for s in info.inputs})
    return Inputs(batches, f"{path.name}: {len(lines)} texts, tokenized with the model's tokenizer (at most "
                           f"{max_length} tokens)")


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
