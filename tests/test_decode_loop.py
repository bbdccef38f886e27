"""The one decode loop both generation modes run (models.generation.decode_loop), with a decoder
whose next token is a pure function of the row and the step: what the loop records, where it stops
and how compaction keeps rows must not depend on the decoder."""

from __future__ import annotations

import torch

from resilient_rl.models.generation import decode_loop

EOS, PAD = 9, 0


class RowDecoder:
    """Row r's token at step s is ``table[r, s]``; ``compact`` keeps the unfinished rows first."""

    def __init__(self, table: torch.Tensor, compact_to: list[int] | None = None):
        self.table, self.rows, self.step_no = table, torch.arange(table.shape[0]), 0
        self.compact_to, self.fed = compact_to, []

    def step(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.fed.append((self.rows.tolist(), tokens.tolist(), position[:, 0].tolist()))
        self.step_no += 1
        return self.table[self.rows, self.step_no]

    def compact(self, finished: torch.Tensor, unfinished: int) -> torch.Tensor | None:
        if not self.compact_to or unfinished > self.compact_to[0]:
            return None
        size = self.compact_to.pop(0)
        keep = torch.argsort(finished.to(torch.int8), stable=True)[:size].sort().values
        self.rows = self.rows[keep]
        return keep


def _table() -> torch.Tensor:
    # Rows end at steps 1, 3, never and 5 (the eos is recorded, then padding).
    t = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]] * 4)
    t[0, 1], t[1, 3], t[3, 5] = EOS, EOS, EOS
    return t


def _run(decoder: RowDecoder, table: torch.Tensor, check_every: int, new_tokens: int = 8):
    return decode_loop(decoder.step, table[:, 0].clone(), torch.tensor([[10], [11], [12], [13]])[:, :1],
                       new_tokens, torch.tensor([EOS]), PAD, check_every,
                       decoder.compact if decoder.compact_to else None)


def test_the_loop_records_each_row_up_to_its_eos_and_pads_after():
    table = _table()
    responses, mask = _run(RowDecoder(table), table, check_every=1)
    assert responses.tolist() == [[1, EOS, 0, 0, 0, 0, 0, 0], [1, 2, 3, EOS, 0, 0, 0, 0],
                                  [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, EOS, 0, 0]]
    assert mask.tolist() == [[int(t != 0) for t in row] for row in responses.tolist()]


def test_compaction_changes_nothing_recorded_and_feeds_only_the_kept_rows():
    table = _table()
    whole = _run(RowDecoder(table), table, check_every=2)
    compacting = RowDecoder(table, compact_to=[2])
    compacted = _run(compacting, table, check_every=2)
    assert all(torch.equal(a, b) for a, b in zip(whole, compacted))
    rows, _, positions = compacting.fed[-1]
    assert rows == [2, 3] and positions == [12 + 7 - 1, 13 + 7 - 1]  # positions follow their rows


def test_the_loop_stops_once_every_row_finished_at_a_check():
    table = torch.tensor([[1, EOS, 5, 5, 5, 5], [EOS, 5, 5, 5, 5, 5]])
    decoder = RowDecoder(table)
    responses, _ = decode_loop(decoder.step, table[:, 0].clone(), torch.tensor([[3], [4]]), 6,
                               torch.tensor([EOS]), PAD, check_every=2)
    assert responses.tolist() == [[1, EOS, 0, 0, 0, 0], [EOS, 0, 0, 0, 0, 0]]
    assert len(decoder.fed) == 1  # one step fed; the check after the second token ended the loop
