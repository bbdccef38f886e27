"""A character-level tokenizer for the built-in tasks and small JSONL prompt sets.

Ids 0, 1 and 2 are the special tokens pad, bos and eos; the alphabet's characters follow in order.
"""

from __future__ import annotations

import string
from typing import Iterable, Sequence

from resilient_rl.errors import TokenizerError

#: Digits, the task separators and lowercase letters: enough for every built-in task.
DEFAULT_ALPHABET = string.digits + "+=|> " + string.ascii_lowercase

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


class CharTokenizer:
    """Maps each character of ``alphabet`` to one id, after the three special tokens."""

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if not alphabet:
            raise TokenizerError("tokenizer alphabet must not be empty")
        if len(set(alphabet)) != len(alphabet):
            dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
            raise TokenizerError(f"tokenizer alphabet repeats characters {dupes!r}")
        self.alphabet = alphabet
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self._specials = (PAD, BOS, EOS)
        self._to_id = {c: i + len(self._specials) for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        """Number of ids: the special tokens plus the alphabet."""
        return len(self._specials) + len(self.alphabet)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of ``text``'s characters, optionally framed by bos/eos; unknown characters raise."""
        ids = [self.bos_token_id] if add_bos else []
        for pos, char in enumerate(text):
            try:
                ids.append(self._to_id[char])
            except KeyError:
                raise TokenizerError(f"character {char!r} at position {pos} of {text!r} is not in the "
                                     f"tokenizer alphabet {self.alphabet!r}") from None
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True, stop_at_eos: bool = False) -> str:
        """Text of ``ids`` (ints, or a 1-D tensor/array); ``stop_at_eos`` cuts at the first eos."""
        out = []
        n_special = len(self._specials)
        for raw in ids:
            i = int(raw)
            if stop_at_eos and i == self.eos_token_id:
                break
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if i < n_special:
                if not skip_special:
                    out.append(self._specials[i])
                continue
            out.append(self.alphabet[i - n_special])
        return "".join(out)

    def decode_response(self, ids: Iterable[int]) -> str:
        """A generated response as text: everything before the first eos, specials dropped."""
        return self.decode(ids, skip_special=True, stop_at_eos=True)

    def batch_decode_responses(self, rows: Sequence[Iterable[int]]) -> list[str]:
        """:meth:`decode_response` for each row of a batch (e.g. a [B, R] tensor)."""
        return [self.decode_response(row) for row in rows]

    def state_dict(self) -> dict:
        """JSON-serialisable description, enough to rebuild the same tokenizer."""
        return {"kind": "char", "alphabet": self.alphabet}

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, alphabet={self.alphabet!r})"
