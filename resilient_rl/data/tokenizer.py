"""Tokenizers: a character-level one for the built-in tasks, and Hugging Face tokenizers from a folder.

:class:`CharTokenizer`: ids 0, 1 and 2 are the special tokens pad, bos and eos; the alphabet's
characters follow in order. :class:`HFTokenizer` wraps a ``transformers`` tokenizer loaded from a
local folder (``data.tokenizer``), applying its chat template to prompts when it has one.
:func:`build_tokenizer` picks one from the ``data`` config section; the trainer only needs what
:class:`Tokenizer` lists, and the workers only the vocabulary size and the eos/pad ids.
"""

from __future__ import annotations

import logging
import os
import string
from typing import Any, Iterable, Optional, Protocol, Sequence

from resilient_rl.errors import ConfigError, TokenizerError
from resilient_rl.config.paths import resolve_path

logger = logging.getLogger(__name__)

#: Digits, the task separators and lowercase letters: enough for every built-in task.
DEFAULT_ALPHABET = string.digits + "+=|> " + string.ascii_lowercase

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer."""

    vocab_size: int
    eos_token_id: int
    #: Every id that ends a response (``eos_token_id`` first): generation stops on any of them.
    eos_token_ids: list[int]
    pad_token_id: int

    def encode_prompt(self, text: "str | list[dict]") -> list[int]:
        """Ids of a prompt as the model should see it (bos, chat template, ...); a prompt may be a
        list of chat messages (verl's data), which needs a chat template."""
        ...

    def decode_response(self, ids: Iterable[int]) -> str:
        """A generated response as text: everything before the first eos, specials dropped."""
        ...

    def state_dict(self) -> dict:
        """JSON-serialisable description of the tokenizer."""
        ...


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
        self.eos_token_ids = [self.eos_token_id]
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

    def encode_prompt(self, text: "str | list[dict]") -> list[int]:
        """A prompt's ids: bos, then its characters. Chat messages need a chat template: refused."""
        if not isinstance(text, str):
            raise TokenizerError("the prompt is a list of chat messages, which needs a Hugging Face tokenizer with "
                                 "a chat template (set data.tokenizer, e.g. to the model's folder)")
        return self.encode(text, add_bos=True)

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
        """A generated response as text: everything before the first eos, specials dropped, and
        ids outside the vocabulary too (a model built with more rows than this tokenizer has ids,
        ``model.hf_config.vocab_size``, may sample them), as a Hugging Face tokenizer drops them."""
        kept = (i for i in (int(x) for x in ids) if 0 <= i < self.vocab_size)
        return self.decode(kept, skip_special=True, stop_at_eos=True)

    def batch_decode_responses(self, rows: Sequence[Iterable[int]]) -> list[str]:
        """:meth:`decode_response` for each row of a batch (e.g. a [B, R] tensor)."""
        return [self.decode_response(row) for row in rows]

    def state_dict(self) -> dict:
        """JSON-serialisable description, enough to rebuild the same tokenizer."""
        return {"kind": "char", "alphabet": self.alphabet}

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, alphabet={self.alphabet!r})"


class HFTokenizer:
    """A Hugging Face tokenizer (``transformers``) behind the :class:`Tokenizer` interface.

    ``vocab_size`` is ``len(tokenizer)``: the base vocabulary plus added special tokens, i.e. every
    id the tokenizer can produce, which is what the model's embedding must cover. A tokenizer
    without a pad token pads with its eos token (left padding is masked, so any id works).
    ``chat_template``: None applies the tokenizer's chat template when it has one, True requires
    one, False never applies it.
    """

    def __init__(self, tokenizer: Any, source: str, chat_template: Optional[bool] = None):
        self.hf, self.source = tokenizer, source
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"data.tokenizer={source!r} has no eos token: generation needs one to know where "
                              "a response ends (set eos_token in its tokenizer_config.json)")
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.eos_token_ids = [self.eos_token_id]
        if tokenizer.pad_token_id is None:
            logger.info("data.tokenizer=%r has no pad token: padding with its eos token %r (id %d)",
                        source, tokenizer.eos_token, self.eos_token_id)
            self.pad_token_id = self.eos_token_id
        else:
            self.pad_token_id = int(tokenizer.pad_token_id)
        self.bos_token_id = tokenizer.bos_token_id
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template and not has_template:
            raise ConfigError(f"data.chat_template=true but data.tokenizer={source!r} has no chat template")
        self.use_chat_template = has_template if chat_template is None else bool(chat_template)
        self.vocab_size = len(tokenizer)

    @classmethod
    def from_pretrained(cls, path: str, chat_template: Optional[bool] = None) -> "HFTokenizer":
        """Load the tokenizer folder ``path`` (a directory or ``pkg://package/dir``); never downloads."""
        local = resolve_path(path, "data.tokenizer")
        if not os.path.isdir(local):
            raise ConfigError(f"data.tokenizer={path!r}: {local!r} is not a directory (tokenizers are loaded "
                              "from a local folder only, never downloaded)")
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - transformers is installed in dev setups
            raise ConfigError("data.tokenizer needs the transformers package: pip install 'resilient-rl[hf]'") from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(local, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"data.tokenizer={path!r} holds no loadable tokenizer: {exc}") from exc
        return cls(tokenizer, path, chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``; ``add_special_tokens`` adds what the tokenizer's post-processor adds (bos)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def format_prompt(self, text: "str | list[dict]") -> str:
        """The prompt as text: a string wrapped as a user turn, or a list of chat messages
        (``{"role", "content"}``, verl's prompts) as they are, each plus the assistant's opening,
        through the chat template. Without one a string is returned as it is and messages are
        refused (TokenizerError): joining them some other way would not be the model's format."""
        messages = text if isinstance(text, list) else None
        if not self.use_chat_template:
            if messages is not None:
                raise TokenizerError(f"the prompt is a list of chat messages, but data.tokenizer={self.source!r} "
                                     "has no chat template" + (" applied (data.chat_template=false)"
                                                               if getattr(self.hf, "chat_template", None) else ""))
            return text  # type: ignore[return-value]
        try:
            return self.hf.apply_chat_template(messages or [{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=False)
        except Exception as e:  # the template's own checks (roles out of order, ...) raise jinja errors
            raise TokenizerError(f"data.tokenizer={self.source!r}: its chat template refused the prompt: "
                                 f"{type(e).__name__}: {e}") from e

    def encode_prompt(self, text: "str | list[dict]") -> list[int]:
        """A prompt's ids: through the chat template (which writes its own special tokens), else with bos."""
        if self.use_chat_template:
            return self.encode(self.format_prompt(text), add_special_tokens=False)
        return self.encode(self.format_prompt(text), add_special_tokens=True)  # a string as it is; messages refused

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``; ids outside the vocabulary (a model may have spare rows) are dropped."""
        kept = [i for i in (int(x) for x in ids) if 0 <= i < self.vocab_size]
        return self.hf.decode(kept, skip_special_tokens=skip_special)

    def add_eos_token_ids(self, ids: Iterable[int]) -> None:
        """Also end responses at ``ids`` (the model's generation config lists the ids a chat model
        stops on; its tokenizer names only one). Ids outside the vocabulary are refused."""
        for raw in ids:
            i = int(raw)
            if not 0 <= i < self.vocab_size:
                raise ConfigError(f"eos token id {i} (from the model's generation_config.json/config.json) is "
                                  f"outside data.tokenizer={self.source!r}'s vocabulary of {self.vocab_size} ids")
            if i not in self.eos_token_ids:
                self.eos_token_ids.append(i)

    def decode_response(self, ids: Iterable[int]) -> str:
        """A generated response as text: everything before the first eos (any of
        :attr:`eos_token_ids`), specials dropped."""
        stops = set(self.eos_token_ids)
        out = []
        for raw in ids:
            i = int(raw)
            if i in stops:
                break
            out.append(i)
        return self.decode(out)

    def batch_decode_responses(self, rows: Sequence[Iterable[int]]) -> list[str]:
        """:meth:`decode_response` for each row of a batch (e.g. a [B, R] tensor)."""
        return [self.decode_response(row) for row in rows]

    def state_dict(self) -> dict:
        """JSON-serialisable description: where the tokenizer came from and whether prompts are templated."""
        return {"kind": "hf", "path": self.source, "chat_template": self.use_chat_template,
                "vocab_size": self.vocab_size}

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size}, eos={self.eos_token_ids}, "
                f"pad={self.pad_token_id}, chat_template={self.use_chat_template})")


def build_tokenizer(data_cfg: Any, task: Any = None) -> "CharTokenizer | HFTokenizer":
    """The run's tokenizer: ``data.tokenizer``'s folder if set, else characters of the task's alphabet."""
    path = getattr(data_cfg, "tokenizer", None)
    if path is None:
        return CharTokenizer(getattr(task, "alphabet", DEFAULT_ALPHABET))
    return HFTokenizer.from_pretrained(path, getattr(data_cfg, "chat_template", None))
