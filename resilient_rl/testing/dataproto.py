"""A DataProto whose rows can be told apart, and readers of its rows, as the protocol tests build
and check them."""

from __future__ import annotations

import numpy as np
import torch

from resilient_rl.protocol import DataProto


def make(n: int = 6, meta: dict | None = None) -> DataProto:
    """Rows are identifiable: row i has ids == i, obs == [2i, 2i+1], uid == f"u{i}"."""
    return DataProto.from_dict(
        tensors={"ids": torch.arange(n), "obs": torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
        meta_info={"temperature": 0.7} if meta is None else meta,
    )


def ids(data: DataProto) -> list[int]:
    return data.batch["ids"].tolist()


def uids(data: DataProto) -> list[str]:
    return data.non_tensor_batch["uid"].tolist()
